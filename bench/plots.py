"""The benches' PNG charts, drawn with matplotlib's Agg backend (no display needed).

- `crossover_plot` (`crossover bench crossover`): one panel per workload kind,
  goodput (output tok/s) against batch size on a log2 axis; plain decoding,
  each technique at its best depth (the depth written at each point, every
  measured depth as a faint line) and each technique's crossover as a dashed
  vertical line in its colour.
- `tuner_plot` (`crossover bench tuner`): goodput bars per trace phase and for
  the whole trace, one bar per policy; below, the autotuned run's ratios as
  bars coloured by their verdict (met, missed, no target) with each target
  marked.

Each returns {"path", "width", "height", "colors"} (pixels; RGB per series) for
the result JSON. matplotlib is imported inside the functions: the `bench`
extra installs it, and nothing else pays its import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 100
TECHNIQUE_COLORS = {"none": (60, 60, 60), "ngram": (31, 119, 180), "mtp": (255, 127, 14),
                    "early_exit": (44, 160, 44), "draft": (214, 39, 40)}
"""Line colour per technique ("none": plain decoding), RGB."""
POLICY_COLORS = [(214, 39, 40), (60, 60, 60), (31, 119, 180), (255, 127, 14), (44, 160, 44),
                 (148, 103, 189), (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34),
                 (23, 190, 207), (174, 199, 232)]
"""Bar colours of the tuner bench's policies, in the result's order (autotuned first)."""
MET, MISSED, REFERENCE = (26, 150, 65), (215, 48, 39), (150, 150, 150)
"""Ratio bar colours: target met, target missed, no target (the static oracle's ratios); none is a
policy's colour."""
PANEL_IN = (6.4, 4.8)
"""One crossover panel's size in inches (640 x 480 pixels at DPI)."""
TUNER_IN = (12.0, 8.0)


def _rgb(color: tuple[int, int, int]) -> tuple[float, float, float]:
    return tuple(c / 255 for c in color)  # type: ignore[return-value]


def _figure(size: tuple[float, float]) -> Any:
    """A figure on the Agg canvas, outside pyplot (no global state, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path, colors: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    fig.savefig(path, dpi=DPI, format="png")
    width, height = (round(v * DPI) for v in fig.get_size_inches())
    return {"path": str(path), "width": width, "height": height,
            "colors": {name: list(c) for name, c in colors.items()}}


# ---- crossover ----------------------------------------------------------------------
def crossover_plot(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """Write `crossover_figure` as a PNG at `path`; its {"path", "width", "height", "colors"}."""
    shown = {t: TECHNIQUE_COLORS[t] for t in ("none", *result["grid"]["techniques"])}
    return _save(crossover_figure(result), path, shown)


def crossover_figure(result: dict[str, Any]) -> Any:
    """Goodput vs batch size, a panel per kind (two per row); see the module doc."""
    kinds = list(result["kinds"])
    cols = min(2, len(kinds))
    rows = -(-len(kinds) // cols)
    fig = _figure((PANEL_IN[0] * cols, PANEL_IN[1] * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, kind in enumerate(kinds):
        _crossover_panel(axes[i // cols][i % cols], kind, result["kinds"][kind])
    for ax in axes.flat[len(kinds):]:
        ax.set_visible(False)
    fig.suptitle(f"{result.get('model', 'model')} ({result.get('dtype', '?')}): goodput per technique "
                 f"at its best depth vs plain decoding, pool split {result['grid']['pool_split']}")
    return fig


def _crossover_panel(ax: Any, kind: str, data: dict[str, Any]) -> None:
    from matplotlib.ticker import NullLocator

    plain = [(p["batch"], p["goodput"]) for p in data["plain"] if p["goodput"] is not None]
    batches = sorted({b for b, _ in plain}
                     | {x["batch"] for v in data["techniques"].values() for x in v["best"]})
    if plain:
        ax.plot(*zip(*plain), color=_rgb(TECHNIQUE_COLORS["none"]), marker="o", linewidth=2.5,
                label="plain decoding")
    for tech, v in data["techniques"].items():
        color = _rgb(TECHNIQUE_COLORS[tech])
        for rows in v["depths"].values():  # every measured depth, faint
            pts = [(r["batch"], r["goodput"]) for r in rows if r["goodput"] is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, linewidth=1, alpha=0.3)
        best = [(x["batch"], x["goodput"], x["depth"]) for x in v["best"] if x["goodput"] is not None]
        if best:
            xs, ys, _ = zip(*best)
            ax.plot(xs, ys, color=color, marker="o", linewidth=2.5, label=f"{tech} (best depth)")
            for x, y, d in best:
                ax.annotate(f"d{d}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=7,
                            color=color)
        if v["crossover"]:
            ax.axvline(v["crossover"], color=color, linestyle="--", linewidth=1.2,
                       label=f"{tech} crossover: B <= {v['crossover']}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_ylim(bottom=0)
    ax.set_title(f"{kind} prompts")
    ax.set_xlabel("batch size (concurrent sequences, log scale)")
    ax.set_ylabel("goodput (output tokens/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


# ---- tuner ----------------------------------------------------------------------------
def tuner_plot(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """Write `tuner_figure` as a PNG at `path`; its {"path", "width", "height", "colors"}."""
    return _save(tuner_figure(result), path, policy_colors(result))


def policy_colors(result: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """Each policy's bar colour, in the result's order."""
    return {n: POLICY_COLORS[i % len(POLICY_COLORS)] for i, n in enumerate(result["policies"])}


def tuner_figure(result: dict[str, Any]) -> Any:
    """Goodput bars per phase and policy (top), ratio bars with targets (bottom)."""
    names = list(result["policies"])
    colors = policy_colors(result)
    labels, values, targets, met = ratio_bars(result)
    fig = _figure(TUNER_IN)
    top, bottom = fig.subplots(2, 1, height_ratios=(3, 2)) if labels else (fig.subplots(), None)
    groups = [f"phase {p['phase'] + 1}\n{p['name']}" for p in result["trace"]] + ["whole trace"]
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        run = result["policies"][name]
        ys = [ph["goodput"] for ph in run["phases"]] + [run["whole"]["goodput"]]
        xs = [g + (k - (len(names) - 1) / 2) * width for g in range(len(groups))]
        top.bar(xs, ys, width=width, color=_rgb(colors[name]), label=name)
    top.set_xticks(range(len(groups)), groups)
    top.set_ylabel("goodput (output tokens/s of engine step time)")
    top.set_title("goodput per policy, each trace phase and the whole trace")
    top.grid(True, axis="y", alpha=0.3)
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="policy")
    if bottom is not None:
        _ratio_panel(bottom, labels, values, targets, met)
    fig.suptitle(f"crossover bench tuner: {result['engine'].get('model', 'model')} "
                 f"({result['engine'].get('engine', '')})")
    return fig


def _ratio_panel(ax: Any, labels: list[str], values: list[float], targets: list[float | None],
                 met: list[bool | None]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    shades = [REFERENCE if ok is None else MET if ok else MISSED for ok in met]
    ax.bar(range(len(labels)), values, width=0.6, color=[_rgb(c) for c in shades])
    for i, (v, t) in enumerate(zip(values, targets)):
        ax.annotate(f"{v:.2f}", (i, max(v, t or 0.0)), textcoords="offset points", xytext=(0, 3), ha="center",
                    fontsize=8)  # above the bar and its target line
        if t is not None:
            ax.hlines(t, i - 0.4, i + 0.4, colors="black", linewidth=2)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(0, max(values + [t for t in targets if t is not None]) * 1.15)
    ax.set_ylabel("ratio")
    ax.set_title("autotuned over the static policies; ITL: retune p99 gap over the quiet one")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)  # grid lines behind the bars, so each bar shows its colour whole
    ax.legend(handles=[Patch(color=_rgb(MET), label="target met"),
                       Patch(color=_rgb(MISSED), label="target missed"),
                       Patch(color=_rgb(REFERENCE), label="no target (static oracle)"),
                       Line2D([], [], color="black", linewidth=2, label="target")],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def ratio_bars(result: dict[str, Any]
               ) -> tuple[list[str], list[float], list[float | None], list[bool | None]]:
    """(labels, ratios, targets, met) of the ratios that have a value, in reading order."""
    r = result["ratios"]
    rows = [(f"phase {x['phase'] + 1} / best static", x) for x in r.get("per_phase", [])]
    rows += [(label, r[key]) for label, key in (("whole / best fixed", "whole_vs_best_fixed"),
                                                ("whole / table", "whole_vs_table"),
                                                ("whole / single-rule tuner", "whole_vs_single_rule"),
                                                ("oracle / best fixed", "oracle_vs_best_fixed"),
                                                ("oracle / table", "oracle_vs_table"),
                                                ("ITL p99 during retune", "retune_itl")) if key in r]
    rows = [(label, x) for label, x in rows if x.get("ratio") is not None]
    return ([lb for lb, _ in rows], [x["ratio"] for _, x in rows], [x["target"] for _, x in rows],
            [None if x["target"] is None else bool(x["met"]) for _, x in rows])
