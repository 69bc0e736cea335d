"""What a pool split costs tenants and buys a draft model: the capacity side of the objective.

The pool split lends floor(total_pages * split) pages to speculation; tenants keep the rest.
For n-gram, MTP and early exit the lent pages buy nothing beyond their own resident bytes and
verify slots (tuner.objective's speculation constraint). A draft model's KV pages come from the
lent share, so the split decides how many sequences it can draft for. The model, from the
telemetry of the traffic window (tuner.traffic.Traffic):

1. Footprint. A running sequence holds `pages_per_sequence` pages: the observed mean of
   kv_pages_used / batch_size over the window's steps (what sequences really hold mid-life,
   prefix sharing and sliding-window rings included), else ceil((prompt + output) /
   page_size) from the finished requests, else one page.
2. Admission. Tenants' pages T(s) = total - floor(total * s) admit
   N(s) = max(1, floor(T(s) / pages_per_sequence)) sequences (the engine shrinks the split
   for one sequence rather than block the queue, so at least one runs).
3. Demand. A step observed at batch b with q requests waiting (Traffic.queue_per_step, a
   mean per batch size, of steps that report their pages) wanted d = min(b + q, max_batch)
   sequences. Under split s it runs at min(d, N(s)): where the pool binds, requests
   wait (or are preempted and recomputed: that prefill is kept as observed, per output
   token) and the batch shrinks; where the observed split bound it and s lends less, it
   grows. The tokens are the same work, so they take the
   step time of the batch they run at, and the performance model prices the loss: on an
   accelerator where a step costs about the same at batch 4 as at 16, a quarter of the batch
   is almost a quarter of the throughput. `under_split` remaps the traffic's batch sizes so;
   where the pool holds every demand it returns the traffic unchanged.
4. Lent KV. A technique whose draft KV lives in the lent pages (Capacity.lent_kv: technique ->
   pages it needs per page of a sequence it holds; 1 when the draft shares the target's page
   shape) holds a sequence only with room for its whole context, and lets it go when it
   cannot grow. With L lent pages left once speculation's resident bytes and verify slots
   are paid, it drafts for min(1, L / (ratio * F * B)) of a batch of B (`held_share`), F the
   0.9 quantile of the per-step footprint (`lender_footprint`: the mean would hold the
   shorter sequences and lose the longer ones); the other rows decode plainly. That share replaces the
   technique's fitted draft share: a draft model proposes for every sequence it holds, and the share measured
   under another split says how much that split held, not what this one will.

5. Pools. An engine with sliding-window layers keeps two pools (Capacity.pools): global pages
   grow with the context, a local ring holds at most its window's pages per sequence. The
   split lends the same share of each, a sequence's pages spread over them (`pool_shares`),
   and admission and holding are bounded by whichever pool runs out first. Without the
   pools (Capacity.pools empty) the whole pool is one.

The flip this gives. A light load (demand well inside the pool) pays nothing for lent pages,
and a draft model gains until it holds every row: the best split is the smallest that holds
them. A memory-bound load (long contexts filling the pool, requests waiting) loses a share of
its batch for every page lent; the draft's gain on the rows it holds has to beat that, and
when it does not the best split is smaller, down to 0. Roughly, with step time flat in the
batch: tokens per step go as (1 - s) + s * a / ratio, a the drafted tokens a held sequence
gains per step, so a memory-bound load lends nothing when a < ratio and everything the draft
can use when a > ratio (a draft that more than pays for its pages lends there too, and the
model says so).

Not modelled: queueing delay itself (goodput counts tokens per second of engine time; the
tenant constraint in tuner.objective keeps the observed concurrency where the whole pool
holds it), preemptions a split would add beyond those observed, and the step-time effect of
rows that do not draft in a speculating step (they are priced as drafting rows).

    >>> admitted(tenant_pages=100, per_sequence=12.5)
    8
    >>> held_share(lent_pages=30, ratio=1.0, per_sequence=10.0, batch=6)
    0.5
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.types import EngineCapacity, pow2_bucket
from tuner.traffic import Traffic

LENT_KV = ("draft",)
"""Techniques whose draft KV pages are lent from the tenant pool (Capacity.from_engine)."""


@dataclass(frozen=True)
class Capacity:
    """What the engine can give: pool size, proposers and their memory."""

    total_pages: int
    page_size: int
    page_bytes: int = 0
    """Bytes per page (0: unknown, proposer bytes are then not counted)."""
    max_depth: int = 4
    """Deepest speculation the engine can verify."""
    depths: tuple[int, ...] = ()
    """The depths the search and exploration offer (the engine verifies any depth up to
    max_depth, each row at its own). Empty: every depth to max_depth."""
    proposer_depths: Mapping[str, int] = field(default_factory=dict)
    """Technique -> the deepest it drafts (e.g. its MTP heads); the engine verifies no deeper."""
    spec_max_batch: int = 1 << 30
    """Largest batch the engine speculates at."""
    proposers: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Technique -> (resident bytes, bytes per speculating sequence per draft)."""
    draft_vocabs: tuple[int, ...] = ()
    """The MTP proposer's compiled draft vocabularies (empty: unknown, the config's are searched)."""
    max_batch: int = 1 << 30
    """Most sequences the engine decodes together (demand above it waits whatever the split)."""
    lent_kv: Mapping[str, float] = field(default_factory=dict)
    """Technique -> lent pages its draft KV needs per page of a sequence it holds (a draft
    model's pages come from the split: tuner.capacity); techniques not named need none."""
    pools: tuple[tuple[int, int], ...] = ()
    """(pages, most pages one sequence holds there; 0: no cap) of each pool the split divides
    (global pages and a sliding-window ring); empty: one pool of total_pages (tuner.capacity)."""
    priced_split: float | None = None
    """Price capacity at this split instead of each policy's (tuner.split solves per split)."""

    @property
    def techniques(self) -> tuple[str, ...]:
        return ("none", *sorted(self.proposers))

    @staticmethod
    def from_engine(cap: EngineCapacity) -> Capacity:
        """The objective's view of an engine's `capacity()`: the whole pool (the pool split
        divides it), its depths and batch limits and its proposers' memory."""
        mtp = cap.proposers.get("mtp")
        # the engine may say what a draft page costs in tenant pages; else one (the target's shape)
        lent = {n: float(getattr(p, "kv_page_ratio", None) or 1.0)
                for n, p in cap.proposers.items() if n in LENT_KV}
        return Capacity(
            total_pages=cap.total_pages, page_size=cap.page_size, page_bytes=cap.page_bytes,
            max_depth=cap.max_depth,
            proposer_depths={n: p.max_depth for n, p in cap.proposers.items()},
            spec_max_batch=cap.spec_max_batch,
            proposers={n: (p.resident_bytes, p.bytes_per_draft) for n, p in cap.proposers.items()},
            draft_vocabs=mtp.draft_vocabs if mtp else (), max_batch=cap.max_batch, lent_kv=lent,
            pools=tuple(getattr(cap, "pools", None) or ()),
        )  # fmt: skip



def pages_per_sequence(traffic: Traffic, capacity: Capacity) -> float:
    """Pages one running sequence holds (module doc, 1).

    >>> t = Traffic(1, {1: 1.0}, {}, 1.0, 1, mean_prompt_tokens=40, mean_output_tokens=9)
    >>> (pages_per_sequence(t, Capacity(64, 16)),
    ...  pages_per_sequence(t, Capacity(64, 16, pools=((40, 0), (24, 2)))))
    (4.0, 6.0)
    """
    if traffic.pages_per_sequence > 0:
        return traffic.pages_per_sequence
    return float(pages_of_tokens(traffic.tokens_per_sequence, capacity))


def pages_of_tokens(tokens: float, capacity: Capacity) -> int:
    """Pages a sequence of `tokens` holds over every pool (a ring's at most its cap), at least 1."""
    per_pool = max(1, math.ceil(tokens / capacity.page_size))
    return sum(min(per_pool, cap) if cap else per_pool for _, cap in pools_of(capacity))


def lender_footprint(traffic: Traffic, capacity: Capacity) -> float:
    """Pages per sequence a lender must hold (module doc, 4): the high quantile where observed,
    else the mean footprint."""
    return traffic.pages_per_sequence_high or pages_per_sequence(traffic, capacity)


def admitted(tenant_pages: int, per_sequence: float) -> int:
    """Sequences `tenant_pages` admit at `per_sequence` pages each, at least one."""
    return max(1, math.floor(tenant_pages / max(per_sequence, 1e-9)))


def held_share(lent_pages: float, ratio: float, per_sequence: float, batch: float) -> float:
    """Share of a batch of `batch` rows whose contexts the lent pages hold (module doc, 4)."""
    if batch <= 0:
        return 1.0
    held = max(0.0, lent_pages) / max(ratio * per_sequence, 1e-9)
    return min(1.0, held / batch)


def pool_shares(footprint: float, pools: list[tuple[int, int]]) -> list[float]:
    """Pages of each pool one sequence of `footprint` pages holds: the same in every pool up to
    a pool's cap per sequence (a sliding-window ring), the rest in the others (module doc, 5).

    >>> pool_shares(62.0, [(458, 0), (132, 33)]), pool_shares(90.0, [(458, 0), (132, 33)])
    ([31.0, 31.0], [57.0, 33])
    """
    caps = [c if c > 0 else math.inf for _, c in pools]
    remaining, active, level = footprint, len(caps), math.inf
    for c in sorted(caps):
        if remaining / active <= c:
            level = remaining / active
            break
        remaining, active = remaining - c, active - 1
    return [min(level, c) for c in caps]


def pools_of(capacity: Capacity) -> list[tuple[int, int]]:
    """(pages, cap per sequence) of each pool the split divides; one pool when unknown."""
    return list(capacity.pools) or [(capacity.total_pages, 0)]


def admitted_at(capacity: Capacity, split: float, footprint: float) -> int:
    """Sequences of `footprint` pages the tenants' share of every pool admits under `split`."""
    pools = pools_of(capacity)
    fits = [admitted(pages - math.floor(pages * split), share)
            for (pages, _), share in zip(pools, pool_shares(footprint, pools)) if share > 0]
    return min(fits, default=1)


def held_at(capacity: Capacity, split: float, spec_pages: int, ratio: float, footprint: float,
            batch: float) -> float:
    """held_share of a batch under `split`, every pool's lent pages (less its part of the
    `spec_pages` speculation needs for itself) holding sequences of `footprint` pages."""
    pools = pools_of(capacity)
    total = sum(pages for pages, _ in pools) or 1
    shares = pool_shares(footprint, pools)
    return min((held_share(math.floor(pages * split) - spec_pages * pages / total, ratio, share, batch)
                for (pages, _), share in zip(pools, shares) if share > 0), default=1.0)


def served_batches(traffic: Traffic, capacity: Capacity, split: float) -> dict[int, int]:
    """Observed batch size -> the batch it runs at under `split` (module doc, 3)."""
    room = admitted_at(capacity, split, pages_per_sequence(traffic, capacity))
    out = {}
    for b in traffic.batch_weights:
        demand = min(b + round(traffic.queue_per_step.get(b, 0.0)), capacity.max_batch)
        out[b] = max(1, min(demand, room))
    return out


def under_split(traffic: Traffic, capacity: Capacity, split: float) -> Traffic:
    """The traffic as it would run under `split`: batch sizes remapped (module doc, 3), the
    figures of the batch sizes that merge averaged over their tokens, nobody waiting. The
    same object when no batch size changes."""
    served = served_batches(traffic, capacity, split)
    if all(b == to for b, to in served.items()):
        return traffic
    shares = traffic.token_shares()
    weights: dict[int, float] = {}
    tokens: dict[int, float] = {}
    sums: dict[int,
               list[float]] = {}  # to -> [prefill per token, tokens per step, sampled rate, sampled steps]
    for b, to in served.items():
        u = shares.get(b, 0.0)
        seen = traffic.tokens_per_step.get(b) or float(b)
        weights[to] = weights.get(to, 0.0) + traffic.batch_weights[b]
        tokens[to] = tokens.get(to, 0.0) + u
        acc = sums.setdefault(to, [0.0, 0.0, 0.0, 0.0])
        acc[0] += u * traffic.prefill_per_step.get(b, 0.0) / seen
        acc[1] += u * seen * to / b
        acc[2] += u * traffic.sampled_rows.get(b, 0.0) / b
        acc[3] += u * traffic.sampled_steps.get(b, 0.0)
    per = {to: [v / tokens[to] for v in acc] if tokens[to] > 0 else [0.0] * 4
           for to, acc in sums.items()}
    return dataclasses.replace(
        traffic,
        batch_weights=dict(sorted(weights.items())),
        token_weights=dict(sorted(tokens.items())),
        prefill_per_step={to: p[0] * p[1] for to, p in sorted(per.items())},
        tokens_per_step={to: p[1] for to, p in sorted(per.items())},
        sampled_rows={to: p[2] * to for to, p in sorted(per.items()) if p[2] > 0},
        sampled_steps={to: p[3] for to, p in sorted(per.items()) if p[3] > 0},
        bucket_mix=_merged_mixes(traffic, served, shares),
        queue_per_step={},
    )  # fmt: skip


def _merged_mixes(traffic: Traffic, served: dict[int, int],
                  shares: dict[int, float]) -> dict[int, dict[str, float]]:
    """Bucket -> tenant mix of the tokens that run in it after the remap."""
    mixes: dict[int, dict[str, float]] = {}
    for b, to in served.items():
        into = mixes.setdefault(pow2_bucket(to), {})
        for tenant, w in traffic.mix_at(b).items():
            into[tenant] = into.get(tenant, 0.0) + w * shares.get(b, 0.0)
    out = {}
    for bucket, mix in sorted(mixes.items()):
        total = sum(mix.values())
        if total > 0:
            out[bucket] = {t: w / total for t, w in sorted(mix.items())}
    return out
