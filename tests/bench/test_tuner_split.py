"""`crossover bench tuner --fake --trace memory-bound,light`: fixed pool splits against the
tuner's on the fake engine whose split is real (bench/split_bench.py).

One short run serves every test in this module."""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import pytest

from bench.split_bench import TARGET, split_fake
from bench.tuner import TunerBenchConfig
from bench.workloads.memory import split_trace
from cli.main import main as cli
from engine.policy import BatchRule, TunedPolicy
from engine.types import Request, SamplingParams

SPLITS = ["0", "0.25", "0.5"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench-split") / "split.json"
    flags = ["--fake", "--trace", "memory-bound,light", "--splits", ",".join(SPLITS),
             "--phase-seconds", "2.5", "--rate-scale", "4", "--high-rate", "4", "--fake-time-scale", "0.5",
             "--kv-budget", "32MiB", "--search-in-thread", "--out", str(out)]
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", err)
        assert cli(["bench", "tuner", *flags]) == 0
    return json.loads(out.read_text()), err.getvalue()


def test_each_trace_has_every_split_and_the_tuned_run(run: tuple) -> None:
    result, log = run
    assert result["bench"] == "tuner-split" and set(result["traces"]) == {"memory-bound", "light"}
    assert result["engine"]["total_pages"] == 512  # 32 MiB at the fake's 64 KiB a page
    for name, t in result["traces"].items():
        assert list(t["fixed"]) == SPLITS
        runs = [*t["fixed"].values(), t["tuned"]]
        assert all(r["errors"] == 0 and r["goodput"] > 0 for r in runs), name
        assert len({r["engine_tokens"] for r in runs}) == 1, name  # greedy: the same tokens
        best = max(t["fixed"], key=lambda s: t["fixed"][s]["goodput"])
        assert t["best_fixed_split"] == float(best)
        assert t["ratio"] == pytest.approx(t["tuned"]["goodput"] / t["fixed"][best]["goodput"], abs=1e-3)
        assert t["met"] == (t["ratio"] >= TARGET)
        assert TunedPolicy.from_dict(t["decision"]["policy"]).pool_split == t["chosen_split"]
        assert t["tuned"]["policy"]["pool_split"] == t["chosen_split"]  # what was pinned
    assert "memory-bound split" in log


def test_the_fixed_splits_ran_with_the_split_they_name(run: tuple) -> None:
    """The lent pages bound the draft (no drafts at split 0, every row at 0.5 on the light
    trace) and the tenants' pages bound the batch on the memory-bound one."""
    light, bound = run[0]["traces"]["light"], run[0]["traces"]["memory-bound"]
    assert light["fixed"]["0"]["drafting_share"] == 0 and light["fixed"]["0.5"]["drafting_share"] == 1.0
    assert bound["fixed"]["0.5"]["mean_batch"] < bound["fixed"]["0"]["mean_batch"]
    assert bound["fixed"]["0"]["mean_queue"] > 1  # requests wait for pages


def test_the_tuner_lends_less_on_the_memory_bound_trace(run: tuple) -> None:
    light, bound = run[0]["traces"]["light"], run[0]["traces"]["memory-bound"]
    assert bound["chosen_split"] < light["chosen_split"]
    assert light["decision"]["predicted"]["held_share"] == 1.0  # light: every row drafted
    # the decision saw the pool bind (requests waiting for pages) only on the memory-bound trace
    assert (bound["decision"]["traffic"]["queue_per_step"]
            and not light["decision"]["traffic"]["queue_per_step"])
    for t in (light, bound):  # each choice measures near the best fixed split of its trace
        assert t["ratio"] >= 0.9


def test_the_fake_split_takes_tenant_pages_and_bounds_the_draft() -> None:
    cfg = TunerBenchConfig(fake=True, traces=("light",), kv_budget=64 * (64 << 10))  # 64 pages
    engine = split_fake(cfg)
    engine.set_policy(TunedPolicy((BatchRule(64, "draft", 2),), crossover=64, pool_split=0.5))
    for i in range(3):  # 20 pages each (300 prompt + 20 output tokens)
        engine.add_request(Request(f"r{i}", [40] * 300, SamplingParams(max_tokens=20, ignore_eos=True)))
    stats = engine.step().stats
    assert stats.batch_size == 1 and stats.queue_len == 2  # 32 tenant pages hold one
    assert stats.proposed == 2 and stats.kv_pages_free == 12  # the lent 32 hold its draft
    assert split_trace("light", 1.0, 1.0).max_tokens < split_trace("memory-bound", 1.0, 1.0).max_tokens


def test_split_repeats_run_every_policy_each_round_and_report_medians(tmp_path: Any) -> None:
    """--split-repeats 3: three rounds of every fixed split and the tuned policy (decided once,
    from the first round), each policy reported by its median-goodput round."""
    out = tmp_path / "split.json"
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", err)
        assert cli(["bench", "tuner", "--fake", "--trace", "light", "--splits", "0,0.5", "--split-repeats",
                    "3", "--phase-seconds", "1.5", "--rate-scale", "4", "--fake-time-scale", "0.5",
                    "--kv-budget", "32MiB", "--search-in-thread", "--out", str(out)]) == 0
    t = json.loads(out.read_text())["traces"]["light"]
    assert len(t["rounds"]) == 3 and len(t["ratio_per_round"]) == 3
    for key in ("0", "0.5", "tuned"):
        goodputs = sorted(rd[key]["goodput"] for rd in t["rounds"])
        shown = t["tuned"] if key == "tuned" else t["fixed"][key]
        assert shown["goodput"] == goodputs[1]  # the median round's
    assert {rd["tuned"]["policy"]["pool_split"] for rd in t["rounds"]} == {t["chosen_split"]}
    log = err.getvalue()
    assert "light-split-0.5-r3" in log and "light-tuned-r3" in log


def test_split_repeats_below_one_is_a_user_error(capsys: pytest.CaptureFixture) -> None:
    assert cli(["bench", "tuner", "--fake", "--trace", "light", "--split-repeats", "0"]) != 0
    assert "split_repeats=0" in capsys.readouterr().err
