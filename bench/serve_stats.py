"""What `crossover bench serve` reports of a phase (bench/serve.py's module doc, 6 and 8): throughput
and latency percentiles, the CPU share other processes took, each phase's fastest round, and the
loaded TTFT against the idle one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from bench.loadgen import Sample

PERCENTILES = (50, 90, 99)


def best_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each phase's fastest round (other processes only ever slow a round down) and the ratio.

    Every round's throughput and the CPU share others took stay in `rounds`.
    """
    out: dict[str, Any] = {}
    for phase in ("http", "engine_only"):
        runs = [r[phase] for r in rounds if phase in r]
        if runs:
            out[phase] = max(runs, key=lambda s: s["output_tokens_per_s"] or 0.0)
    engine_tps = out.get("engine_only", {}).get("output_tokens_per_s")
    out["http_over_engine"] = (round(out["http"]["output_tokens_per_s"] / engine_tps, 4)
                               if engine_tps else None)
    out["rounds"] = [{f"{phase}_{key}": r[phase][key] for phase in ("http", "engine_only")
                      if phase in r for key in ("output_tokens_per_s", "other_processes_cpu_share")}
                     for r in rounds]
    return out


def ttft_vs_idle(loaded: list[Sample], idle: list[Sample], cache_emptied: bool) -> dict[str, Any]:
    """Loaded TTFT against the same requests' idle TTFT: the two p99s' ratio, and per request
    the ratio loaded / idle (its distribution; the ratios, not ms)."""
    alone = {s.index: s.ttft_s for s in idle if s.error is None and s.ttft_s}
    pairs = [(s.ttft_s, alone[s.index]) for s in loaded if s.error is None and s.ttft_s and s.index in alone]
    if not pairs:
        return {"reason": "no request has both a loaded and an idle TTFT"}
    ratios = [a / b for a, b in pairs]
    loaded_ms, idle_ms = distribution([a for a, _ in pairs]), distribution([b for _, b in pairs])
    per_request = {k: (None if v is None else round(v / 1000.0, 3)) for k, v in distribution(ratios).items()}
    per_request["n"] = len(ratios)
    return {"requests": len(pairs), "prefix_cache_emptied": cache_emptied,
            "idle_prefix_cache": "reset" if cache_emptied else "not reset",
            "loaded_ttft_ms": loaded_ms, "idle_ttft_ms": idle_ms,
            "loaded_p99_over_idle_p99": round(loaded_ms["p99"] / idle_ms["p99"], 3),
            "per_request": per_request}


def summarize(samples: list[Sample], wall_s: float, cpu_share: float | None = None
              ) -> dict[str, Any]:
    """Throughput and latency percentiles of the samples without an error."""
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.output_tokens for s in ok)
    errors = [s.error for s in samples if s.error is not None]
    return {
        "requests": len(ok), "errors": len(errors), "error_examples": sorted(set(errors))[:3],
        "duration_s": round(wall_s, 4),
        "prompt_tokens": sum(s.prompt_tokens for s in ok), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
        "ttft_ms": distribution([s.ttft_s for s in ok]),
        "tpot_ms": distribution([s.tpot_s for s in ok]),
        "itl_ms": distribution([gap for s in ok for gap in s.itl_s]),
        "latency_ms": distribution([s.latency_s for s in ok]),
        "mean_in_flight": (round(sum(s.latency_s or 0.0 for s in ok) / wall_s, 3)
                           if wall_s > 0 else None),
        "other_processes_cpu_share": cpu_share,
    }


def distribution(seconds: list[float | None]) -> dict[str, float | None]:
    """Mean and PERCENTILES in ms of the values that are not None (numpy's linear interpolation).

    >>> distribution([0.001, 0.002, 0.003, None])
    {'n': 3, 'mean': 2.0, 'p50': 2.0, 'p90': 2.8, 'p99': 2.98}
    """
    ms = np.asarray([v * 1000.0 for v in seconds if v is not None], dtype=np.float64)
    out: dict[str, float | None] = {"n": int(ms.size),
                                    "mean": round(float(ms.mean()), 3) if ms.size else None}
    qs = np.percentile(ms, PERCENTILES) if ms.size else [None] * len(PERCENTILES)
    out.update({f"p{q}": None if v is None else round(float(v), 3) for q, v in zip(PERCENTILES, qs)})
    return out


class CpuMeter:
    """Share of the machine's CPU time that other processes used since it was made, and
    `steal()`: the share the hypervisor gave to other machines while ours wanted it (a VM's
    steal time, which "other processes" includes: /proc/stat counts it busy)."""

    def __init__(self) -> None:
        self._start = _cpu_sample()

    def share(self) -> float | None:
        return self._of_capacity(lambda busy, own, steal: max(0.0, busy - own))

    def steal(self) -> float | None:
        return self._of_capacity(lambda busy, own, steal: steal)

    def _of_capacity(self, seconds) -> float | None:
        """`seconds(busy, own, steal)` (CPU seconds since the start) over the machine's CPU
        seconds in that time."""
        end = _cpu_sample()
        if self._start is None or end is None:
            return None
        busy, own, wall, steal = (b - a for a, b in zip(self._start, end, strict=True))
        capacity = wall * (os.cpu_count() or 1)
        return round(seconds(busy, own, steal) / capacity, 3) if capacity > 0 else None


def _cpu_sample() -> tuple[float, float, float, float] | None:
    """(seconds of busy CPU machine-wide, this process's CPU seconds, wall seconds, seconds
    of steal machine-wide)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = (sum(ticks) - ticks[3] - ticks[4]) / hz  # all but idle, iowait
    steal = ticks[7] / hz if len(ticks) > 7 else 0.0
    own = os.times()
    return busy, own.user + own.system, time.perf_counter(), steal


def summary_line(phase: str, s: dict[str, Any]) -> str:
    return (f"{phase}: {s['output_tokens_per_s']} output tok/s, {s['requests_per_s']} req/s, "
            f"TTFT p50/p99 {s['ttft_ms']['p50']}/{s['ttft_ms']['p99']} ms, "
            f"TPOT p50/p99 {s['tpot_ms']['p50']}/{s['tpot_ms']['p99']} ms, "
            f"{s['errors']} errors")


def log(message: str) -> None:
    """One progress line on stderr."""
    from daemon.progress import say

    say(f"bench serve: {message}")
