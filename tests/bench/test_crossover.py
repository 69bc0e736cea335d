"""`crossover bench crossover` on the tiny random model: the JSON's structure, numbers
that agree with each other (crossover and best speedup recomputed from the rows),
a readable PNG, and no compiles after warmup.

Random weights make acceptance whatever it is; what must hold is the bookkeeping.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from bench.crossover import BenchConfigError, CrossoverGrid, measure, prefill_steps, prompt_ids, write_result
from bench.crossover_summary import crossover
from bench.plots import TECHNIQUE_COLORS, crossover_figure
from cli.main import main as cli_main
from engine.speculation.drafting import add_model_proposers
from engine.speculation.heads import DraftHeads
from tests.engine.conftest import SPEC_RC, ChatBytes, make_engine

GRID = CrossoverGrid(techniques=("ngram",), depths=(1, 3), batches=(1, 2, 4), kinds=("copy", "chat"),
                     new_tokens=12, prompt_tokens=40)


@pytest.fixture(scope="module")
def bench(tiny, tmp_path_factory):
    engine = make_engine(tiny, ChatBytes(), **SPEC_RC)
    out = tmp_path_factory.mktemp("bench") / "crossover.json"
    result = write_result(measure(engine, GRID), str(out))
    return result, out


def _rows(result, kind, technique):
    """{depth: {batch: goodput}} from the per-depth rows."""
    depths = result["kinds"][kind]["techniques"][technique]["depths"]
    return {int(d): {r["batch"]: r["goodput"] for r in rows} for d, rows in depths.items()}


def test_json_has_every_cell_with_positive_goodput(bench):
    result, out = bench
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["compiles_since_warmup"] == 0
    assert result["grid"]["techniques"] == ["ngram"] and result["grid"]["depths"] == {"ngram": [1, 3]}
    assert set(result["kinds"]) == {"copy", "chat"}
    for kind, data in result["kinds"].items():
        assert [p["batch"] for p in data["plain"]] == [1, 2, 4]
        assert all(p["goodput"] > 0 and p["steps"] > 0 and p["runs"] == 2 for p in data["plain"])
        rows = _rows(result, kind, "ngram")
        assert set(rows) == {1, 3}
        assert all(set(by_b) == {1, 2, 4} and all(g > 0 for g in by_b.values()) for by_b in rows.values())
        assert data["prompts"]["count"] == 4 and data["prompts"]["mean_tokens"] <= GRID.prompt_tokens


def test_acceptance_per_position_is_a_share_and_adds_up_to_the_tokens_per_step(bench):
    result, _ = bench
    for data in result["kinds"].values():
        tech = data["techniques"]["ngram"]
        for d, rows in tech["depths"].items():
            pooled = tech["acceptance"][d]
            for acc in rows + [pooled]:
                assert len(acc["per_pos"]) in (0, int(d))  # empty only if nothing was ever drafted
                assert all(0.0 <= a <= 1.0 for a in acc["per_pos"])
                assert all(c is None or 0.0 <= c <= 1.0 for c in acc["conditional_per_pos"])
                assert acc["tokens_per_seq_step"] == pytest.approx(1 + sum(acc["per_pos"]))
        for row in tech["depths"]["1"]:
            assert row["speedup"] == pytest.approx(row["goodput"] / _plain(data)[row["batch"]])


def _plain(data):
    return {p["batch"]: p["goodput"] for p in data["plain"]}


def test_best_depth_crossover_and_batch1_speedup_follow_from_the_rows(bench):
    result, _ = bench
    for kind, data in result["kinds"].items():
        plain = _plain(data)
        tech = data["techniques"]["ngram"]
        rows = _rows(result, kind, "ngram")
        best = {b: max(rows[d][b] for d in rows) for b in plain}
        assert {x["batch"]: x["goodput"] for x in tech["best"]} == best
        assert all(rows[x["depth"]][x["batch"]] == x["goodput"] for x in tech["best"])
        wins = [b for b in plain if best[b] > plain[b]]
        assert tech["crossover"] == max(wins, default=0) == result["crossover"][kind]["ngram"]
        s1 = result["speedup_batch1"][kind]
        assert s1["batch"] == 1 and s1["technique"] == "ngram"
        assert s1["speedup"] == pytest.approx(best[1] / plain[1])


def test_plot_is_a_png_of_the_stated_size_with_a_line_per_technique(bench):
    result, out = bench
    plot = result["plot"]
    assert Path(plot["path"]) == out.with_suffix(".png")
    rgb = np.round(imread(plot["path"])[..., :3] * 255)  # [height, width, 3]
    assert rgb.shape[1::-1] == (plot["width"], plot["height"]) == (1280, 480)  # two kinds side by side
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50, "the image looks blank"
    for name in ("none", "ngram"):
        assert plot["colors"][name] == list(TECHNIQUE_COLORS[name])
        near = np.abs(rgb - TECHNIQUE_COLORS[name]).max(axis=-1) <= 8
        assert near[:, :640].sum() > 100 and near[:, 640:].sum() > 100, name  # drawn in both panels


def test_every_panel_has_titled_axes_with_units_and_a_legend(bench):
    result, _ = bench
    fig = crossover_figure(result)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["copy prompts", "chat prompts"]
    for ax in panels:
        assert "batch size" in ax.get_xlabel() and "tokens/s" in ax.get_ylabel()
        assert ax.get_xscale() == "log" and ax.get_ylim()[0] == 0
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[:2] == ["plain decoding", "ngram (best depth)"]
        crossover = result["kinds"][ax.get_title().split()[0]]["techniques"]["ngram"]["crossover"]
        assert (f"ngram crossover: B <= {crossover}" in labels) == (crossover > 0)


def test_helpers_examples():
    assert crossover({1: 10, 4: 30, 16: 80}, {1: 15, 4: 33, 16: 70}) == 4
    assert crossover({1: 10, 4: 30}, {1: 9, 4: None}) == 0
    assert prefill_steps(512, [[1] * 100] * 4) == 2
    ids, cut = prompt_ids(ChatBytes(), "prose", 5, 40, seed=0)
    assert len(ids) == 5 and cut == 5  # no prose prompt is that short in bytes: all cut
    assert all(len(p) == 40 and p[0] == ChatBytes.bos_id for p in ids)
    long, none_cut = prompt_ids(ChatBytes(), "chat", 3, 100_000, seed=0)
    assert none_cut == 0 and [p[-7:] for p in long] == [ChatBytes().encode("<model>", add_bos=False)] * 3


@pytest.mark.parametrize("kw,word", [
    ({"depths": (0, 2)}, "depths"), ({"batches": ()}, "batches"), ({"kinds": ("poetry",)}, "poetry"),
    ({"techniques": ("magic",)}, "magic"), ({"new_tokens": 1}, "new_tokens"),
    ({"pool_split": 0.9}, "pool_split"),
    ({"temperature": 2.5}, "temperature"),
])
def test_bad_grid_values_are_named(kw, word):
    with pytest.raises(BenchConfigError, match=word):
        CrossoverGrid(**kw)


def test_engine_that_cannot_run_the_grid_is_refused_before_warmup(tiny):
    engine = make_engine(tiny, ChatBytes(), **SPEC_RC)  # spec_max_batch 8, n-gram only
    for grid, word in ((CrossoverGrid(techniques=("mtp",)), "not loaded"),
                       (CrossoverGrid(batches=(1, 16)), "max batch"),
                       (CrossoverGrid(techniques=("ngram",), batches=(1,), prompt_tokens=200), "context")):
        with pytest.raises(BenchConfigError, match=word):
            measure(engine, grid)
    assert not engine.warmed_up


def test_cli_names_a_bad_value_and_exits_2(capsys):
    assert cli_main(["bench", "crossover", "--depths", "1,9"]) == 2
    assert "depths [1, 9]" in capsys.readouterr().err
    assert cli_main(["bench", "crossover", "--batches", "1,x"]) == 2
    assert "'1,x'" in capsys.readouterr().err


def test_model_based_proposers_are_measured_with_the_pool_split(tiny, tmp_path):
    engine = make_engine(tiny, ChatBytes(), **SPEC_RC)
    add_model_proposers(engine, DraftHeads.random(tiny[0], 8, (3, 6), 128, seed=1, scale=0.3),
                        vocab_sizes=(0, 128))
    grid = CrossoverGrid(depths=(2,), batches=(1, 2), kinds=("prose",), new_tokens=6, prompt_tokens=32)
    result = measure(engine, grid)
    assert result["grid"]["techniques"] == ["ngram", "mtp", "early_exit", "draft"]
    assert result["grid"]["mtp_draft_vocab"] == 128 and result["compiles_since_warmup"] == 0
    for tech in result["grid"]["techniques"]:
        rows = result["kinds"]["prose"]["techniques"][tech]["depths"]["2"]
        assert all(r["goodput"] > 0 for r in rows)
        if tech != "ngram":  # model proposers draft whenever a draft fits (n-gram needs a match)
            assert all(r["drafting_step_share"] > 0.5 for r in rows), tech
    assert engine.pool.used == 0


def test_prompt_sets_pool_disjoint_prompts_into_one_row_per_cell(tiny):
    engine = make_engine(tiny, ChatBytes(), **SPEC_RC)
    grid = CrossoverGrid(techniques=("ngram",), depths=(2,), batches=(1, 2), kinds=("copy",),
                         new_tokens=8, prompt_tokens=40, prompt_sets=3)
    result = measure(engine, grid)
    kind = result["kinds"]["copy"]
    assert result["grid"]["prompt_sets"] == 3 and kind["prompts"]["count"] == 2 * 3
    rows = kind["techniques"]["ngram"]["depths"]["2"]
    assert [r["batch"] for r in rows] == [1, 2]  # one pooled row per batch size
    assert all(r["runs"] == 3 for r in rows)  # a run per prompt set
    # plain decoding runs before and after the technique in every set
    assert [p["runs"] for p in kind["plain"]] == [6, 6]
    single = measure(make_engine(tiny, ChatBytes(), **SPEC_RC),
                     CrossoverGrid(techniques=("ngram",), depths=(2,), batches=(1,), kinds=("copy",),
                                   new_tokens=8, prompt_tokens=40))
    one = single["kinds"]["copy"]["techniques"]["ngram"]["depths"]["2"][0]
    assert rows[0]["steps"] > one["steps"]  # the other sets' steps are in the pooled row


def test_sampled_runs_are_seeded_per_request_and_repeat(tiny):
    """--temperature: every request samples with its own seed, so a run repeats exactly and its
    acceptance differs from greedy decoding's."""
    grid = CrossoverGrid(techniques=("ngram",), depths=(2,), batches=(2,), kinds=("copy",),
                         new_tokens=10, prompt_tokens=40, temperature=1.0)

    def accepted(result):
        rows = result["kinds"]["copy"]["techniques"]["ngram"]["depths"]["2"]
        return [(r["tokens"], r["steps"], r["per_pos"]) for r in rows]

    first = measure(make_engine(tiny, ChatBytes(), **SPEC_RC), grid)
    again = measure(make_engine(tiny, ChatBytes(), **SPEC_RC), grid)
    greedy = measure(make_engine(tiny, ChatBytes(), **SPEC_RC), dataclasses.replace(grid, temperature=0.0))
    assert first["grid"]["temperature"] == 1.0 and greedy["grid"]["temperature"] == 0.0
    assert accepted(first) == accepted(again)
    assert accepted(first) != accepted(greedy)
