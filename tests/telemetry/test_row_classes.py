"""Steps whose rows drafted with several techniques: readers count acceptance per row class.

One step drafts n-gram for one tenant and MTP for another; its step-level
columns say "ngram" (the most drafting rows), the verify depth and the sums.
Acceptance per technique and per position must count each class under its
own technique and depth, raw and after roll-up; step time counts the step
once, under "mixed"."""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import Engine, select

from bench.telemetry import sample_step
from engine.types import RowClass
from store.db import session_scope
from store.models import StepRollup
from telemetry import queries
from telemetry.retention import RetentionConfig, apply_retention
from telemetry.writer import step_row, write_rows

T0 = 1_700_000_040.0  # a minute boundary


def _step(t: float, technique: str, depth: int, per_pos: tuple, batch: int, step_ms: float,
          decode: int, classes: tuple[RowClass, ...] = ()) -> dict:
    rec = dataclasses.replace(
        sample_step(0, t), technique=technique, depth=depth, accepted_per_pos=per_pos,
        proposed=sum(c.proposed for c in classes) if classes else depth * batch,
        accepted=sum(per_pos), batch_size=batch, step_ms=step_ms, decode_tokens=decode,
        row_classes=classes)
    return step_row(rec)


STEPS = [
    # mixed: two copy rows n-gram 4 deep (8 drafts, 5 accepted), one chat row MTP 2 deep (2, 1)
    _step(T0 + 1, "ngram", 4, (3, 2, 1, 0), batch=3, step_ms=30.0, decode=9, classes=(
        RowClass("copy", "ngram", 4, 2, 8, 5, (2, 2, 1, 0)),
        RowClass("chat", "mtp", 2, 1, 2, 1, (1, 0)))),
    # a step from before row classes: one row, n-gram 4 deep
    _step(T0 + 2, "ngram", 4, (1, 1, 0, 0), batch=1, step_ms=10.0, decode=3),
    # n-gram only, two depths, and a row that did not draft
    _step(T0 + 3, "ngram", 4, (2, 1, 1, 0), batch=3, step_ms=20.0, decode=8, classes=(
        RowClass("copy", "ngram", 4, 1, 4, 3, (1, 1, 1, 0)),
        RowClass("chat", "ngram", 2, 1, 2, 1, (1, 0)),
        RowClass("prose", "none", 0, 1))),
]


@pytest.fixture
def filled(db: Engine) -> Engine:
    with db.begin() as conn:
        write_rows(conn, STEPS, [])
    return db


def _acceptance(db: Engine) -> tuple[dict, list]:
    with session_scope(db) as s:
        by_technique = {a.key: (a.count, a.proposed, a.accepted)
                        for a in queries.acceptance_by_technique(s, T0)}
        positions = [(p.technique, p.position, p.proposed, p.accepted)
                     for p in queries.acceptance_by_position(s, T0)]
    return by_technique, positions


# offered per position: n-gram 2 (copy rows of step 1) + 1 (step 2) + 1 (copy, step 3) at
# every position, + 1 (chat, step 3) at positions 0 and 1; MTP 1 at positions 0 and 1
NGRAM_POSITIONS = [("ngram", 0, 5, 5), ("ngram", 1, 5, 4), ("ngram", 2, 4, 2), ("ngram", 3, 4, 0)]
MTP_POSITIONS = [("mtp", 0, 1, 1), ("mtp", 1, 1, 0)]


def test_acceptance_counts_each_row_class_under_its_technique(filled: Engine) -> None:
    by_technique, positions = _acceptance(filled)
    # steps stay under their recorded technique; drafts go to each class's
    assert by_technique == {"ngram": (3, 8 + 4 + 6, 5 + 2 + 4), "mtp": (0, 2, 1)}
    assert positions == MTP_POSITIONS + NGRAM_POSITIONS  # by technique name
    with session_scope(filled) as s:
        only_mtp = queries.acceptance_by_position(s, T0, technique="mtp")
    assert [(p.position, p.proposed, p.accepted) for p in only_mtp] == [(0, 1, 1), (1, 1, 0)]


def test_rollups_keep_the_row_classes_apart(filled: Engine) -> None:
    before = _acceptance(filled)
    apply_retention(filled, RetentionConfig(raw_steps_s=60.0), now=T0 + 125.0)  # rolls the minute
    with session_scope(filled) as s:
        rows = {(r.technique, r.depth): (r.steps, r.proposed, r.accepted, r.accepted_per_pos)
                for r in s.scalars(select(StepRollup))}
        hist = queries.batch_size_histogram(s, T0)
        goodput = queries.goodput_over_time(s, 60, T0)
    assert rows == {("ngram", 4): (3, 16, 10, [4, 4, 2, 0]),  # every step, once
                    ("ngram", 2): (0, 2, 1, [1, 0]), ("mtp", 2): (0, 2, 1, [1, 0])}
    assert hist == {1: 1, 3: 2}
    assert [(g.steps, g.output_tokens) for g in goodput] == [(3, 20)]
    assert _acceptance(filled) == before


def test_a_step_of_several_techniques_times_as_mixed_once(filled: Engine) -> None:
    with session_scope(filled) as s:
        times = [(t.technique, t.batch_size, t.depth, t.steps, t.mean_ms)
                 for t in queries.step_time_by(s, T0)]
        ngram = [(t.technique, t.batch_size) for t in queries.step_time_by(s, T0, technique="ngram")]
        mixed = [(t.technique, t.batch_size) for t in queries.step_time_by(s, T0, technique="mixed")]
        goodput = [(g.technique, g.batch_size, g.steps, g.tokens_per_s)
                   for g in queries.goodput_by_batch(s, T0)]
    assert times == [("mixed", 3, 4, 1, 30.0), ("ngram", 1, 4, 1, 10.0), ("ngram", 3, 4, 1, 20.0)]
    assert ngram == [("ngram", 1), ("ngram", 3)] and mixed == [("mixed", 3)]
    assert goodput == [("mixed", 3, 1, pytest.approx(300.0)), ("ngram", 1, 1, pytest.approx(300.0)),
                       ("ngram", 3, 1, pytest.approx(400.0))]
