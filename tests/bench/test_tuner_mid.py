"""`crossover bench tuner --mid-mixed`: a fourth phase of every tenant at moderate load, and
the per-phase comparison of the autotuned run (free to give tenants rules of their own) with
the best single-depth policy of each phase.

One short fake run (2.5 s phases, in-thread searches, no probe) serves the module's tests; it
includes the fixed per-tenant policy ("tenants") and the tuner with per-tenant rules off
("single-rule").
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import pytest

from bench.tuner_ratios import TARGETS, single_depth
from bench.tuner_report import _steps, cell_shares
from cli.main import main as cli
from engine.types import RowClass, StepStats

PHASES = ["low-copy", "high-mixed", "low-prose", "mid-mixed"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench-tuner-mid") / "tuner.json"
    flags = ["--fake", "--phase-seconds", "2.5", "--rate-scale", "4", "--low-rate", "0.5",
             "--high-rate", "6", "--mid-mixed", "--mid-rate", "3", "--max-tokens", "32",
             "--techniques", "ngram", "--depths", "2,4",
             "--runs", "autotuned,never,fixed,tenants,single-rule",
             "--retune-interval", "0.4", "--trials", "8", "--min-new-steps", "20",
             "--profile-steps", "30", "--validation-min-steps", "20", "--search-in-thread",
             "--probe-retunes", "0", "--out", str(out)]
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", err)
        assert cli(["bench", "tuner", *flags]) == 0
    return json.loads(out.read_text()), err.getvalue()


def test_the_fourth_phase_mixes_every_tenant_at_moderate_load(run: tuple) -> None:
    result, _ = run
    assert [p["name"] for p in result["trace"]] == PHASES
    mid = result["trace"][3]
    assert mid["max_concurrency"] == 8 and set(mid["mix"]) == {"copy", "code", "chat", "prose"}
    assert mid["requests"] > 0 and mid["rate_per_s"] == pytest.approx(12.0)
    for name, policy in result["policies"].items():
        phase = policy["phases"][3]
        assert phase["goodput"] > 0 and phase["errors"] == 0, name
        assert 1.0 < phase["mean_batch"] <= 8.0, name  # capped at 8 in flight


def test_per_tenant_against_the_best_single_depth_policy_per_phase(run: tuple) -> None:
    result, err = run
    rows = result["ratios"]["per_phase_vs_single_depth"]
    assert [r["name"] for r in rows] == PHASES
    policies = result["policies"]
    single = [n for n in policies if n.startswith("fixed:") or n == "never"]
    for i, r in enumerate(rows):
        best = max(single, key=lambda n: policies[n]["phases"][i]["goodput"])
        assert r["best_single_depth"] == best
        assert r["static"] == policies[best]["phases"][i]["goodput"]
        assert r["ratio"] == pytest.approx(policies["autotuned"]["phases"][i]["goodput"] / r["static"],
                                           abs=1e-4)
        assert r["target"] == (TARGETS["mid_single_depth"] if PHASES[i] == "mid-mixed" else None)
        assert 0.0 <= r["per_row_steps"] <= 1.0
    assert "phase 4 per-tenant vs best single depth" in err


def test_the_fixed_per_tenant_policy_runs_beside_the_single_depth_ones(run: tuple) -> None:
    """The "tenants" run pins its per-tenant rules (each tenant's rows at its own depth in one
    step), is compared with each phase's best single-depth policy without a target, and is
    not one of the static policies the autotuned run is compared with."""
    from engine.policy import TunedPolicy

    result, err = run
    policies = result["policies"]
    ruled = TunedPolicy.from_dict(policies["tenants"]["policy"])
    assert ruled.choose(8) == ("ngram", 2)
    assert [ruled.choose_row(8, t)
            for t in ("copy-tenant", "code-tenant", "chat-tenant", "prose-tenant")] == [
        ("ngram", 4), ("ngram", 4), ("ngram", 2), ("none", 0)]
    mid = policies["tenants"]["phases"][3]
    assert mid["goodput"] > 0 and mid["errors"] == 0
    assert mid["per_row_steps"] > 0.5  # at batches of 4-8 most steps mix tenants
    assert {"ngram@4", "ngram@2", "none"} <= set(mid["cells"])
    rows = result["ratios"]["tenants_vs_single_depth"]
    single = [n for n in policies if n.startswith("fixed:") or n == "never"]
    for i, r in enumerate(rows):
        best = max(single, key=lambda n: policies[n]["phases"][i]["goodput"])
        assert r["best_single_depth"] == best and r["target"] is None and r["met"] is None
        assert r["ratio"] == pytest.approx(policies["tenants"]["phases"][i]["goodput"] / r["static"],
                                           abs=1e-4)
    assert all(r["best_static"] != "tenants" for r in result["ratios"]["per_phase"])
    assert "phase 4 fixed per-tenant policy vs best single depth" in err


def test_the_single_rule_tuner_runs_without_per_tenant_rules_and_is_compared(run: tuple) -> None:
    """The "single-rule" run is the tuned daemon with per-tenant rules off: its retunes weigh
    none and apply none, it is not a static policy, and the autotuned run is compared with it
    per phase and over the whole trace against the 2% bound."""
    result, err = run
    policies = result["policies"]
    single = policies["single-rule"]
    assert single["policy"] is None  # tuned, not pinned
    retunes = [r for r in single["history"]["retunes"] if r.get("search")]
    assert retunes and all(not r.get("tenants") for r in retunes)
    assert all(not p["body"].get("tenants") for p in single["history"]["policies"])
    assert all(r["best_static"] != "single-rule" for r in result["ratios"]["per_phase"])
    assert "single-rule" not in result["ratios"]["oracle_vs_best_fixed"]["per_phase"]
    rows = result["ratios"]["vs_single_rule"]
    assert [r["phase"] for r in rows] == list(range(len(PHASES)))
    for i, r in enumerate(rows):
        assert r["ratio"] == pytest.approx(policies["autotuned"]["phases"][i]["goodput"]
                                           / single["phases"][i]["goodput"], abs=1e-4)
        assert r["target"] == TARGETS["single_rule"] == 0.98
    whole = result["ratios"]["whole_vs_single_rule"]
    assert whole["ratio"] == pytest.approx(policies["autotuned"]["whole"]["goodput"]
                                           / single["whole"]["goodput"], abs=1e-4)
    assert "phase 4 vs the single-rule tuner" in err and "whole_vs_single_rule" in err


def test_the_engine_loads_the_tenant_policy_s_techniques() -> None:
    """The techniques the table and the "tenants" run name are loaded beside --techniques."""
    from bench.tuner import TunerBenchConfig, named_techniques

    cfg = TunerBenchConfig(techniques=("ngram",), runs=("tenants", "table"),
                           tenant_policy=(("*", "ngram", 2), ("copy-tenant", "mtp", 2),
                                          ("prose-tenant", "none", 0)))
    assert named_techniques(cfg) == {"ngram", "mtp"}
    assert named_techniques(TunerBenchConfig(runs=("fixed",))) == set()


def test_a_bad_tenant_policy_is_a_user_error(capsys: pytest.CaptureFixture) -> None:
    for bad, named in (("copy-tenant=ngram@4", "tenant_policy="), ("*=ngram", "'*=ngram'"),
                       ("*=ngram@2,prose-tenant=none@2", "prose-tenant=none@2"),
                       ("*=ngram@2,copy-tenant=ngram@9", "tenant_policy=")):
        assert cli(["bench", "tuner", "--fake", "--runs", "tenants", "--tenant-policy", bad]) == 2, bad
        assert named in capsys.readouterr().err, bad


def test_every_real_retune_weighed_per_tenant_rules(run: tuple) -> None:
    """The autotuned run's searches record their per-tenant decision and its time."""
    result, err = run
    retunes = [r for r in result["policies"]["autotuned"]["history"]["retunes"] if r.get("search")]
    assert retunes
    for r in retunes:
        t = r["tenants"]
        assert t["method"] in ("exact", "tpe", "skipped") and t["seconds"] >= 0
        if t["method"] != "skipped":
            assert t["candidates"] >= 1 and t["single_goodput"] > 0
            # considering per-tenant rules never predicts less than the single-rule optimum
            assert t["tenant_goodput"] >= t["single_goodput"] * (1 - 1e-9)
            assert t["chosen"] == (t["gain"] > t["margin"] and bool(t["rules"]))
    assert "per-tenant searches:" in err


def test_the_summary_counts_steps_with_per_row_choices() -> None:
    def step(*cells: tuple[str, int]) -> StepStats:
        classes = tuple(RowClass(f"t{i}", t, d, 1) for i, (t, d) in enumerate(cells))
        return StepStats(batch_size=len(cells), decode_tokens=len(cells), step_ms=1.0,
                         technique=cells[0][0], depth=max(d for _, d in cells), row_classes=classes)

    steps = [step(("ngram", 4), ("none", 0)), step(("ngram", 2), ("ngram", 2)), step(("none", 0)),
             StepStats(batch_size=2, decode_tokens=2, step_ms=1.0)]
    assert _steps(steps)["per_row_steps"] == 0.25


def test_the_summary_splits_a_step_over_its_row_classes() -> None:
    """A step of n-gram and MTP rows counts in both cells, by its rows; one without classes in
    its own."""
    mixed = StepStats(batch_size=4, technique="ngram", depth=4, row_classes=(
        RowClass("copy", "ngram", 4, 2), RowClass("chat", "mtp", 2, 1), RowClass("prose", "none", 0, 1)))
    old = StepStats(batch_size=2, technique="ngram", depth=4)
    assert cell_shares(mixed) == {"ngram@4": 0.5, "mtp@2": 0.25, "none": 0.25}
    assert _steps([mixed, old])["cells"] == {"ngram@4": 0.75, "mtp@2": 0.125, "none": 0.125}


def test_single_depth_ratio_takes_each_phase_s_best_fixed_policy() -> None:
    def run_of(*goodputs: float) -> dict[str, Any]:
        return {"phases": [{"goodput": g, "per_row_steps": 0.5} for g in goodputs]}

    auto = run_of(100.0, 120.0)
    static = {"never": run_of(90.0, 100.0), "fixed:ngram@2": run_of(95.0, 110.0),
              "table": run_of(200.0, 200.0)}
    rows = single_depth(auto, static, ["never", "fixed:ngram@2"], ["low-copy", "mid-mixed"])
    assert [r["best_single_depth"] for r in rows] == ["fixed:ngram@2", "fixed:ngram@2"]
    assert [r["ratio"] for r in rows] == [round(100 / 95, 4), round(120 / 110, 4)]
    assert [r["target"] for r in rows] == [None, TARGETS["mid_single_depth"]]
    assert rows[1]["met"] is True
