"""`crossover report` Q1 on steps whose rows drafted with several techniques (row classes).

A mixed batch of copy (n-gram, 4 deep) and chat (MTP, 2 deep) rows records
"ngram" at the step level with the sums of both; Q1 must count each class at
its own technique and depth, and each tenant's own rows in mixed batches."""

from __future__ import annotations

from pathlib import Path

from bench.report.data import MIXED, open_database, read_telemetry
from bench.report.measured import q1_section
from engine.types import RowClass, StepStats
from store.db import make_engine
from telemetry.writer import step_row, write_rows


def _step(i: int, tenants: tuple[str, ...], per_pos: tuple, classes: tuple[RowClass, ...] = (),
          proposed: int = 0) -> StepStats:
    return StepStats(step_id=i, time=100.0 + i, batch_size=sum(c.rows for c in classes) or 1,
                     decode_tokens=5, technique="ngram", depth=4,
                     proposed=sum(c.proposed for c in classes) or proposed, accepted=sum(per_pos),
                     accepted_per_pos=per_pos, step_ms=10.0, tenants=tenants, row_classes=classes)


STEPS = [
    _step(0, ("chat", "copy"), (3, 2, 1, 0), (RowClass("copy", "ngram", 4, 2, 8, 5, (2, 2, 1, 0)),
                                               RowClass("chat", "mtp", 2, 1, 2, 1, (1, 0)))),
    _step(1, ("copy",), (1, 1, 0, 0), proposed=4),  # recorded before row classes
    _step(2, ("chat", "copy"), (2, 1, 1, 0), (RowClass("copy", "ngram", 4, 1, 4, 3, (1, 1, 1, 0)),
                                               RowClass("chat", "ngram", 2, 1, 2, 1, (1, 0)))),
]


def _telemetry(db_url: str):
    engine = make_engine(db_url)
    with engine.begin() as conn:
        write_rows(conn, [step_row(s) for s in STEPS], [])
    engine.dispose()
    engine = open_database(db_url)
    try:
        return read_telemetry(engine)
    finally:
        engine.dispose()


def _counts(acc: dict) -> dict:
    return {k: (c.steps, c.proposed, [round(x, 6) for x in c.offered], c.accepted) for k, c in acc.items()}


def test_q1_counts_each_row_class_at_its_technique_and_depth(db_url: str) -> None:
    t = _telemetry(db_url)
    assert _counts(t.acceptance) == {
        ("ngram", MIXED): (2, 14, [4, 4, 3, 3], [4, 3, 2, 0]),  # copy 4 deep twice, chat 2 deep once
        ("mtp", MIXED): (1, 2, [1, 1], [1, 0]),
        ("ngram", "copy"): (1, 4, [1, 1, 1, 1], [1, 1, 0, 0]),
    }
    assert _counts(t.mixed_by_tenant) == {
        ("ngram", "copy"): (2, 12, [3, 3, 3, 3], [3, 3, 2, 0]),
        ("ngram", "chat"): (1, 2, [1, 1], [1, 0]),
        ("mtp", "chat"): (1, 2, [1, 1], [1, 0]),
    }
    assert t.depths == {"ngram": {4: 3, 2: 1}, "mtp": {2: 1}}
    assert t.techniques == {"ngram": 3}  # every step once, under its recorded technique
    # goodput: the step of n-gram and MTP rows once, as "mixed"; the others as n-gram
    assert {k: m.n for k, m in t.goodput.items() if k[1] == "all"} == {
        ("mixed", "all", 3): 1, ("ngram", "all", 1): 1, ("ngram", "all", 2): 1}


def test_q1_shows_each_tenant_inside_mixed_batches(db_url: str, tmp_path: Path) -> None:
    text = "\n".join(q1_section(_telemetry(db_url), tmp_path))
    assert "Per tenant inside mixed batches" in text
    assert "| mtp | chat | 1 | 2 |" in text and "| ngram | copy | 2 | 12 |" in text
    assert "| mtp | mixed tenants | 1 | 2 |" in text
    assert "copy alone is not distinguishable from copy in mixed batches 0.667" in text  # 8/12
