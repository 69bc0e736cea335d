"""`crossover bench early-exit` on the tiny random model: every batch/threshold cell of each K/V
fill is in its JSON, the figures agree with each other, the timed runs compile nothing, and the
flags are checked. The real model is measured by the slow test at the end (minutes)."""

from __future__ import annotations

import json

import pytest

from bench.early_exit import (
    HELD_OUT,
    PAYS_MARGIN,
    EarlyExitGrid,
    fill_path,
    held_out_ids,
    measure,
    prompt_ids,
    write_result,
)
from bench.early_exit_decoder import EarlyExit
from cli.main import main as cli_main
from engine.speculation.heads import DraftHeads
from tests.engine.conftest import ChatBytes, make_engine

FILLS = ("propagate", "recompute")
GRID = EarlyExitGrid(batches=(1, 2, 4), thresholds=(0.0, 0.01, 0.5), exits=(3,), new_tokens=6,
                     prompt_tokens=12, exit_vocab=128, quality_batch=4, ppl_tokens=10, kv_fills=FILLS)


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory):
    """Both fills' JSON from one measurement, by fill."""
    cfg, params = tiny
    engine = make_engine(tiny, ChatBytes())
    heads = DraftHeads.random(cfg, 0, (3,), 128, seed=2, scale=0.5)
    ee = EarlyExit(cfg, params, heads, exits=(3,), exit_vocab=128, page_size=4)
    out = tmp_path_factory.mktemp("ee") / "early-exit.json"
    res = measure(ee, engine, ChatBytes(), GRID, log=lambda msg: None)
    assert set(res) == set(FILLS)
    for f, r in res.items():
        write_result(fill_path(str(out), f, FILLS), r)
    return {f: json.loads(out.with_name(f"early-exit-{f}.json").read_text()) for f in FILLS}


@pytest.fixture(params=FILLS)
def result(request, results):
    return results[request.param]


def test_every_batch_and_threshold_cell_is_measured(result):
    cells = {(c["batch"], c["threshold"]) for c in result["cells"]}
    assert cells == {(b, t) for b in GRID.batches for t in ("never", *GRID.thresholds)}
    assert [r["batch"] for r in result["plain_loop"]] == list(GRID.batches)
    assert [r["batch"] for r in result["engine"]] == list(GRID.batches)
    recompute = result["kv_fill"] == "recompute"
    for c in result["cells"]:
        assert c["kv_fill"] == result["kv_fill"]
        assert c["tokens_per_s"] > 0 and 0 <= c["exit_fraction"] <= 1
        assert c["exit_fraction_by_layer"] == {"3": c["exit_fraction"]}
        eng = next(e for e in result["engine"] if e["batch"] == c["batch"])["tokens_per_s"]
        assert c["speedup_vs_engine"] == pytest.approx(c["tokens_per_s"] / eng)
        if c["threshold"] == "never":
            assert c["exit_fraction"] == 0 and c["speedup_vs_never"] == 1.0 and c["steps_compacted"] == 0
        if c["threshold"] == 0.0 and not recompute:
            assert c["exit_fraction"] == 1.0 and c["steps_compacted"] == 1.0 and c["caught_up_per_token"] == 0
        if c["threshold"] == 0.0 and recompute:  # 5 decode steps: 4 exit, the 5th forced to catch up 4
            assert c["exit_fraction"] == pytest.approx(0.8) and c["forced_per_token"] == pytest.approx(0.2)
            assert c["caught_up_per_token"] == pytest.approx(0.8)
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
    assert set(result["parts_ms"]["4"]["propagate"]) == {"stage0@4", "write@4", "plain@4", *parts}
    segs = {f"stage1@{n}" + (f"x{t}" if t > 1 else "") for n in (1, 2, 4) for t in (1, 2, 3, 5)}
    writes = {"write@4", "write@4x2", "write@4x3", "write@4x5"}
    assert set(result["parts_ms"]["4"]["recompute"]) == {"stage0@4", "plain@4", *segs, *writes}
    assert all(v > 0 for p in result["parts_ms"]["4"].values() for v in p.values())


def test_both_fills_come_from_one_run(results):
    """The plain loop, the engine and "never" are shared; each fill's cells are its own."""
    p, r = results["propagate"], results["recompute"]
    assert p["plain_loop"] == r["plain_loop"] and p["engine"] == r["engine"]
    never = [{k: v for k, v in c.items() if k != "kv_fill"} for c in p["cells"] if c["threshold"] == "never"]
    assert never == [{k: v for k, v in c.items() if k != "kv_fill"} for c in r["cells"]
                     if c["threshold"] == "never"]
    assert p["same_run_as"] == r["same_run_as"] == list(FILLS) and r["max_pending"] == 4
    assert "propagated" in p["note"] and "run later" in r["note"]


def test_fill_path():
    assert fill_path("a/ee.json", "recompute", FILLS) == "a/ee-recompute.json"
    assert fill_path("a/ee.json", "recompute", ("recompute",)) == "a/ee.json"


def test_quality_rows_per_threshold(result):
    q = {r["threshold"]: r for r in result["quality"]}
    assert set(q) == set(GRID.thresholds)
    always = q[0.0]
    assert all(r["kv_fill"] == result["kv_fill"] for r in q.values())
    if result["kv_fill"] == "propagate":
        assert always["exit_fraction"] == 1.0 and always["perplexity_exit_fraction"] == 1.0
        assert always["greedy_agreement"] == always["agreement_at_exits"]
    else:  # every 5th step forced full (4 pending): 9 scored steps, 8 exit
        assert always["exit_fraction"] == pytest.approx(0.8)
        assert always["perplexity_exit_fraction"] == pytest.approx(8 / 9)
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
    assert cli_main(["bench", "early-exit", "--kv-fill", "propagate,later"]) == 2
    assert "kv fills" in capsys.readouterr().err


@pytest.mark.slow
def test_real_model_runs_every_cell(tmp_path):
    from bench.early_exit import run_bench

    # One batch size and one threshold: the tiny-model tests above cover the grid's bookkeeping;
    # this one checks that the real model, its shipped adapters and both fills run end to end.
    grid = EarlyExitGrid(batches=(2,), thresholds=(0.9,), new_tokens=4, quality_batch=2, ppl_tokens=8,
                         kv_fills=FILLS)
    results = run_bench(str(tmp_path / "ee.json"), grid)
    for f, res in results.items():
        assert {(c["batch"], c["threshold"]) for c in res["cells"]} == {(2, "never"), (2, 0.9)}
        assert res["compiles"]["during_timed_runs"] == 0
        assert json.loads((tmp_path / f"ee-{f}.json").read_text())["kv_fill"] == f
