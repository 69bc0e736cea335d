"""Per-tenant drafting at the batch sizes below every one the window observed.

The exact solve fills a batch-size range the window did not observe with the
cell that is fastest per output token for the window's tenant mix
(tuner.exact, 5): a busy window at batch 15-30 gives the drain that follows
n-gram@8 at batch 1-4, priced on a mix whose copy tenant accepts 0.66 of its
first drafts and whose prose tenant 0.15. When the load falls, the rows left
are often one kind: the prose and chat of the next low phase drafted 8 deep
for the 8-10 s until a retune had seen them, at 0.6-0.8x plain decoding
(`bench tuner --quick`, kept databases of three rounds).

`fill_tenant_rules` gives each tenant of the window (MIN_SHARE of its rows,
at most MAX_TENANTS, none that already has a rule) a rule of its own there
when its own acceptance says another cell is faster: over the ranges that lie
wholly below the smallest observed batch size (and within the crossover and
the fit's batch span, `exact.probe_batches`), each option (cell, max_batch)
covers the ranges up to max_batch and leaves the rest to the batch rules; its
cost is the summed ms per output token of that tenant's rows alone at each
range's probe batch (`exact.cell_cost`, the window's sampling share). The
cheapest option wins; "no rule" on a tie. Cells are "none" and the techniques
the batch rules draft with there, no deeper than they draft, so the policy
needs no more speculation pages than before. A rule covers only batch sizes
the window did not observe, so it changes no goodput predicted on it, and a
candidate differing from the serving policy only there is applied without
the usual gain (tuner.service, `chooses_same`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.policy import TenantRule, TunedPolicy
from tuner.exact import cell_cost, probe_batches
from tuner.model import PerfModel
from tuner.objective import Capacity
from tuner.space import SearchSpace
from tuner.tenants import MAX_TENANTS, MIN_SHARE
from tuner.traffic import Traffic


def fill_tenant_rules(policy: TunedPolicy, space: SearchSpace, model: PerfModel, traffic: Traffic,
                      capacity: Capacity) -> tuple[TunedPolicy, list[dict[str, Any]]]:
    """`policy` with a rule for each tenant whose rows are faster below the observed batch
    sizes with a cell of their own, and those rules as dicts (module docstring)."""
    if not traffic.batch_weights or policy.crossover <= 0:
        return policy, []
    smallest = min(traffic.batch_weights)
    probes = probe_batches(space, traffic, capacity, model.batch_span)
    prefix: list[tuple[int, int]] = []  # (range end, probe batch), ranges 0.. without a gap
    for r, upper in enumerate(space.ranges):
        if r not in probes or upper >= smallest or upper > policy.crossover:
            break
        prefix.append((upper, probes[r]))
    base = [policy.choose(batch) for _, batch in prefix]
    drafting = [cell for cell in base if cell[0] != "none"]
    if not drafting:
        return policy, []
    deepest = max(d for _, d in drafting)
    cells = [("none", 0)] + sorted({(t, d) for t, _ in drafting for d in space.depths if d <= deepest})
    ruled = {t.tenant for t in policy.tenants}
    shares = sorted(((w, t) for t, w in traffic.tenant_mix.items() if w >= MIN_SHARE and t not in ruled),
                    key=lambda wt: (-wt[0], wt[1]))
    rules = []
    for _, tenant in shares[:max(0, MAX_TENANTS - len(ruled))]:
        costs = {}
        for batch in {b for _, b in prefix}:
            at = dataclasses.replace(traffic.probe(batch), tenant_mix={tenant: 1.0}, bucket_mix={})
            for cell in {*cells, *base}:
                costs[batch, cell] = cell_cost(model, at, batch, cell, policy.draft_vocab, capacity)
        as_is = sum(costs[b, c] for (_, b), c in zip(prefix, base, strict=True))
        best, option = as_is, None
        for cell in cells:
            for k, (upper, _) in enumerate(prefix):
                cost = (sum(costs[b, cell] for _, b in prefix[:k + 1])
                        + sum(costs[b, c] for (_, b), c in zip(prefix[k + 1:], base[k + 1:], strict=True)))
                if cost < best * (1 - 1e-9):
                    best, option = cost, TenantRule(tenant, cell[0], cell[1], upper)
        if option is not None:
            rules.append(option)
    if not rules:
        return policy, []
    return (dataclasses.replace(policy, tenants=(*policy.tenants, *rules)),
            [dataclasses.asdict(r) for r in rules])
