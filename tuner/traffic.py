"""The traffic actually observed: what the objective averages over and the KV pool must hold.

    >>> from engine.types import StepStats
    >>> def row(b, q): return StepStats(batch_size=b, decode_tokens=b, step_ms=10.0, queue_len=q)
    >>> rows = [row(1, 0), row(3, 1)]
    >>> t = observe(rows, [], quantile=1.0)
    >>> t.batch_weights, t.token_weights, t.concurrency
    ({1: 0.5, 3: 0.5}, {1: 0.25, 3: 0.75}, 4.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.types import StepStats, pow2_bucket
from tuner.data import RequestRow

HIGH_FOOTPRINT = 0.9
"""Quantile of the pages per running sequence that Traffic.pages_per_sequence_high reports."""


@dataclass(frozen=True)
class Traffic:
    """Observed load over the fit window."""

    steps: int
    batch_weights: dict[int, float]
    """Batch size -> share of steps (sums to 1)."""
    prefill_per_step: dict[int, float]
    """Batch size -> mean prefill tokens per step, as observed."""
    concurrency: float
    """The configured quantile of running + waiting sequences per step."""
    concurrency_max: int
    arrival_rate: float = 0.0
    """Requests per second over the requests' span."""
    mean_latency_s: float = 0.0
    """Mean arrival-to-finish time of finished requests."""
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    tenant_mix: dict[str, float] = field(default_factory=dict)
    """Tenant -> share of the decode rows (steps that record row classes) or output tokens
    (sums to 1): of the steps' batches where they name their tenants, else of the finished
    requests; empty without either."""
    token_weights: dict[int, float] = field(default_factory=dict)
    """Batch size -> share of the output tokens emitted at that size (sums to 1; empty: taken
    from batch_weights, one token per sequence and step)."""
    tokens_per_step: dict[int, float] = field(default_factory=dict)
    """Batch size -> output tokens a step emitted, as observed (empty: one per sequence). The
    prefill those steps carried is paid per output token, whatever the policy: a policy that
    emits more per step takes fewer steps, not less prefill (tuner.objective.evaluate)."""
    bucket_mix: dict[int, dict[str, float]] = field(default_factory=dict)
    """Power-of-two batch bucket (1, 2, 4, 8, ...) -> the tenant mix the steps of batch sizes
    in (bucket/2, bucket] served; `mix_at` falls back to tenant_mix."""
    sampled_rows: dict[int, float] = field(default_factory=dict)
    """Batch size -> mean rows per step that sample (temperature > 0); absent: none do."""
    sampled_steps: dict[int, float] = field(default_factory=dict)
    """Batch size -> share of steps where any row samples (what a whole-batch sampler costs)."""
    queue_per_step: dict[int, float] = field(default_factory=dict)
    """Batch size -> mean requests waiting per step, of steps that report KV pages held: with
    the batch, the sequences those steps wanted to run (tuner.capacity prices a pool that
    holds fewer or more; a queue behind a full batch waits whatever the pool: the capacity
    caps it at the engine's max_batch)."""
    pages_per_sequence: float = 0.0
    """Mean KV pages a running sequence held (kv_pages_used / batch_size over the steps that
    held any; 0: not observed)."""
    pages_per_sequence_high: float = 0.0
    """The HIGH_FOOTPRINT quantile of the same per-step figure: what a lender must hold per
    row so that the longer sequences fit too (tuner.capacity.held_share)."""

    def mix_at(self, batch: int) -> dict[str, float]:
        """The tenant mix served at `batch`'s bucket, else the whole window's.

        Tenants do not share batch sizes evenly: as a copy-heavy phase gives way to a busy
        mixed one, the window's mix is mostly the copy tenant's while its few large batches
        already serve every kind. One mix for all sizes would credit those large batches
        with the copy tenant's acceptance.

        >>> Traffic(1, {1: 1.0}, {}, 1.0, 1, tenant_mix={"a": 1.0}, bucket_mix={4: {"b": 1.0}}).mix_at(3)
        {'b': 1.0}
        """
        return self.bucket_mix.get(pow2_bucket(batch)) or self.tenant_mix

    def token_shares(self) -> dict[int, float]:
        """token_weights, or batch_weights weighted by the batch size (one token per sequence)."""
        if self.token_weights:
            return self.token_weights
        total = sum(b * w for b, w in self.batch_weights.items())
        return {b: b * w / total for b, w in self.batch_weights.items()}

    def probe(self, batch: int) -> Traffic:
        """This traffic as if all of it ran at `batch`, a size it was not seen at: the tenant
        mix of that size's bucket (else the window's), the window's share of sampled rows and
        of steps that sample, no prefill and no queue. What the exact solve prices a batch-size
        range with no observed steps at (tuner.exact, "ranges without traffic").

        >>> t = Traffic(1, {2: 0.5, 6: 0.5}, {2: 9.0}, 4.0, 6, sampled_rows={6: 3.0},
        ...             sampled_steps={6: 1.0})
        >>> p = t.probe(16)
        >>> p.batch_weights, p.sampled_rows, p.sampled_steps, p.prefill_per_step
        ({16: 1.0}, {16: 6.0}, {16: 0.5}, {})
        """
        rows = sum(b * w for b, w in self.batch_weights.items())
        sampled = sum(self.sampled_rows.get(b, 0.0) * w for b, w in self.batch_weights.items())
        any_share = sum(self.sampled_steps.get(b, 0.0) * w for b, w in self.batch_weights.items())
        return dataclasses.replace(
            self, batch_weights={batch: 1.0}, token_weights={batch: 1.0}, prefill_per_step={},
            tokens_per_step={}, queue_per_step={},
            sampled_rows={batch: batch * sampled / rows} if sampled > 0 and rows > 0 else {},
            sampled_steps={batch: any_share} if any_share > 0 else {},
        )  # fmt: skip

    @property
    def required_concurrency(self) -> float:
        """Sequences the pool must hold: the step quantile, or Little's law if larger."""
        return max(self.concurrency, self.arrival_rate * self.mean_latency_s)

    @property
    def tokens_per_sequence(self) -> float:
        """KV footprint of one sequence at its end (prompt + output)."""
        return self.mean_prompt_tokens + self.mean_output_tokens

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "batch_weights": {str(b): round(w, 4) for b, w in self.batch_weights.items()},
            "token_weights": {str(b): round(w, 4) for b, w in self.token_shares().items()},
            "concurrency": round(self.concurrency, 2), "concurrency_max": self.concurrency_max,
            "required_concurrency": round(self.required_concurrency, 2),
            "arrival_rate": round(self.arrival_rate, 4),
            "mean_latency_s": round(self.mean_latency_s, 4),
            "mean_prompt_tokens": round(self.mean_prompt_tokens, 1),
            "mean_output_tokens": round(self.mean_output_tokens, 1),
            "tenant_mix": {t: round(w, 4) for t, w in self.tenant_mix.items()},
            "sampled_rows": {str(b): round(v, 3) for b, v in self.sampled_rows.items()},
            "queue_per_step": {str(b): round(v, 3) for b, v in self.queue_per_step.items()},
            "pages_per_sequence": round(self.pages_per_sequence, 2),
            "pages_per_sequence_high": round(self.pages_per_sequence_high, 2),
            "bucket_mix": {str(b): {t: round(w, 4) for t, w in mix.items()}
                           for b, mix in self.bucket_mix.items()},
        }


def observe(steps: Sequence[StepStats], requests: Sequence[RequestRow],
            quantile: float = 0.95) -> Traffic:
    """Summarize steps (batch sizes, concurrency) and requests (rate, lengths, tenants)."""
    if not steps:
        raise ValueError("no steps to observe")
    counts: dict[int, int] = {}
    prefill: dict[int, int] = {}
    emitted: dict[int, int] = {}
    sampled: dict[int, list[int]] = {}  # batch size -> [sampled rows, steps with any]
    queued: dict[int, int] = {}
    footprints: list[float] = []  # pages per running sequence, per step that held any
    for s in steps:
        counts[s.batch_size] = counts.get(s.batch_size, 0) + 1
        if s.kv_pages_used > 0:  # an engine that reports its pages: its queue may be theirs
            queued[s.batch_size] = queued.get(s.batch_size, 0) + s.queue_len
        if s.kv_pages_used > 0 and s.batch_size > 0:
            footprints.append(s.kv_pages_used / s.batch_size)
        prefill[s.batch_size] = prefill.get(s.batch_size, 0) + s.prefill_tokens
        emitted[s.batch_size] = emitted.get(s.batch_size, 0) + s.decode_tokens
        if s.sampled_rows:
            rows = sampled.setdefault(s.batch_size, [0, 0])
            rows[0] += s.sampled_rows
            rows[1] += 1
    n, total = len(steps), sum(emitted.values())
    load = np.array([s.batch_size + s.queue_len for s in steps], float)
    figures = _request_figures(requests)
    served = _served_mix(steps)
    if served:
        figures["tenant_mix"] = served
    return Traffic(
        steps=n,
        batch_weights={b: c / n for b, c in sorted(counts.items())},
        prefill_per_step={b: prefill[b] / counts[b] for b in sorted(counts)},
        concurrency=float(np.quantile(load, quantile)),
        concurrency_max=int(load.max()),
        **figures,
        token_weights={b: emitted[b] / total for b in sorted(counts)} if total else {},
        bucket_mix=_bucket_mixes(steps),
        tokens_per_step={b: emitted[b] / counts[b] for b in sorted(counts)},
        sampled_rows={b: sampled[b][0] / counts[b] for b in sorted(sampled)},
        sampled_steps={b: sampled[b][1] / counts[b] for b in sorted(sampled)},
        queue_per_step={b: queued[b] / counts[b] for b in sorted(queued) if queued[b]},
        pages_per_sequence=float(np.mean(footprints)) if footprints else 0.0,
        pages_per_sequence_high=float(np.quantile(footprints, HIGH_FOOTPRINT)) if footprints else 0.0,
    )


def _bucket_mixes(steps: Sequence[StepStats]) -> dict[int, dict[str, float]]:
    groups: dict[int, list[StepStats]] = {}
    for s in steps:
        groups.setdefault(pow2_bucket(s.batch_size), []).append(s)
    mixes = {b: _served_mix(rows) for b, rows in sorted(groups.items())}
    return {b: mix for b, mix in mixes.items() if mix}


def _served_mix(steps: Sequence[StepStats]) -> dict[str, float]:
    """Tenant -> share of the decode rows of the steps that record their row classes (what
    a batch draws its rows from: tuner.mixed), and of the tokens the other steps emitted,
    each step's split evenly over the tenants in its batch (empty when no step names its
    tenants).

    Finished requests lag: in a busy minute the window's requests are still running, and a
    mix taken from them alone would be empty or the previous traffic's.

    >>> from engine.types import RowClass, StepStats
    >>> def row(n, *tenants): return StepStats(batch_size=n, decode_tokens=n, step_ms=10.0, tenants=tenants)
    >>> _served_mix([row(3, "a"), row(2, "a", "b")])
    {'a': 0.8, 'b': 0.2}
    >>> classes = (RowClass("a", "ngram", 2, 3), RowClass("b", "none", 0, 1))
    >>> _served_mix([StepStats(batch_size=4, decode_tokens=9, step_ms=1.0, row_classes=classes)])
    {'a': 0.75, 'b': 0.25}
    """
    mix: dict[str, float] = {}
    for s in steps:
        if s.row_classes:
            for c in s.row_classes:
                mix[c.tenant] = mix.get(c.tenant, 0.0) + c.rows
            continue
        for t in s.tenants:
            mix[t] = mix.get(t, 0.0) + s.decode_tokens / len(s.tenants)
    total = sum(mix.values())
    return {t: v / total for t, v in sorted(mix.items())} if total else {}


def _request_figures(requests: Sequence[RequestRow]) -> dict:
    if not requests:
        return {}
    arrivals = [r.arrival_time for r in requests]
    span = max(r.finish_time for r in requests) - min(arrivals)
    outputs = sum(r.output_tokens for r in requests)
    mix: dict[str, float] = {}
    for r in requests:
        mix[r.tenant] = mix.get(r.tenant, 0.0) + r.output_tokens
    n = len(requests)
    return {
        "arrival_rate": n / span if span > 0 else 0.0,
        "mean_latency_s": sum(r.finish_time - r.arrival_time for r in requests) / n,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / n,
        "mean_output_tokens": outputs / n,
        "tenant_mix": {t: v / outputs for t, v in sorted(mix.items())} if outputs else {},
    }
