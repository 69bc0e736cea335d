"""`crossover bench early-exit` on the tiny random model: every batch/threshold cell is in the
JSON, the figures agree with each other, the timed runs compile nothing, and the flags are checked.
The real model is measured by the slow test at the end (minutes)."""

from __future__ import annotations

import json

import pytest

from bench.early_exit import (HELD_OUT, PAYS_MARGIN, EarlyExitGrid, held_out_ids, measure, prompt_ids,
                              write_result)
from daemon.cli import main as cli_main
from engine.early_exit import EarlyExit
from engine.heads import DraftHeads
from tests.engine.conftest import ChatBytes, make_engine

GRID = EarlyExitGrid(batches=(1, 2, 4), thresholds=(0.0, 0.01, 0.5), exits=(3,), new_tokens=6,
                     prompt_tokens=12, exit_vocab=128, quality_batch=4, ppl_tokens=10)


@pytest.fixture(scope="module")
def result(tiny, tmp_path_factory):
    cfg, params = tiny
    engine = make_engine(tiny, ChatBytes())
    heads = DraftHeads.random(cfg, 0, (3,), 128, seed=2, scale=0.5)
    ee = EarlyExit(cfg, params, heads, exits=(3,), exit_vocab=128, page_size=4)
    out = tmp_path_factory.mktemp("ee") / "early-exit.json"
    res = measure(ee, engine, ChatBytes(), GRID, log=lambda msg: None)
    write_result(str(out), res)
    return json.loads(out.read_text())


def test_every_batch_and_threshold_cell_is_measured(result):
    cells = {(c["batch"], c["threshold"]) for c in result["cells"]}
    assert cells == {(b, t) for b in GRID.batches for t in ("never", *GRID.thresholds)}
    assert [r["batch"] for r in result["plain_loop"]] == list(GRID.batches)
    assert [r["batch"] for r in result["engine"]] == list(GRID.batches)
    for c in result["cells"]:
        assert c["tokens_per_s"] > 0 and 0 <= c["exit_fraction"] <= 1
        assert c["exit_fraction_by_layer"] == {"3": c["exit_fraction"]}
        eng = next(e for e in result["engine"] if e["batch"] == c["batch"])["tokens_per_s"]
        assert c["speedup_vs_engine"] == pytest.approx(c["tokens_per_s"] / eng)
        if c["threshold"] == "never":
            assert c["exit_fraction"] == 0 and c["speedup_vs_never"] == 1.0 and c["steps_compacted"] == 0
        if c["threshold"] == 0.0:
            assert c["exit_fraction"] == 1.0 and c["steps_compacted"] == 1.0
    assert result["lossy"] is True and result["compiles"]["during_timed_runs"] == 0
    assert set(result["summary"]) == {str(b) for b in GRID.batches}
    for b, sm in result["summary"].items():  # threshold 0 is the bound, never the "best"
        mine = [c for c in result["cells"] if c["batch"] == int(b) and c["threshold"] not in ("never", 0.0)]
        best = max(mine, key=lambda c: c["tokens_per_s"])
        assert sm["best_threshold"] == best["threshold"]
        assert sm["pays"] == (best["speedup_vs_never"] >= PAYS_MARGIN)
        assert sm["always_exit_speedup_vs_never"] == next(
            c["speedup_vs_never"] for c in result["cells"] if c["batch"] == int(b) and c["threshold"] == 0.0)
    # Each part of a step timed alone: the first stage at the batch, the upper stage and the
    # propagation at every bucket up to it, the write, and the engine's forward.
    parts = {f"{k}@{n}" for k in ("stage1", "propagate3") for n in (1, 2, 4)}
    assert set(result["parts_ms"]["4"]) == {"stage0@4", "write@4", "plain@4", *parts}
    assert all(v > 0 for v in result["parts_ms"]["4"].values())


def test_quality_rows_per_threshold(result):
    q = {r["threshold"]: r for r in result["quality"]}
    assert set(q) == set(GRID.thresholds)
    always = q[0.0]
    assert always["exit_fraction"] == 1.0 and always["perplexity_exit_fraction"] == 1.0
    assert always["greedy_agreement"] == always["agreement_at_exits"]
    for r in q.values():
        assert 0 <= r["greedy_agreement"] <= 1 and 0 <= r["sequences_identical"] <= 1
        assert r["perplexity"] > 0
        assert r["perplexity_ratio"] == pytest.approx(r["perplexity"] / r["perplexity_full"])
    assert len({r["perplexity_full"] for r in q.values()}) == 1  # one full-model reference


def test_prompts_and_held_out_text_shapes():
    tok = ChatBytes()
    ps = prompt_ids(tok, 5, 12, seed=0)
    assert len(ps) == 5 and all(p[0] == tok.bos_id and 2 <= len(p) <= 12 for p in ps)
    rows = held_out_ids(tok, 30)
    assert len(rows) == len(HELD_OUT) and {len(r) for r in rows} == {31}


def test_bad_flags_are_user_errors(capsys):
    assert cli_main(["bench", "early-exit", "--batches", "1,x"]) == 2
    assert "'1,x'" in capsys.readouterr().err
    assert cli_main(["bench", "early-exit", "--thresholds", "-1"]) == 2
    assert "thresholds" in capsys.readouterr().err


@pytest.mark.slow
def test_real_model_runs_every_cell(tmp_path):
    from bench.early_exit import run_bench

    grid = EarlyExitGrid(batches=(1, 4), thresholds=(0.5, 0.9), new_tokens=4, quality_batch=4, ppl_tokens=8)
    res = run_bench(str(tmp_path / "ee.json"), grid)
    assert {(c["batch"], c["threshold"]) for c in res["cells"]} == {
        (b, t) for b in (1, 4) for t in ("never", 0.5, 0.9)}
    assert res["compiles"]["during_timed_runs"] == 0
