"""The Prometheus text exposition format (version 0.0.4), written by hand.

    >>> fam = Family("crossover_up", "gauge", "Whether the daemon is up.")
    >>> fam.add(1)
    >>> print(render([fam]), end="")
    # HELP crossover_up Whether the daemon is up.
    # TYPE crossover_up gauge
    crossover_up 1

Counters keep their `_total` suffix in HELP/TYPE, as prometheus_client does
for this format. `Histogram` keeps cumulative-on-render bucket counts.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KINDS = ("counter", "gauge", "histogram", "untyped")

Labels = Mapping[str, str]


@dataclass
class Family:
    """One metric family: name, kind, help, and its samples."""

    name: str
    kind: str
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    def add(self, value: float, labels: Labels | None = None, suffix: str = "") -> None:
        self.samples.append((self.name + suffix, labels or {}, value))


def single(name: str, kind: str, help_text: str, value: float) -> Family:
    """A family of one unlabelled sample."""
    fam = Family(name, kind, help_text)
    fam.add(value)
    return fam


class Histogram:
    """Counts observations into fixed upper bounds (not thread-safe: lock outside)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bounds must be increasing and distinct, got {list(bounds)}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> tuple[tuple[float, ...], list[int], float, int]:
        return self.bounds, list(self.counts), self.sum, self.count


def histogram_family(
    name: str, help_text: str, snapshot: tuple[tuple[float, ...], list[int], float, int]
) -> Family:
    """A histogram family from `Histogram.snapshot()`: cumulative buckets, sum, count."""
    bounds, counts, total, count = snapshot
    fam = Family(name, "histogram", help_text)
    running = 0
    for bound, n in zip((*bounds, math.inf), counts, strict=True):
        running += n
        fam.add(running, {"le": format_value(bound)}, "_bucket")
    fam.add(total, suffix="_sum")
    fam.add(count, suffix="_count")
    return fam


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for name, labels, value in fam.samples:
            lines.append(f"{name}{_labels(labels)} {format_value(value)}")
    return "\n".join(lines) + "\n"


def format_value(value: float) -> str:
    """`1`, `0.25`, `+Inf`, `NaN`: integers without a decimal point."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
