"""`crossover report` on a fixture database whose answers are designed in.

The fixture (SQLite at head, rows written by telemetry.writer from StepStats)
holds plain decoding, ngram (depth 2) and mtp (depth 3) at batch sizes 1..32,
for two tenants alone and mixed, in three time phases (acme alone, globex
alone, mixed). Acceptance per position is drawn from known rates; step times
are set so speculation's goodput over plain is RATIO at each batch size, which
puts ngram's crossover at 16 and mtp's at 32.
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import Engine

from bench.report.build import ReportRequest, build_report
from bench.report.data import MIXED, open_database, read_telemetry
from bench.report.measured import acceptance_rows, crossovers, goodput_cells
from bench.report.planned import PlanInputs
from bench.report.stats import wilson
from cli.main import main
from engine.types import StepStats
from store.db import make_engine
from telemetry.writer import request_row, step_row, write_rows

BATCHES = (1, 2, 4, 8, 16, 32)
STEPS_PER_CELL = 40
TRUE_ACCEPT = {
    ("ngram", "acme"): (0.8, 0.6), ("ngram", "globex"): (0.5, 0.3), ("ngram", MIXED): (0.65, 0.45),
    ("mtp", "acme"): (0.7, 0.5, 0.3), ("mtp", "globex"): (0.6, 0.4, 0.2), ("mtp", MIXED): (0.65, 0.45, 0.25),
}
"""Unconditional acceptance per draft position, per (technique, tenant alone | mixed)."""
RATIO = {"ngram": {1: 1.5, 2: 1.5, 4: 1.4, 8: 1.2, 16: 0.7, 32: 0.6},
         "mtp": {1: 1.6, 2: 1.6, 4: 1.5, 8: 1.4, 16: 1.2, 32: 0.7}}
"""Speculation's goodput over plain decoding at each batch size, by design."""
CROSSOVER = {"ngram": (16, 8), "mtp": (32, 16)}
"""(crossover, last batch size where speculation pays) that RATIO puts in."""
POOL_PAGES = {"none": 1000, "ngram": 1000, "mtp": 900}
PHASES = {"acme": 1000.0, "globex": 2000.0, MIXED: 3000.0}
"""Start time of each phase: every step of a group lies in [start, start + 1000)."""
TRUE_REQUEST_RATE = {("acme", "alone"): 0.7, ("acme", "mixed"): 0.55, ("acme", "both"): 0.6,
                     ("globex", "alone"): 0.4, ("globex", "mixed"): 0.35}
REQUEST_WINDOWS = {"alone": None, "mixed": (3000.0, 3999.0), "both": (1500.0, 3500.0)}


def _plain_ms(batch: int) -> float:
    return 10.0 + 0.5 * batch


def _group(batch: int, k: int) -> str:
    if batch == 1:
        return ("acme", "globex")[k % 2]
    return ("acme", "globex", MIXED, MIXED)[k % 4]


class _Diffuser:
    """Integer counts whose running total tracks a real target exactly (error diffusion), so the
    fixture's acceptance over any group equals its designed rate up to one draft."""

    def __init__(self) -> None:
        self.target: dict[tuple, float] = {}
        self.given: dict[tuple, int] = {}

    def take(self, key: tuple, amount: float) -> int:
        self.target[key] = self.target.get(key, 0.0) + amount
        n = round(self.target[key]) - self.given.get(key, 0)
        self.given[key] = self.given.get(key, 0) + n
        return n


def _steps() -> list[StepStats]:
    """Every (technique, batch) cell: STEPS_PER_CELL steps; step times carry a +-3% noise in
    pairs (1 - e, 1 + e) per group, so each group's mean step time is exactly its design."""
    by_phase: dict[str, list[dict]] = {g: [] for g in PHASES}
    counts = _Diffuser()
    for tech in ("none", "ngram", "mtp"):
        for b in BATCHES:
            seen: dict[str, int] = {}
            for k in range(STEPS_PER_CELL):
                group = _group(b, k)
                tenants = ("acme", "globex") if group == MIXED else (group,)
                row = {"batch_size": b, "technique": tech, "tenants": tenants, "kv_pages_used": 10 * b,
                       "kv_pages_free": POOL_PAGES[tech] - 10 * b, "policy_version": 1}
                i = seen[group] = seen.get(group, -1) + 1
                noise = 1.0 + (0.03 if i % 2 else -0.03) * (1 + (i // 2) % 3) / 3
                if tech == "none":
                    row.update(decode_tokens=b, step_ms=_plain_ms(b) * noise)
                else:
                    rates = TRUE_ACCEPT[(tech, group)]
                    per_pos = [counts.take((tech, group, pos), b * p) for pos, p in enumerate(rates)]
                    expected = 1 + sum(rates)
                    row.update(depth=len(rates), proposed=b * len(rates), accepted=sum(per_pos),
                               accepted_per_pos=tuple(per_pos), decode_tokens=b + sum(per_pos),
                               step_ms=_plain_ms(b) * expected / RATIO[tech][b] * noise)
                by_phase[group].append(row)
    steps = []
    for group, rows in by_phase.items():
        for i, row in enumerate(rows):
            steps.append(StepStats(step_id=len(steps), time=PHASES[group] + i * 999.0 / len(rows), **row))
    return steps


def _offered(tech: str, group: str) -> int:
    """Drafts the fixture offers at each position of (technique, group): one per row per step."""
    return sum(b for b in BATCHES for k in range(STEPS_PER_CELL) if _group(b, k) == group)


def _requests() -> list[SimpleNamespace]:
    out = []
    for (tenant, kind), rate in TRUE_REQUEST_RATE.items():
        start, end = REQUEST_WINDOWS[kind] or (PHASES[tenant], PHASES[tenant] + 999.0)
        proposed = 2000
        out.append(SimpleNamespace(
            request_id=f"{tenant}-{kind}", tenant=tenant, prompt_tokens=10, output_tokens=100,
            arrival_time=start, first_token_time=start + 1, finish_time=end, finish_reason="length",
            proposed_tokens=proposed, accepted_tokens=round(proposed * rate), preemptions=0))
    return out


@pytest.fixture
def fixture_url(db_url: str, db: Engine) -> str:
    with db.begin() as conn:
        write_rows(conn, [step_row(s) for s in _steps()], [request_row(r) for r in _requests()])
    return db_url


@pytest.fixture
def fixture_report(fixture_url: str, tmp_path: Path) -> tuple[Path, str]:
    out = tmp_path / "report"
    readme = build_report(ReportRequest(db=fixture_url, out=out, plan=PlanInputs(context=4096),
                                        source_command="pytest fixture"))
    return out, readme.read_text()


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND", path
    return struct.unpack(">II", data[16:24])


def _telemetry(url: str):
    engine = open_database(url)
    try:
        return read_telemetry(engine)
    finally:
        engine.dispose()


def test_report_has_every_section_and_valid_figures(fixture_report):
    out, text = fixture_report
    for heading in ("## Q1.", "## Q2.", "### Measured", "### PREDICTED for TPU v6e-1 and H200", "## Q3.",
                    "### PROJECTION for larger Gemma 3 models", "## Q4.", "### Mixture of experts"):
        assert heading in text
    assert "pytest fixture" in text and "**Machine**" in text and "**Date**" in text
    names = ("q1_acceptance.png", "q1_tenants.png", "q2_goodput_measured.png", "q2_goodput_predicted.png",
             "q3_displacement.png", "q4_moe.png")
    for name in names:
        assert f"]({name})" in text, name
        width, height = _png_size(out / name)
        assert width >= 300 and height >= 200
    assert "| tpu-v6e-1 | bfloat16 |" in text and "does not fit" in text  # 26B/4B in bf16 on a v6e-1
    for model in ("gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"):
        assert f"| {model} |" in text
    assert "| gemma3-27b | int4" in text  # the first weight dtype that fits a v6e-1


def test_report_crossover_is_the_designed_one(fixture_url, fixture_report):
    found = crossovers(goodput_cells(_telemetry(fixture_url)))
    for mix in ("all", MIXED):
        for tech, (batch, paying) in CROSSOVER.items():
            assert (found[mix][tech].batch, found[mix][tech].last_paying) == (batch, paying), (mix, tech)
    text = fixture_report[1]
    assert "| ngram | all | B=16 (crossover in (8, 16]) |" in text
    assert "| mtp | all | B=32 (crossover in (16, 32]) |" in text
    assert "- ngram, mixed batches: pays at B = 2, 4, 8; loses at B = 16, 32" in text
    short = text.split("## Answers in short")[1].split("\n## ")[0]
    assert ("**mtp**: B=32 (crossover in (16, 32])" in short
            and "**ngram**: B=16 (crossover in (8, 16])" in short)
    q1 = short.split("### Q1.")[1].split("### Q2.")[0]  # the paragraph carries the numbers and their CI
    ngram = q1.split("**ngram**")[1]  # alone (0.8, 0.6) and (0.5, 0.3) pool to the mixed (0.65, 0.45)
    assert "mixed is not distinguishable from alone" in ngram
    assert "alone, tenants range from globex 0.400 [" in ngram and "to acme 0.700 [" in ngram
    assert "![Q1](q1_acceptance.png)" in q1 and "Source: `xo_steps.accepted_per_pos`" in q1


def test_report_intervals_contain_the_true_rates(fixture_url):
    t = _telemetry(fixture_url)
    rows = acceptance_rows(t)
    checked = 0
    for (tech, group), rates in TRUE_ACCEPT.items():
        cis = rows[tech][group if group == MIXED else f"{group} alone"]
        assert len(cis) == len(rates)
        n = _offered(tech, group)
        for ci, p in zip(cis, rates):
            assert ci.contains(p), (tech, group, ci, p)
            # the interval is Wilson's on the designed counts: the denominator is the drafts offered
            expect = wilson(round(p * n), n)
            assert (ci.low, ci.high) == pytest.approx((expect.low, expect.high), abs=2e-3), (tech, group)
            checked += 1
    assert checked == 15
    for (tenant, kind), rate in TRUE_REQUEST_RATE.items():
        c = t.by_tenant[(tenant, kind)]  # the request's kind comes from the steps it overlapped
        assert c.requests == 1 and wilson(c.accepted, c.proposed).contains(rate), (tenant, kind)
    cells = goodput_cells(t)["all"]
    for b in BATCHES:  # true goodput: b tokens per plain step time; speculation RATIO times that
        plain = 1000.0 * b / _plain_ms(b)
        assert cells["none"][b].contains(plain), b
        for tech, ratios in RATIO.items():
            ci = cells[tech][b]
            assert ci.contains(ratios[b] * plain) and ci.high - ci.low < 0.2 * ci.value, (tech, b, ci)


def test_report_measured_displacement(fixture_report):
    text = fixture_report[1]
    # mtp's steps had 100 fewer pool pages than plain's: in 4096-token tenants of gemma3-270m
    # (256 global + 33 local-ring pages each) that is 100 / 289 = 0.35 tenants
    row = next(line for line in text.splitlines() if line.startswith("| mtp | ") and "MiB" in line)
    assert "| 0.35 |" in row
    assert next(line for line in text.splitlines() if line.startswith("| ngram | ") and "| 0.00 |" in line)


def test_empty_database_says_no_data(db_url, tmp_path):
    out = tmp_path / "empty-report"
    text = build_report(ReportRequest(db=db_url, out=out)).read_text()
    sections = text.split("\n## ")
    for number in ("Q1.", "Q2.", "Q3.", "Q4."):
        section = next(s for s in sections if s.startswith(number))
        assert "No data" in section, number
    assert "not recorded" in text  # no source command given
    assert "No speculating step was recorded, so there is no acceptance to compare." in text
    assert "![Q1](q1_acceptance.png)" not in text  # no figure is linked that was not drawn
    assert (out / "q4_moe.png").is_file()  # the planner's MoE verdict needs no telemetry
    assert not (out / "q1_acceptance.png").exists() and not (out / "q2_goodput_measured.png").exists()


def test_cli_writes_the_report(fixture_url, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["report", "--db", fixture_url, "--out", str(out), "--context", "2048"]) == 0
    assert (out / "README.md").is_file() and str(out / "README.md") in capsys.readouterr().out
    assert "--context 2048" in (out / "README.md").read_text()


@pytest.mark.parametrize("case", ["missing-file", "unmigrated", "unreachable-server"])
def test_cli_bad_db_exits_2_naming_it(case, tmp_path, capsys, request):
    if case == "missing-file":
        db = str(tmp_path / "no-such.db")
        expect = db
    elif case == "unmigrated":
        db = request.getfixturevalue("rev1_url")
        expect = db
    else:
        db = "postgresql+psycopg://report:s3cret@127.0.0.1:1/telemetry"
        expect = "postgresql+psycopg://report:***@127.0.0.1:1/telemetry"
    assert main(["report", "--db", db, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "crossover report: error: --db" in err and expect in err
    assert "s3cret" not in err
    if case == "unmigrated":
        assert "crossover db upgrade" in err
    if case == "missing-file":
        assert not Path(db).exists()  # checking did not create it


def test_cli_unwritable_out_exits_2_naming_it(db_url, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "report"
    assert main(["report", "--db", db_url, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(out) in err


def test_cli_bad_model_exits_2(db_url, tmp_path, capsys):
    assert main(["report", "--db", db_url, "--out", str(tmp_path), "--model", "gpt-9"]) == 2
    assert "gpt-9" in capsys.readouterr().err


def test_q4_reports_a_technique_beyond_the_proposers_for_one_instance(db_url, tmp_path):
    """Steps of a technique the engine's policy does not know (a compacting early exit, say) fill
    Q4; --instance keeps another daemon's rows out."""
    steps = [(StepStats(step_id=i, time=100.0 + i, batch_size=4, decode_tokens=4, technique=tech,
                        step_ms=ms * (1 + 0.01 * (i % 3)), tenants=("acme",)), inst)
             for i in range(10) for tech, ms, inst in (("none", 10.0, "b"), ("exit_compact", 8.0, "b"),
                                                        ("exit_other", 8.0, "a"))]
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            write_rows(conn, [step_row(s, inst) for s, inst in steps], [])
    finally:
        engine.dispose()
    text = build_report(ReportRequest(db=db_url, out=tmp_path / "r", instance="b")).read_text()
    q4 = text.split("\n## Q4.")[1].split("\n### Mixture")[0]
    assert "No data" not in q4 and "| exit_compact | 10 | 4 |" in q4
    assert "exit_other" not in text and "instance `b`" in text


def _early_exit_run(path: Path) -> Path:
    """A small `bench early-exit` JSON with hand-picked figures."""
    import json

    cells = [{"batch": b, "threshold": t, "speedup_vs_never": s, "exit_fraction": f}
             for b, t, s, f in ((1, "never", 1.0, 0.0), (1, 0.9, 1.23, 0.31), (4, "never", 1.0, 0.0),
                                (4, 0.9, 0.97, 0.29))]
    quality = [{"threshold": 0.9, "greedy_agreement": 0.9712, "sequences_identical": 0.5,
                "perplexity": 48.6, "perplexity_ratio": 1.33}]
    path.write_text(json.dumps({"lossy": True, "grid": {"exits": [8], "confidence": "prob", "new_tokens": 32},
                                "kv_fill": "state propagation", "model": "gemma3-270m", "dtype": "float32",
                                "cells": cells, "quality": quality,
                                "command": "crossover bench early-exit --x 1"}))
    return path


def test_q4_shows_the_early_exit_runs_given(db_url, tmp_path, capsys):
    run = _early_exit_run(tmp_path / "exit8.json")
    out = tmp_path / "with-early-exit"
    assert main(["report", "--db", db_url, "--out", str(out), "--early-exit", str(run)]) == 0
    text = (out / "README.md").read_text()
    q4 = next(s for s in text.split("\n## ") if s.startswith("Q4."))
    assert "#### `exit8.json` (LOSSY" in q4 and "No data" not in q4
    assert "| 0.9 | 1.23x (31%) | 0.97x (29%) |" in q4  # threshold row: batch 1, batch 4
    assert "| never | 1.00x (0%) | 1.00x (0%) |" in q4
    assert "| 0.9 | 0.971 | 50% | 48.6 | 1.33 |" in q4
    assert "crossover bench early-exit --x 1" in q4
    assert f"--early-exit {run}" in text  # the report's own command names the file


@pytest.mark.parametrize("content", ["not json", '{"lossy": true, "cells": []}'])
def test_a_bad_early_exit_file_exits_2_naming_it(content, db_url, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["report", "--db", db_url, "--out", str(tmp_path / "out"), "--early-exit", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--early-exit" in err and str(bad) in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_committed_early_exit_results_render():
    runs = sorted(Path(__file__).resolve().parents[2].glob("bench/results/early-exit/*.json"))
    assert runs, "bench/results/early-exit holds the measured runs"
    from bench.report.early import load_runs, section

    text = "\n".join(section(load_runs(tuple(runs))))
    assert text.count("#### ") == len(runs) and "batch 64" in text
