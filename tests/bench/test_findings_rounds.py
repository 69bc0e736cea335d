"""`crossover bench findings --quick` in rounds: the plan's order, ratios within rounds, Q3's binding queue
without speculation memory for plain decoding, Q1 greedy and sampled, the verdict table, Q4 intervals."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from bench.findings import Driver, Engines
from bench.findings_config import FindingsConfig
from bench.findings_plan import estimate_s, plan, q3_plan
from bench.report.early import run_section, speedup_ci
from bench.report.q2_rounds import analyse as q2_analyse
from bench.report.q3_rounds import analyse as q3_analyse
from bench.report.runs import Q2_BASE, read_runs, read_sequences
from cli.main import main
from store.db import make_engine
from store.migrate import ensure_schema

QUICK = FindingsConfig.quick_config("x", "y")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Path, str, str, dict]:
    tmp = tmp_path_factory.mktemp("rounds")
    url, out = f"sqlite:///{tmp / 'f.db'}", tmp / "report"
    assert main(["bench", "findings", "--db", url, "--out", str(out), "--quick"]) == 0
    return out, (out / "README.md").read_text(), url, json.loads((out / "findings.json").read_text())


def test_the_default_plan_interleaves_rounds_and_fits_the_time_it_claims():
    cfg = FindingsConfig(db="x")
    runs = plan(cfg, cfg.techniques)
    q2 = [r for r in runs if r.phase == "q2"]
    assert cfg.rounds >= 3 and sorted({r.context for r in q2}) == [512, 2048, 4096]
    groups: dict[tuple, list] = defaultdict(list)
    for r in q2:
        groups[(r.instance, r.batch)].append((r.technique, r.depth))
    cells = {(t, d) for t in cfg.techniques for d in cfg.depths}
    for order in groups.values():  # plain first and last, every (technique, depth) once between
        assert order[0] == order[-1] == ("none", 0) and sorted(order[1:-1]) == sorted(cells)
    firsts = {r.round: groups[(r.instance, r.batch)][1] for r in q2 if r.context == 512 and r.batch == 1}
    assert len(set(firsts.values())) == cfg.rounds  # the techniques' order turns each round
    minutes = sum(estimate_s(runs, cfg).values()) / 60
    assert 45 < minutes < 90, minutes


def test_runs_ran_in_the_planned_order_plain_first_in_every_round(measured):
    _, _, _, facts = measured
    ran = [(r["phase"], r["instance"], r["technique"]) for r in facts["runs"]]
    planned = [(p.phase, p.instance, p.technique) for p in plan(QUICK, QUICK.techniques)]
    assert ran == planned
    q3 = [r for r in facts["runs"] if r["phase"] == "q3"]
    for rnd in range(1, QUICK.rounds + 1):
        mine = [r for r in q3 if r["round"] == rnd]
        assert mine[0]["technique"] == "none" and {r["technique"] for r in mine[1:]} == {"mtp", "draft"}


def test_q2_ratios_are_formed_within_a_round_with_intervals_over_rounds(measured):
    out, text, url, _ = measured
    engine = make_engine(url)
    try:
        runs = read_runs(engine)
    finally:
        engine.dispose()
    q = q2_analyse(runs)
    assert q.rounds == QUICK.rounds and q.contexts == sorted(QUICK.contexts)
    ctx, batch = QUICK.contexts[0], 4
    cell = q.cells[(ctx, "ngram")][batch]
    for rnd, ratio in cell.ratios.items():
        inst = f"{Q2_BASE}-c{ctx}-r{rnd}"
        group = [r for r in runs if r.instance == inst and r.requests == batch]
        plain = [r for r in group if r.technique == "none"]
        spec = next(r for r in group if r.technique == "ngram" and r.depth == cell.depth)
        assert len(plain) == 2  # before and after the techniques
        expect = spec.goodput / (sum(r.decode_tokens for r in plain) / sum(r.decode_s for r in plain))
        assert ratio == pytest.approx(expect)
    for (c, tech), cells in q.cells.items():
        assert all(x.ci is not None and x.ci.low <= x.ci.value <= x.ci.high
                   for x in cells.values()), (c, tech)
        assert q.crossover[(c, tech)] is not None
    assert all(q.knee[c] is not None for c in q.contexts)
    section = text.split("### Measured in rounds: speculation over plain")[1].split("\n### ")[0]
    assert f"{QUICK.rounds} rounds" in section and "](q2_rounds.png)" in section
    assert (out / "q2_rounds.png").stat().st_size > 1000


def test_q3_queue_exceeds_the_pool_and_plain_holds_no_speculation_memory(measured):
    _, text, url, facts = measured
    engines = facts["engines"]
    assert not any(p["resident_bytes"] for p in engines["q3-none"]["proposers"].values())
    assert engines["q3-mtp"]["proposers"]["mtp"]["resident_bytes"] > 0
    assert engines["q3-none"]["total_pages"] > engines["q3-mtp"]["total_pages"]
    q3 = [r for r in facts["runs"] if r["phase"] == "q3"]
    assert all(r["prefix_reset"] for r in q3)
    for r in q3:  # more requests than the pool holds at once, below max_batch
        assert r["peak_batch"] < min(r["requests"], QUICK.max_batch), r
    for rnd in range(1, QUICK.rounds + 1):  # the cache emptied first: every run hits as plain's did
        hits = {r["prefix_hit_tokens"] for r in q3 if r["round"] == rnd}
        assert len(hits) == 1, hits
    engine = make_engine(url)
    try:
        q = q3_analyse(read_runs(engine))
    finally:
        engine.dispose()
    assert q.queue_exceeds_pool and q.rounds == QUICK.rounds
    mtp = q.rows["mtp@2"]
    assert mtp.displaced_ci().value > 0 and mtp.lent_ci().value > 0 and mtp.gain_ci() is not None
    section = text.split("### Measured in rounds: tenants displaced")[1].split("\n### ")[0]
    assert "exceeded the pool in every round" in section and "| mtp@2 |" in section


def test_emptying_the_prefix_cache_before_a_run_repeats_its_hits(tmp_path):
    url = f"sqlite:///{tmp_path / 'p.db'}"
    ensure_schema(url)
    cfg = FindingsConfig.quick_config(url, str(tmp_path))
    drv = Driver(Engines(cfg, lambda m: None), url, lambda m: None)
    p = q3_plan(cfg, ("mtp",))[0]
    prompts = [("copy-tenant", [2] + [20 + i] * 40) for i in range(3)]
    try:
        first, again = drv.run(p, prompts), drv.run(p, prompts)
        kept = drv.run(p.__class__(**{**p.__dict__, "reset_prefix": False}), prompts)
    finally:
        drv.close()
    assert again.prefix_hit_tokens == first.prefix_hit_tokens < kept.prefix_hit_tokens


def test_q1_has_greedy_and_sampled_sequences_for_every_kind(measured):
    _, text, url, facts = measured
    engine = make_engine(url)
    try:
        seqs = read_sequences(engine, ("findings-tenants", "findings-tenants-sampled"))
    finally:
        engine.dispose()
    per: dict[tuple, int] = defaultdict(int)
    for s in seqs:
        per[(s.instance, s.version, s.tenant)] += 1
    q1 = [r for r in facts["runs"] if r["phase"] == "q1"]
    assert {r["sampling"] for r in q1} == {"greedy", "sampled"}
    for r in q1:
        for tenant in r["tenants"]:
            assert per[(r["instance"], r["version"], tenant)] >= QUICK.q1_prompts
    section = text.split("### Per tenant, by sequence")[1].split("\n### ")[0]
    assert "| greedy | ngram | mixed |" in section and "| sampled | ngram | mixed |" in section
    assert "resample whole sequences" in section


def test_the_verdict_table_opens_the_report_with_the_four_questions(measured):
    _, text, _, _ = measured
    table = text.split("## Verdicts")[1].split("## Answers in short")[0]
    rows = [x for x in table.splitlines() if x.startswith("| Q")]
    assert [r[2:4] for r in rows] == ["Q1", "Q2", "Q3", "Q4"]
    assert all(len(r.split(" | ")) == 4 for r in rows)
    assert "PREDICTION" in rows[1].split(" | ")[2] and "[" in rows[1].split(" | ")[1]
    assert "displaces" in rows[2] and "PREDICTION" in rows[2]
    assert text.index("## Verdicts") < text.index("## Answers in short")


def test_q4_cells_with_rounds_get_an_interval(tmp_path):
    data = {"lossy": True, "grid": {"exits": [8], "rounds": 3}, "quality": [],
            "cells": [{"batch": 1, "threshold": 0.9, "speedup_vs_never": 1.2, "exit_fraction": 0.1,
                       "speedup_by_round": [1.1, 1.2, 1.3]},
                      {"batch": 4, "threshold": 0.9, "speedup_vs_never": 1.0, "exit_fraction": 0.1}]}
    ci = speedup_ci(data["cells"][0])
    assert ci is not None and ci.low < ci.value < ci.high
    assert math.isclose(ci.value, (1.1 * 1.2 * 1.3) ** (1 / 3))
    assert speedup_ci(data["cells"][1]) is None
    text = "\n".join(run_section(tmp_path / "x.json", data))
    assert "1.20x [1.1" in text and "95% interval over rounds" in text


def test_dry_run_prints_the_estimate_and_measures_nothing(tmp_path, capsys):
    db = tmp_path / "never.db"
    assert main(["bench", "findings", "--db", str(db), "--out", str(tmp_path / "r"), "--dry-run",
                 "--rounds", "4", "--contexts", "512,1024"]) == 0
    err = capsys.readouterr()
    assert "estimated" in err.out + err.err and not db.exists()
