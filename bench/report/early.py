"""Q4's measured part: the JSON of `crossover bench early-exit` runs, as tables.

The compacting early exit is an experiment outside the serving path (bench/early_exit_decoder.py):
it writes a JSON file, not telemetry rows, so `crossover report --early-exit FILE` reads it
here. Each file gives a table of speedups (against never exiting, same code path, same run)
per batch size and threshold, and one of quality against the full model. A file that keeps every
round's speedup (`speedup_by_round`) gets a 95% interval per cell that resamples rounds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.report.stats import Interval, bootstrap, geomean

REQUIRED = ("lossy", "grid", "cells", "quality")
"""Keys every `bench early-exit` JSON has; a file without them is refused."""


class EarlyExitFileError(ValueError):
    """A file that is not a readable `crossover bench early-exit` JSON; the message names it."""


def load_runs(paths: tuple[Path, ...]) -> list[tuple[Path, dict[str, Any]]]:
    """Each path with its parsed JSON, in the order given; EarlyExitFileError on the first bad one."""
    runs = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EarlyExitFileError(f"--early-exit {str(path)!r} is not a readable JSON file "
                                     f"({exc})") from None
        missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
        if missing:
            raise EarlyExitFileError(f"--early-exit {str(path)!r} is not a `crossover bench early-exit` "
                                     f"result (missing {', '.join(missing)})")
        runs.append((Path(path), data))
    return runs


def speedup_ci(cell: dict[str, Any]) -> Interval | None:
    """The cell's speedup over never exiting with a 95% interval over rounds (geometric mean of each
    round's ratio); None for a file that kept only the fastest round."""
    rounds = cell.get("speedup_by_round") or []
    return bootstrap(rounds, geomean) if len(rounds) > 1 else None


def has_rounds(data: dict[str, Any]) -> bool:
    return any(len(c.get("speedup_by_round") or []) > 1 for c in data["cells"])


def _threshold(value: Any) -> str:
    return value if isinstance(value, str) else f"{float(value):g}"


def run_section(path: Path, data: dict[str, Any]) -> list[str]:
    """Markdown for one run: what ran, speedup per (threshold, batch), quality per threshold."""
    grid = data["grid"]
    batches = sorted({c["batch"] for c in data["cells"]})
    thresholds = list(dict.fromkeys(c["threshold"] for c in data["cells"]))  # in the run's order
    cell = {(c["threshold"], c["batch"]): c for c in data["cells"]}
    lines = [f"#### `{path.name}`"
             + (" (LOSSY: output differs from the full model)" if data["lossy"] else ""), "",
             (f"Exit after layer(s) {', '.join(map(str, grid.get('exits', [])))}, confidence "
              f"`{grid.get('confidence', '?')}`, {grid.get('new_tokens', '?')} new tokens per sequence, "
              f"KV fill by {data.get('kv_fill', '?')}; model {data.get('model', '?')} "
              f"{data.get('dtype', '')}; machine {json.dumps(data.get('machine', {}))}."), "",
             ("Tokens/s against never exiting (same code path, same run); exit fraction in parentheses; "
              + (f"geometric mean of {grid.get('rounds', '?')} rounds' ratios with a 95% interval over "
                 "rounds:" if has_rounds(data) else f"the fastest of {grid.get('rounds', '?')} rounds each, "
                 "**no interval** (this file predates per-round results):")), "",
             "| threshold | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---:|" * len(batches)]
    for t in thresholds:
        row = []
        for b in batches:
            c = cell.get((t, b))
            ci = None if c is None else speedup_ci(c)
            shown = "-" if c is None else (f"{ci.value:.2f}x [{ci.low:.2f}, {ci.high:.2f}]" if ci else
                                           f"{c['speedup_vs_never']:.2f}x")
            row.append(shown if c is None else f"{shown} ({c['exit_fraction']:.0%})")
        lines.append(f"| {_threshold(t)} | " + " | ".join(row) + " |")
    lines += ["", ("Quality against the full model (greedy agreement: share of positions whose token equals "
                   "the full model's given the same prefix):"), "",
              "| threshold | greedy agreement | sequences identical | perplexity | x full model |",
              "|---|---:|---:|---:|---:|"]
    for q in data["quality"]:
        lines.append(f"| {_threshold(q['threshold'])} | {q['greedy_agreement']:.3f} | "
                     f"{q['sequences_identical']:.0%} | {q['perplexity']:.1f} | "
                     f"{q['perplexity_ratio']:.2f} |")
    command = data.get("command")
    lines += ["", f"Source: `{path}`" + (f", made by `{command}`." if command else "."), ""]
    return lines


def section(runs: list[tuple[Path, dict[str, Any]]], out: Path | None = None) -> list[str]:
    """The measured compacting early-exit runs (with their figure when `out` is given), or nothing
    when none were given."""
    if not runs:
        return []
    lines = ["### Compacting early exit, measured (`crossover bench early-exit`)", ""]
    name = early_exit_figure(runs, out) if out is not None else None
    if name:
        lines += [f"![compacting early exit: speedup against batch size]({name})", ""]
    for path, data in runs:
        lines += run_section(path, data)
    return lines


def early_exit_figure(runs: list[tuple[Path, dict[str, Any]]], out: Path) -> str | None:
    """A panel per run: tokens/s over never exiting against batch size, a line per threshold."""
    from bench.report.figures import GROUP_COLORS, _log2_batches, _panels, _rgb, _save

    fig, axes = _panels(len(runs), size=(5.4, 3.8))
    for ax, (path, data) in zip(axes, runs):
        cells = data["cells"]
        batches = sorted({c["batch"] for c in cells})
        agreement = {_threshold(q["threshold"]): q["greedy_agreement"] for q in data["quality"]}
        for i, th in enumerate(dict.fromkeys(c["threshold"] for c in cells)):
            mine = sorted((c for c in cells if c["threshold"] == th), key=lambda c: c["batch"])
            cis = [speedup_ci(c) for c in mine]
            ys = [ci.value if ci else c["speedup_vs_never"] for c, ci in zip(mine, cis)]
            err = ([[y - ci.low for y, ci in zip(ys, cis)], [ci.high - y for y, ci in zip(ys, cis)]]
                   if all(cis) else None)
            agree = agreement.get(_threshold(th))
            shift = 2 ** ((i - 2) * 0.05)  # apart sideways, so error bars of thresholds do not overlap
            ax.errorbar([c["batch"] * shift for c in mine], ys, yerr=err, capsize=3, marker="o", markersize=3,
                        color=_rgb(GROUP_COLORS[i % len(GROUP_COLORS)]), label=f"threshold {_threshold(th)}"
                        + (f" (greedy agreement {agree:.2f})" if agree else ""))
        ax.axhline(1.0, color="black", linewidth=0.8)
        _log2_batches(ax, batches)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size (log scale)")
        ax.set_ylabel("tokens/s over never exiting")
        ax.set_title(f"{path.name}: LOSSY early exit, {data.get('kv_fill', '?')}", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out, "q4_early_exit.png")
