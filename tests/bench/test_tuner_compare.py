"""`crossover bench tuner-compare`: two `bench tuner` results compared ratio by ratio."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench.tuner_compare import compare, load, readings
from cli.main import main

FULL = "bench/results/tuner/full-repeats3-search-one-cpu.json"
QUICK = "bench/results/tuner/quick-one-round-split-cache.json"


def test_a_run_agrees_with_itself_and_the_committed_full_run_reads_its_rounds() -> None:
    full = load(FULL)
    read = readings(full)
    assert set(read) >= {"low-copy vs best static", "whole vs oracle", "retune ITL p99"}
    assert all(len(r["rounds"]) == 3 for r in read.values())
    assert all(r["range"][0] <= r["median"] <= r["range"][1] for r in read.values())
    itl = read["retune ITL p99"]["rounds"]
    assert itl == [r["retune_itl_p99_ratio"] for r in full["rounds"]]
    same = compare(full, full)
    assert same["agree"] and same["agreeing"] == same["compared"] == len(read)
    assert all(p["same"] for p in same["best_static"]) and all(t["same"] for t in same["targets"].values())


def test_a_ratio_moved_past_both_ranges_disagrees_and_the_cli_writes_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = load(FULL)
    moved = copy.deepcopy(full)
    moved["ratios"]["whole_vs_oracle"]["ratio"] += 0.3  # past the full run's rounds, its own range alone
    moved["rounds"] = []
    result = compare(moved, full)
    verdict = {r["name"]: r["agree"] for r in result["ratios"]}
    assert not result["agree"] and verdict["whole vs oracle"] is False
    assert sum(verdict.values()) == len(verdict) - 1
    path = tmp_path / "moved.json"
    path.write_text(json.dumps(moved))
    out = tmp_path / "cmp.json"
    assert main(["bench", "tuner-compare", str(path), FULL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{len(verdict) - 1} of {len(verdict)} ratios agree" in printed
    assert json.loads(out.read_text())["ratios"] == json.loads(json.dumps(result["ratios"]))


def test_the_one_round_quick_run_of_record_is_compared_with_the_full_run() -> None:
    result = compare(load(QUICK), load(FULL))
    by_name = {r["name"]: r for r in result["ratios"]}
    oracle = by_name["whole vs oracle"]["a"]
    assert len(by_name) == 7 and oracle["rounds"] == [oracle["median"]]
    for r in by_name.values():
        inside = r["b"]["range"][0] <= r["a"]["median"] <= r["b"]["range"][1]
        assert r["agree"] == (inside or r["a"]["median"] == r["b"]["median"])


@pytest.mark.parametrize("text, message", [("{}", "not a `crossover bench tuner` result"),
                                           ("not json", "Expecting value")])
def test_a_file_that_is_not_a_tuner_result_is_a_user_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["bench", "tuner-compare", str(bad), FULL]) == 2
    err = capsys.readouterr().err
    assert "bench tuner-compare" in err and str(bad) in err and message in err
