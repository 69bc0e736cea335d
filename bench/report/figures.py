"""The PNG figures of `crossover report`, drawn with matplotlib's Agg canvas (no display).

Each function takes plain values the sections computed, writes one PNG and
returns its file name, or None when it has nothing to draw (the section then
says so in words). Intervals are drawn as error bars: 95%, Wilson for
acceptance, delta method for goodput (bench.report.stats).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.plots import TECHNIQUE_COLORS
from bench.report.stats import Interval

DPI = 100
GROUP_COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189), (140, 86, 75),
                (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))
MIXED_COLOR = (214, 39, 40)


def embed(name: str | None, alt: str) -> list[str]:
    """The markdown lines that show figure file `name` (none when no figure was drawn)."""
    return [f"![{alt}]({name})", ""] if name else []


def _rgb(c: tuple[int, int, int]) -> tuple[float, float, float]:
    return (c[0] / 255, c[1] / 255, c[2] / 255)


def _tech_color(name: str, i: int = 0) -> tuple[float, float, float]:
    return _rgb(TECHNIQUE_COLORS.get(name, GROUP_COLORS[i % len(GROUP_COLORS)]))


def _panels(n: int, size: tuple[float, float] = (5.6, 4.2), cols: int = 2) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(size[0] * cols, size[1] * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _save(fig: Any, out: Path, name: str) -> str:
    """Write the PNG with a 256-colour palette (Pillow, matplotlib's own dependency), which keeps
    a line figure well under 200 KB; plain RGBA where Pillow cannot quantize."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    try:
        from PIL import Image

        buf.seek(0)
        Image.open(buf).convert("RGB").quantize(colors=256).save(out / name, format="PNG", optimize=True)
    except (ImportError, OSError, ValueError):
        (out / name).write_bytes(buf.getvalue())
    return name


def _errorbar(ax: Any, xs: list[float], cis: list[Interval], **kw: Any) -> None:
    ys = [c.value for c in cis]
    err = [[c.value - c.low for c in cis], [c.high - c.value for c in cis]]
    ax.errorbar(xs, ys, yerr=err, capsize=3, marker="o", linewidth=1.5, markersize=4, **kw)


def _log2_batches(ax: Any, batches: list[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(NullLocator())


def acceptance_figure(data: dict[str, dict[str, list[Interval]]], out: Path) -> str | None:
    """Acceptance vs draft position, a panel per technique, a line per tenant alone and for mixed."""
    if not data:
        return None
    fig, axes = _panels(len(data))
    for ax, (tech, groups) in zip(axes, sorted(data.items())):
        for i, (group, cis) in enumerate(groups.items()):
            color = _rgb(MIXED_COLOR if group.startswith("(mixed") else GROUP_COLORS[i % len(GROUP_COLORS)])
            offset = (i - (len(groups) - 1) / 2) * 0.06  # keep error bars of groups apart
            _errorbar(ax, [p + 1 + offset for p in range(len(cis))], cis, color=color, label=group)
        positions = range(1, max((len(c) for c in groups.values()), default=0) + 1)
        ax.set_xticks(list(positions), [str(p) for p in positions])
        ax.set_title(f"{tech}: acceptance by draft position")
        ax.set_xlabel("draft position")
        ax.set_ylabel("share of offered drafts accepted (95% Wilson)")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out, "q1_acceptance.png")


def tenant_figure(data: dict[str, dict[str, Interval]], out: Path) -> str | None:
    """Per tenant: request-level acceptance in requests that ran alone, mixed, or both."""
    if not data:
        return None
    kinds = sorted({k for v in data.values() for k in v})
    fig, (ax,) = _panels(1, size=(7.0, 4.2))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        xs, cis = [], []
        for i, tenant in enumerate(sorted(data)):
            if kind in data[tenant]:
                xs.append(i + (k - (len(kinds) - 1) / 2) * width)
                cis.append(data[tenant][kind])
        ax.bar(xs, [c.value for c in cis], width=width, label=kind,
               yerr=[[c.value - c.low for c in cis], [c.high - c.value for c in cis]], capsize=3,
               color=_rgb(GROUP_COLORS[k % len(GROUP_COLORS)]))
    ax.set_xticks(range(len(data)), sorted(data))
    ax.set_ylim(0, 1)
    ax.set_ylabel("accepted / proposed drafts (95% Wilson)")
    ax.set_title("acceptance per tenant, by the batches its requests ran in")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, title="requests that ran")
    return _save(fig, out, "q1_tenants.png")


def goodput_figure(data: dict[str, dict[str, dict[int, Interval]]],
                   crossovers: dict[str, dict[str, int | None]],
                   out: Path) -> str | None:
    """Measured goodput vs batch size, a panel per tenant mix (all, alone, mixed; not each tenant's),
    a line per technique (plain: "none")."""
    data = {mix: techs for mix, techs in data.items() if any(techs.values())
            and not mix.startswith("alone: ")}
    if not data:
        return None
    fig, axes = _panels(len(data))
    for ax, (mix, techs) in zip(axes, data.items()):
        batches = sorted({b for cells in techs.values() for b in cells})
        for i, (tech, cells) in enumerate(sorted(techs.items())):
            if not cells:
                continue
            xs = sorted(cells)
            label = "plain decoding" if tech == "none" else tech
            _errorbar(ax, xs, [cells[b] for b in xs], color=_tech_color(tech, i), label=label,
                      linestyle="-" if tech == "none" else "--")
            b = crossovers.get(mix, {}).get(tech)
            if b:
                ax.axvline(b, color=_tech_color(tech, i), linestyle=":", linewidth=1.2,
                           label=f"{tech} crossover B={b}")
        _log2_batches(ax, batches)
        ax.set_ylim(bottom=0)
        ax.set_title(f"measured goodput: {mix} steps")
        ax.set_xlabel("batch size (log scale)")
        ax.set_ylabel("output tokens / s of step time (95% CI)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out, "q2_goodput_measured.png")


def predicted_figure(curves: dict[str, dict[str, list[tuple[int, float]]]],
                     crossovers: dict[str, dict[str, int | None]], title: str, out: Path) -> str | None:
    """Predicted goodput vs batch size, a panel per chip (PREDICTION in every title)."""
    if not curves or not any(curves.values()):
        return None
    fig, axes = _panels(len(curves))
    for ax, (chip, techs) in zip(axes, curves.items()):
        batches = sorted({b for pts in techs.values() for b, _ in pts})
        for i, (tech, pts) in enumerate(techs.items()):
            if pts:
                ax.plot(*zip(*pts), color=_tech_color(tech, i), marker="o", markersize=3,
                        linestyle="-" if tech == "none" else "--",
                        label="plain decoding" if tech == "none" else tech)
            b = crossovers.get(chip, {}).get(tech)
            if b:
                ax.axvline(b, color=_tech_color(tech, i), linestyle=":", linewidth=1.2,
                           label=f"{tech} crossover B={b}")
        if batches:
            _log2_batches(ax, batches)
        ax.set_ylim(bottom=0)
        ax.set_title(f"PREDICTION, {chip}: {title}", fontsize=9)
        ax.set_xlabel("batch size (log scale)")
        ax.set_ylabel("predicted output tokens / s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out, "q2_goodput_predicted.png")


def displacement_figure(measured: list[tuple[str, float, Interval]],
                        projected: dict[str, list[tuple[str, int, float]]], out: Path) -> str | None:
    """Left: goodput gain vs tenants displaced per technique (measured gain, planner displacement).
    Right: the planner's projection per Gemma 3 model on a v6e-1 (capacity-aware gain)."""
    if not measured and not projected:
        return None
    fig, axes = _panels(int(bool(measured)) + int(bool(projected)), size=(6.0, 4.4))
    ax_iter = iter(axes)
    if measured:
        ax = next(ax_iter)
        for i, (tech, displaced, gain) in enumerate(measured):
            _errorbar(ax, [displaced], [gain], color=_tech_color(tech, i), label=tech, linestyle="none")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("tenants displaced (planner, at the report's context)")
        ax.set_ylabel("measured goodput / plain (95% CI)")
        ax.set_title("what speculation costs vs what it gains (measured gain)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if projected:
        ax = next(ax_iter)
        models = list(projected)
        techs = sorted({t for rows in projected.values() for t, _, _ in rows})
        width = 0.8 / max(len(techs), 1)
        for k, tech in enumerate(techs):
            xs, ys, labels = [], [], []
            for i, m in enumerate(models):
                for t, displaced, gain in projected[m]:
                    if t == tech:
                        xs.append(i + (k - (len(techs) - 1) / 2) * width)
                        ys.append(gain)
                        labels.append(f"-{displaced}")
            ax.bar(xs, ys, width=width, color=_tech_color(tech, k), label=tech)
            for x, y, lab in zip(xs, ys, labels):
                ax.annotate(lab, (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)), models, fontsize=8)
        ax.set_ylabel("PREDICTED goodput / plain at full pool")
        ax.set_title("PROJECTION on tpu-v6e-1 (bar label: tenants displaced)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out, "q3_displacement.png")


def moe_figure(rows: list[tuple[str, dict[str, float], float]], out: Path) -> str | None:
    """Stacked GiB per plan (weights, reserve, KV pool) against the usable memory line."""
    if not rows:
        return None
    fig, (ax,) = _panels(1, size=(7.0, 4.2))
    parts = ("weights", "activation reserve", "KV pool")
    colors = ((140, 86, 75), (127, 127, 127), (44, 160, 44))
    bottoms = [0.0] * len(rows)
    for part, color in zip(parts, colors):
        vals = [r[1].get(part, 0.0) for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottoms, color=_rgb(color), label=part)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, (_, _, usable) in enumerate(rows):
        ax.hlines(usable, i - 0.4, i + 0.4, colors="black", linewidth=2)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_ylabel("GiB (black line: usable memory)")
    ax.set_title("planner: mixture of experts 26B total / 4B active")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "q4_moe.png")
