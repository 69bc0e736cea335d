"""`crossover bench tuner --fake`: the JSON is complete and consistent, the PNG is real, and
on the fake engine (known acceptance and costs) the tuner learns what pays.

One short run (2.5 s phases, in-thread searches) serves every test in this module.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

import bench.tuner
from bench.plots import MET, MISSED, REFERENCE, ratio_bars, tuner_figure
from bench.tuner_ratios import TARGETS
from bench.tuner_retunes import retune_itl
from cli.main import main as cli
from daemon.user_error import UserError
from engine.policy import TunedPolicy
from tests.bench.conftest import recording_resets

POLICIES = {"autotuned", "never", "fixed:ngram@4", "table"}
PHASES = ["low-copy", "high-mixed", "low-prose"]
PROBE_RETUNES = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("bench-tuner") / "tuner.json"
    flags = ["--fake", "--phase-seconds", "2.5", "--rate-scale", "4", "--low-rate", "0.5",
             "--high-rate", "6", "--max-tokens", "32", "--techniques", "ngram", "--depths", "4",
             "--retune-interval", "0.3", "--trials", "8",
             "--min-new-steps", "20", "--profile-steps", "30", "--validation-min-steps", "20",
             "--search-in-thread", "--probe-retunes", str(PROBE_RETUNES), "--probe-quiet", "0.5",
             "--out", str(out)]
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:  # capsys is per test; progress goes to stderr
        patch.setattr(sys, "stderr", err)
        patch.setattr(bench.tuner, "load_engine", recording_resets(bench.tuner.load_engine, RESETS))
        assert cli(["bench", "tuner", *flags]) == 0
    return json.loads(out.read_text()), err.getvalue(), out


RESETS: list[bool] = []
"""Whether the engine had work at each reset of its prefix cache during the `run` fixture."""


def test_each_policy_runs_with_the_prefix_cache_emptied(run: tuple) -> None:
    """Every policy replays the same prompts: the engine's prefix cache is emptied, while it is
    idle, before each run, so no run skips the prefill the run before it paid for (the first
    run, the autotuned one, once prefilled 16x the prompt tokens of every later one)."""
    result, _, _ = run
    assert len(result["policies"]) >= 3
    assert RESETS == [False] * len(result["policies"])


def test_every_policy_and_phase_is_there_with_positive_goodput(run: tuple) -> None:
    result, _, _ = run
    assert result["bench"] == "tuner" and result["engine"]["engine"] == "FakeEngine"
    assert [p["name"] for p in result["trace"]] == PHASES
    assert all(p["requests"] > 0 for p in result["trace"])
    assert set(result["policies"]) == POLICIES
    for name, policy in result["policies"].items():
        assert [p["phase"] for p in policy["phases"]] == [0, 1, 2], name
        for i, phase in enumerate(policy["phases"]):
            assert phase["goodput"] > 0 and phase["steps"] > 0, (name, i)
            assert phase["errors"] == 0, (name, i)
            assert phase["requests"] == result["trace"][i]["requests"], (name, i)
            assert phase["goodput"] == pytest.approx(phase["engine_tokens"] / phase["engine_s"], rel=1e-3)
            # the engine's events and the clients' usage count the same tokens
            assert phase["engine_tokens"] == phase["output_tokens"] > 0, (name, i)
            assert 0 < phase["itl_ms"]["p50"] <= phase["itl_ms"]["p99"], (name, i)
        whole = policy["whole"]
        assert whole["engine_tokens"] == sum(p["engine_tokens"] for p in policy["phases"])
        assert whole["engine_s"] == pytest.approx(sum(p["engine_s"] for p in policy["phases"]), abs=1e-3)
        assert whole["steps"] == sum(p["steps"] for p in policy["phases"])
        assert whole["goodput"] == pytest.approx(whole["engine_tokens"] / whole["engine_s"], rel=1e-3)
    # greedy and lossless: every policy serves the same tokens
    assert len({p["whole"]["output_tokens"] for p in result["policies"].values()}) == 1


def test_static_policies_were_pinned(run: tuple) -> None:
    """The engine ran what each static policy says (the fake always has drafts)."""
    policies = run[0]["policies"]
    for phase in policies["never"]["phases"]:
        assert set(phase["cells"]) == {"none"}
    for phase in policies["fixed:ngram@4"]["phases"]:
        assert set(phase["cells"]) == {"ngram@4"}
    table = TunedPolicy.from_dict(policies["table"]["policy"])
    assert [table.choose(b) for b in (1, 4, 5, 8, 9)] == [
        ("ngram", 4), ("ngram", 4), ("ngram", 2), ("ngram", 2), ("none", 0)]
    assert set().union(*(p["cells"] for p in policies["table"]["phases"])) <= {"ngram@4", "ngram@2", "none"}
    assert policies["table"]["phases"][0]["cells"].get("ngram@4", 0) > 0.5  # low load: small batches


def test_ratios_agree_with_the_goodputs(run: tuple) -> None:
    result = run[0]
    policies, ratios = result["policies"], result["ratios"]
    auto = policies["autotuned"]
    static = {n: p for n, p in policies.items() if n != "autotuned"}
    for i, r in enumerate(ratios["per_phase"]):
        best = max(static, key=lambda n: static[n]["phases"][i]["goodput"])
        assert r["phase"] == i and r["best_static"] == best
        expected = auto["phases"][i]["goodput"] / static[best]["phases"][i]["goodput"]
        assert r["ratio"] == pytest.approx(expected, abs=1e-4)
        assert r["target"] == TARGETS["phase"] and r["met"] == (r["ratio"] >= TARGETS["phase"])
    fixed = ratios["whole_vs_best_fixed"]
    candidates = [n for n in static if n == "never" or n.startswith("fixed:")]
    best_fixed = max(candidates, key=lambda n: static[n]["whole"]["goodput"])
    assert fixed["best_fixed"] == best_fixed and "never" in candidates
    assert fixed["ratio"] == pytest.approx(
        auto["whole"]["goodput"] / static[best_fixed]["whole"]["goodput"], abs=1e-4)
    assert fixed["met"] == (fixed["ratio"] >= TARGETS["best_fixed"])
    # the static oracle takes each phase's best static policy: never below the best fixed one
    oracle = ratios["oracle_vs_best_fixed"]
    assert oracle["per_phase"] == [r["best_static"] for r in ratios["per_phase"]]
    assert oracle["ratio"] >= 1.0 - 1e-6 and oracle["target"] is None
    assert ratios["whole_vs_oracle"]["static"] == oracle["goodput"]
    assert ratios["oracle_vs_table"]["ratio"] == pytest.approx(
        oracle["goodput"] / static["table"]["whole"]["goodput"], abs=1e-4)
    assert ratios["oracle_vs_table"]["ratio"] >= 1.0 - 1e-6 and ratios["oracle_vs_table"]["target"] is None
    table = ratios["whole_vs_table"]
    assert table["ratio"] == pytest.approx(
        auto["whole"]["goodput"] / static["table"]["whole"]["goodput"], abs=1e-4)
    assert table["target"] is None and table["met"] is None
    versus = ratios["whole_vs_oracle"]
    assert versus["target"] == TARGETS["oracle"] and versus["met"] == (versus["ratio"] >= TARGETS["oracle"])


def test_retune_itl_comparison(run: tuple) -> None:
    result = run[0]
    itl = result["retune_itl"]
    assert len(itl["retunes"]) == PROBE_RETUNES + 1  # the settling one, then the measured ones
    assert all(r["search_s"] > 0 and r["total_s"] >= r["search_s"] for r in itl["retunes"])
    assert all(r["status"] in ("applied", "rejected", "failed") for r in itl["retunes"])
    during, without = itl["during_ms"], itl["without_ms"]
    assert during["n"] > 0 and without["n"] > 0
    assert itl["p99_ratio"] == pytest.approx(during["p99"] / without["p99"], abs=1e-4)
    assert result["ratios"]["retune_itl"]["ratio"] == itl["p99_ratio"]
    assert result["ratios"]["retune_itl"]["target"] == TARGETS["retune_itl"]


def test_retune_itl_leaves_out_the_policy_the_last_retune_applied() -> None:
    """Gaps of 100 ms throughout, 110 ms while each retune searches; after the last retune
    (which applied a policy no search ran under) gaps of 300 ms, which must not count."""
    retune = lambda start: {"id": start, "start": start, "search_end": start + 2.0,
                            "end": start + 3.0, "status": "applied", "version": 1, "note": None}
    windows = [retune(10.0), retune(20.0)]
    t, chunks = 0.0, [0.0]
    while t < 40.0:
        searching = any(w["start"] <= t + 0.1 <= w["search_end"] for w in windows)
        t += 0.3 if t > 23.0 else 0.11 if searching else 0.1
        chunks.append(t)
    probe = {"settle": {**retune(0.0), "end": 3.0}, "windows": windows, "end": 40.0,
             "streams": [type("Stream", (), {"chunks": chunks})()]}
    itl = retune_itl(probe)
    assert itl["without_ms"]["p99"] == pytest.approx(100.0, abs=1.0)
    assert itl["during_ms"]["p99"] == pytest.approx(110.0, abs=1.0)
    assert itl["p99_ratio"] == pytest.approx(1.1, abs=0.02)


def test_the_tuner_learns_that_speculation_pays_on_copy_traffic(run: tuple) -> None:
    """Copy prompts accept most drafts on the fake: at batch 1 ngram@4 gives 3.7 tokens per
    step for 1.45x the step time (mtp@2: 1.9 for 1.22x). The first policy the tuner makes
    (from copy-heavy telemetry) must speculate at batch 1, and the copy phase must beat
    plain decoding."""
    policies = run[0]["policies"]
    history = policies["autotuned"]["history"]
    assert history["statuses"].get("applied", 0) >= 1, history["retunes"]
    searched = [r for r in history["retunes"] if "fit" in r]
    assert searched and all(r["search"]["method"] == "exact" and 0 < r["search"]["seconds"] < 30
                            for r in searched)
    made = [p for p in history["policies"] if p["source"] == "tuner"]
    assert made and TunedPolicy.from_dict(made[0]["body"]).choose(1)[0] != "none", made[0]
    copy = [policies[n]["phases"][0]["goodput"] for n in ("autotuned", "never")]
    assert copy[0] > 1.1 * copy[1], copy


def test_png_is_valid_and_shows_every_policy(run: tuple) -> None:
    result, _, out = run
    plot = result["plot"]
    assert Path(plot["path"]) == out.with_suffix(".png")
    rgb = np.round(imread(plot["path"])[..., :3] * 255)  # [height, width, 3]
    assert rgb.shape[1::-1] == (plot["width"], plot["height"]) == (1200, 800)
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50, "the image looks blank"
    assert set(plot["colors"]) == POLICIES
    flat = rgb.reshape(-1, 3)
    for name, colour in plot["colors"].items():
        assert (flat == colour).all(axis=1).sum() > 200, name  # its bars
    # Each ratio bar's colour covers at least most of the bar's own pixel area (legend patches
    # add a little); a colour no bar uses covers at most a legend patch. Bar heights follow the
    # ratios, so the areas come from the same figure laid out the same way.
    verdicts = ratio_bars(result)[3]  # met / missed / None per ratio bar, from the JSON
    areas = _ratio_bar_areas(result)
    assert len(areas) == len(verdicts) and areas[verdicts.index(None)] > 0  # the oracle's bars
    for colour, verdict in ((REFERENCE, None), (MET, True), (MISSED, False)):
        expected = sum(a for a, v in zip(areas, verdicts) if v is verdict)
        shown = (flat == colour).all(axis=1).sum()
        assert (shown >= 0.8 * expected) if expected else shown < 400, (colour, shown, expected)


def _ratio_bar_areas(result: dict) -> list[float]:
    """Pixel area of each ratio bar, in the order of `ratio_bars`."""
    figure = tuner_figure(result)
    figure.canvas.draw()
    ratios = figure.axes[1]
    # Antialiased edges are blends, not the bar's colour: count the interior 2 px in from each side.
    return [max(b.width - 4, 0) * max(b.height - 4, 0)
            for b in (p.get_window_extent() for p in ratios.patches)]


def test_png_axes_are_labelled_with_units_and_legends(run: tuple) -> None:
    result = run[0]
    goodput, ratios = tuner_figure(result).axes
    assert "tokens/s" in goodput.get_ylabel() and goodput.get_title()
    assert {t.get_text() for t in goodput.get_legend().get_texts()} == POLICIES
    assert [t.get_text() for t in goodput.get_xticklabels()] == [
        f"phase {i + 1}\n{name}" for i, name in enumerate(PHASES)] + ["whole trace"]
    assert ratios.get_ylabel() == "ratio"
    assert "target" in [t.get_text() for t in ratios.get_legend().get_texts()]
    assert len(ratios.patches) == len(ratios.get_xticklabels()) >= len(PHASES)  # a bar per ratio


def test_progress_on_stderr(run: tuple) -> None:
    err = run[1]
    for name in POLICIES:
        assert f"bench tuner: {name}: trace done" in err
    assert "phase 1 vs best static" in err and "whole_vs_table" in err and "wrote " in err
    assert "oracle_vs_best_fixed" in err and "oracle_vs_table" in err and "autotuned searches: " in err


def test_bad_flags_are_user_errors(capsys: pytest.CaptureFixture) -> None:
    assert cli(["bench", "tuner", "--fake", "--table", "8:2,4:4"]) == 2
    assert "table=" in capsys.readouterr().err
    assert cli(["bench", "tuner", "--fake", "--runs", "never,sometimes"]) == 2
    assert "runs=" in capsys.readouterr().err


def test_docstring_examples() -> None:
    import doctest

    import bench.tuner_report

    result = doctest.testmod(bench.tuner_report)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("techniques, proposers", [((), ("mtp", "early_exit", "draft")),
                                                   (("ngram",), ()), (("ngram", "mtp"), ("mtp",))])
def test_the_model_verifies_every_batch_size_with_the_compared_techniques(
        monkeypatch: pytest.MonkeyPatch, techniques: tuple, proposers: tuple) -> None:
    """The real engine: verification compiled up to max_batch (so "fixed" speculates at every
    batch size and the tuner's crossover can reach it), and only the heads-based proposers
    that the static policies use."""
    import engine.loader
    from bench.tuner import TunerBenchConfig, load_engine

    asked: dict[str, Any] = {}

    class Loaded:
        proposers: dict = {}  # noqa: RUF012

        def warmup(self, progress: bool) -> None:
            asked["warmed"] = True
            self.first_runs = self  # then each shape runs once

        def run_all(self, progress: object = None) -> int:
            asked["first_runs"] = True
            return 0

    monkeypatch.setattr(engine.loader, "load_engine", lambda **kw: asked.update(kw) or Loaded())
    load_engine(TunerBenchConfig(techniques=techniques, max_batch=48))
    assert asked["spec_max_batch"] == 48 and asked["max_batch"] == 48
    assert asked["model_proposers"] == proposers and asked["warmed"] and asked["first_runs"]


def test_the_trace_samples_the_kinds_it_is_told_to_with_a_seed_each() -> None:
    from bench.tuner import TunerBenchConfig, build_trace, fake_engine

    cfg = TunerBenchConfig(fake=True, phase_s=20.0, rate_scale=4.0, temperatures=(("prose", 0.7),))
    _, arrivals = build_trace(cfg, fake_engine(cfg))
    kinds = {a.tenant.removesuffix("-tenant") for a in arrivals}
    assert {"prose", "copy"} <= kinds
    for a in arrivals:
        if a.tenant == "prose-tenant":
            assert a.body["temperature"] == 0.7 and isinstance(a.body["seed"], int)
        else:
            assert a.body["temperature"] == 0.0 and "seed" not in a.body
    seeds = [a.body["seed"] for a in arrivals if "seed" in a.body]
    assert len(seeds) == len(set(seeds)) > 1
    greedy = TunerBenchConfig(fake=True, phase_s=20.0, rate_scale=4.0, temperatures=())
    assert all(a.body["temperature"] == 0.0 for a in build_trace(greedy, fake_engine(greedy))[1])


def test_bad_temperatures_are_user_errors(capsys: pytest.CaptureFixture) -> None:
    assert cli(["bench", "tuner", "--fake", "--temperatures", "poetry:0.5"]) == 2
    assert "poetry" in capsys.readouterr().err
    assert cli(["bench", "tuner", "--fake", "--temperatures", "chat:hot"]) == 2
    assert "hot" in capsys.readouterr().err


def test_quick_sets_its_values_unless_a_flag_is_given() -> None:
    from cli.commands.bench_tuner import QUICK, tuner_config
    from cli.main import build_parser

    def config(*flags: str) -> Any:
        return tuner_config(build_parser().parse_args(["bench", "tuner", "--fake", *flags]))

    full, quick = config(), config("--quick")
    assert (full.phase_s, full.depths, full.probe_retunes) == (60.0, (2, 4, 8), 12)
    assert (quick.phase_s, quick.depths, quick.probe_retunes) == (15.0, (2,), 3)
    # every proposer stays loaded for the autotuned run; the fixed policies are the table's technique's
    assert (full.techniques, full.fixed_techniques) == ((), ())
    assert (quick.techniques, quick.fixed_techniques) == ((), ("ngram",))
    assert {k: d for k, (d, _) in QUICK.items()} == {
        "phase_seconds": full.phase_s, "depths": "2,4,8", "probe_retunes": full.probe_retunes}
    given = config("--quick", "--phase-seconds", "30", "--depths", "1", "--fixed-techniques", "mtp,ngram",
                   "--table-technique", "mtp")
    assert (given.phase_s, given.depths, given.probe_retunes) == (30.0, (1,), 3)
    assert given.fixed_techniques == ("mtp", "ngram")
    # a flag given at its full-run default is given too: --quick does not replace it
    kept = config("--quick", "--phase-seconds", "60", "--probe-retunes", "12")
    assert (kept.phase_s, kept.probe_retunes) == (60.0, 12)
    assert config("--quick", "--table-technique", "mtp").fixed_techniques == ("mtp",)
    # a misspelt technique is refused while the flags are read, naming the flag and the value
    for flag in ("--techniques", "--fixed-techniques", "--table-technique"):
        with pytest.raises(UserError, match=f"{flag}: unknown technique 'ngarm'"):
            config(flag, "ngarm")


def test_fixed_techniques_choose_the_fixed_policies_among_the_loaded_ones() -> None:
    from bench.tuner import TunerBenchConfig, fake_engine, named_techniques, static_policies

    cfg = TunerBenchConfig(fake=True, phase_s=4.0, depths=(2,), fixed_techniques=("ngram",))
    engine = fake_engine(cfg)
    assert sorted(engine.capacity().proposers) == ["mtp", "ngram"]
    assert sorted(static_policies(cfg, engine)) == ["fixed:ngram@2", "never", "table"]
    every = static_policies(dataclasses.replace(cfg, fixed_techniques=()), engine)
    assert sorted(every) == ["fixed:mtp@2", "fixed:ngram@2", "never", "table"]
    # a fixed technique is loaded even when --techniques leaves it out; one never loaded is refused
    assert named_techniques(dataclasses.replace(cfg, techniques=("mtp",))) == {"ngram"}
    with pytest.raises(UserError, match="draft"):
        static_policies(dataclasses.replace(cfg, fixed_techniques=("draft",)), engine)


def test_fixed_policies_stay_within_the_engine_s_verify_depth() -> None:
    """The fake's MTP proposer drafts up to 8 but its engine verifies up to 4: the default
    depths (2, 4, 8) give fixed policies at 2 and 4 for every loaded technique, not a refused 8."""
    from bench.tuner import TunerBenchConfig, fake_engine, static_policies

    cfg = TunerBenchConfig(fake=True, runs=("fixed",))
    engine = fake_engine(cfg)
    assert engine.capacity().proposers["mtp"].max_depth > engine.capacity().max_depth == 4
    assert sorted(static_policies(cfg, engine)) == ["fixed:mtp@2", "fixed:mtp@4", "fixed:ngram@2",
                                                    "fixed:ngram@4"]


def test_repeats_run_every_policy_each_round_and_report_medians(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """--repeats 3: every policy runs once per round, the order rotated (round 2 starts with
    the second policy), each kept database tagged with its round; a policy's phase and
    whole-trace figures are its median round's, and the ratios are computed from them; the
    retune-latency figures pool every round's probe."""
    from bench.tuner_ratios import ratios

    out = tmp_path / "tuner.json"
    flags = ["--fake", "--phase-seconds", "1", "--rate-scale", "4", "--max-tokens", "16",
             "--techniques", "ngram", "--depths", "2", "--runs", "autotuned,never,fixed",
             "--repeats", "3", "--retune-interval", "0.3", "--trials", "8", "--min-new-steps", "20",
             "--profile-steps", "30", "--validation-min-steps", "20", "--probe-retunes", "1",
             "--search-in-thread", "--keep-db", str(tmp_path / "db"), "--out", str(out)]
    assert cli(["bench", "tuner", *flags]) == 0
    err = capsys.readouterr().err
    assert err.index("round 1/3: autotuned") < err.index("round 1/3: never")
    assert err.index("round 2/3: never") < err.index("round 2/3: autotuned")
    assert err.index("round 3/3: fixed:ngram@2") < err.index("round 3/3: never")
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 3
    # every round's autotuned run ends with a probe; the latency figures pool all three
    itl = result["retune_itl"]
    assert itl["probes"] == 3 and len(itl["retunes"]) == 3 * 2  # each: settling + 1 measured
    assert result["ratios"]["retune_itl"]["ratio"] == itl["p99_ratio"]
    assert all("retune_itl_p99_ratio" in r for r in result["rounds"])
    assert sorted(p.name for p in (tmp_path / "db").glob("*.db")) == sorted(
        f"{n}-r{r}.db" for n in ("autotuned", "never", "fixed-ngram-2") for r in (1, 2, 3))
    for name, run in result["policies"].items():
        for i, phase in enumerate(run["phases"]):
            each = sorted(r["policies"][name]["phases"][i] for r in result["rounds"])
            assert phase["goodput"] == each[1]
        assert run["whole"]["goodput"] == sorted(r["policies"][name]["whole"] for r in result["rounds"])[1]
    measured = {k: v for k, v in result["ratios"].items() if k != "retune_itl"}
    assert measured == ratios(result["policies"], PHASES)
    assert result["ratios"]["per_phase"] and result["ratios"]["whole_vs_never"]["static"] == (
        result["policies"]["never"]["whole"]["goodput"])
    # the drift-adjusted figures: each round's speed indexes, medians over rounds as above
    assert all(len(r["drift"]["speed_index"][n]) == len(PHASES) for r in result["rounds"]
               for n in result["policies"])
    drift = result["drift"]
    for name, run in drift["policies"].items():
        for i, phase in enumerate(run["phases"]):
            assert phase["goodput"] == sorted(r["drift"]["policies"][name]["phases"][i]
                                              for r in result["rounds"])[1]
    assert drift["ratios"] == ratios(drift["policies"], PHASES)
    assert "drift-adjusted (a diagnostic): per phase" in err


def test_bad_repeats_are_user_errors(capsys: pytest.CaptureFixture) -> None:
    assert cli(["bench", "tuner", "--fake", "--repeats", "0"]) == 2
    assert "repeats=0" in capsys.readouterr().err


def test_retune_itl_pools_the_gaps_of_every_rounds_probe() -> None:
    """Two rounds' probes: gaps of 100 ms in the quiet windows of both, 110 ms while the first
    round's retune searches and 150 ms while the second's does. Pooled, each gap counts once:
    the 'during' figures hold both rounds' gaps, and the ratio follows the pooled p99."""
    def probe(slow_ms: float) -> dict:
        window = {"id": 1, "start": 10.0, "search_end": 12.0, "end": 12.0, "status": "rejected",
                  "version": None, "note": None}
        t, chunks = 3.0, [3.0]
        while t < 12.0:
            t += (slow_ms if window["start"] <= t + 0.1 <= window["search_end"] else 100.0) / 1000.0
            chunks.append(t)
        return {"settle": {**window, "id": 0, "start": 0.0, "search_end": 3.0, "end": 3.0},
                "windows": [window], "end": 12.0, "streams": [type("Stream", (), {"chunks": chunks})()]}
    one, two = retune_itl(probe(110.0)), retune_itl(probe(150.0))
    both = retune_itl(probe(110.0), probe(150.0))
    assert both["probes"] == 2 and len(both["retunes"]) == 4
    assert both["during_ms"]["n"] == one["during_ms"]["n"] + two["during_ms"]["n"]
    assert both["without_ms"]["n"] == one["without_ms"]["n"] + two["without_ms"]["n"]
    assert one["p99_ratio"] == pytest.approx(1.1, abs=0.02)
    assert both["during_ms"]["mean"] == pytest.approx(
        (110.0 * one["during_ms"]["n"] + 150.0 * two["during_ms"]["n"]) / both["during_ms"]["n"], abs=1.0)


def test_a_backlog_past_the_daemons_tenant_cap_waits_in_the_queue(tmp_path: Path) -> None:
    """A busy phase sends each tenant more requests than the daemon's default tenant cap lets
    in flight (half of max_batch, none queued): the bench's tenants may queue them all, so none
    is refused with 429 and every policy serves the same trace (one 60-second run lost 56 of
    180 requests so)."""
    out = tmp_path / "tuner.json"
    flags = ["--fake", "--phase-seconds", "1", "--high-rate", "120", "--max-tokens", "24", "--max-batch", "8",
             "--fake-time-scale", "2", "--runs", "never", "--techniques", "ngram", "--depths", "2",
             "--probe-retunes", "0", "--out", str(out)]
    assert cli(["bench", "tuner", *flags]) == 0
    result = json.loads(out.read_text())
    busy = result["policies"]["never"]["phases"][1]
    assert result["trace"][1]["requests"] > 4 * 8  # more per tenant than the cap of 4 lets in
    assert busy["errors"] == 0 and busy["requests"] == result["trace"][1]["requests"]
