"""Per-tenant drafting where the window holds none of a tenant's rows: at the batch sizes
below every one it observed, and for the tenants it did not serve.

The exact solve fills a batch-size range the window did not observe with the
cell that is fastest per output token for the window's tenant mix
(tuner.exact, 5): a busy window of copy and prose rows gives the drain that
follows a deep n-gram draft at batch 1-4, priced on a mix where the copy
tenant accepts most of its drafts. When the load falls, the rows left are
often one kind, and prose rows drafting that deep run slower than plain
decoding until a retune has seen them.

`fill_tenant_rules` gives each tenant of the window (MIN_SHARE of its rows,
at most MAX_TENANTS in all, none that already has a rule) a rule of its own there
when its own acceptance says another cell is faster: over the ranges that lie
wholly below the smallest observed batch size (and within the crossover and
the fit's batch span, `exact.probe_batches`), each option (cell, max_batch)
covers the ranges up to max_batch and leaves the rest to the batch rules; its
cost is the summed ms per output token of that tenant's rows alone at each
range's probe batch (`exact.cell_cost`, the window's sampling share). The
cheapest option wins; "no rule" on a tie. A tenant the model knows (its
acceptance or factor, from the fit window) that the traffic window did not
serve (less than MIN_SHARE of it, `served_tenants`) gets the same over every
range up to the crossover: the window holds none or few of its rows, so the
batch rules it set were priced on other tenants' text. A tenant the model has
not measured gets no rule: its rates are the no-credit prior
(`PerfModel.factor_of`), which would give it "none" everywhere and keep its
rows from ever drafting there, so they follow the batch rules and get
measured (a busy window whose copy rows had not drafted yet gave copy "none"
up to batch 4). Cells are "none" and the techniques
the batch rules draft with there, no deeper than they draft, so the policy
needs no more speculation pages than before. A rule covers only batch sizes
or tenants the window did not observe, so it changes no goodput predicted on it, and a
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
    """`policy` with a rule for each tenant whose rows are faster with a cell of their own
    where the window holds none of them, and those rules as dicts (module docstring)."""
    if not traffic.batch_weights or policy.crossover <= 0:
        return policy, []
    ruled, known = {t.tenant for t in policy.tenants}, known_tenants(model)
    served = served_tenants(traffic.tenant_mix)
    present = sorted(served & known - ruled, key=lambda t: (-traffic.tenant_mix[t], t))
    absent = sorted(known - served - ruled)
    below = _prefix(policy, space, model, traffic, capacity, min(traffic.batch_weights))
    anywhere = _prefix(policy, space, model, dataclasses.replace(traffic, batch_weights={}), capacity)
    rules: list[TenantRule] = []
    for tenant, prefix in [(t, below) for t in present] + [(t, anywhere) for t in absent]:
        if len(ruled) + len(rules) >= MAX_TENANTS:
            break
        rule = _own_rule(tenant, prefix, policy, space, model, traffic, capacity)
        if rule is not None:
            rules.append(rule)
    if not rules:
        return policy, []
    return (dataclasses.replace(policy, tenants=(*policy.tenants, *rules)),
            [dataclasses.asdict(r) for r in rules])


def served_tenants(mix: dict[str, float]) -> set[str]:
    """The tenants a window served: MIN_SHARE of its mix or more. Rows of one with less, a
    low phase's first prose rows in a copy drain, are too few for the batch rules to weigh.

    >>> sorted(served_tenants({"copy": 0.99, "prose": 0.004}))
    ['copy']
    """
    return {t for t, w in mix.items() if w >= MIN_SHARE}


def known_tenants(model: PerfModel) -> set[str]:
    """Tenants the model has acceptance figures or a factor for (the fit window's).

    >>> sorted(known_tenants(PerfModel(target=(1, 0, 0, 0, 0), acceptance={"ngram|a": (0.5,),
    ...                                "ngram": (0.4,)}, tenant_factor={"b": 1.0})))
    ['a', 'b']
    """
    return {k.split("|", 1)[1] for k in model.acceptance if "|" in k} | set(model.tenant_factor)


def _prefix(policy: TunedPolicy, space: SearchSpace, model: PerfModel, traffic: Traffic,
            capacity: Capacity, smallest: int = 1 << 30) -> list[tuple[int, int]]:
    """(range end, probe batch) of the ranges 0, 1, ... (no gap) that the window did not
    observe, each below `smallest`, within the crossover and priced by the fill
    (`exact.probe_batches`)."""
    probes = probe_batches(space, traffic, capacity, model.batch_span)
    prefix = []
    for r, upper in enumerate(space.ranges):
        if r not in probes or upper >= smallest or upper > policy.crossover:
            break
        prefix.append((upper, probes[r]))
    return prefix


def _own_rule(tenant: str, prefix: list[tuple[int, int]], policy: TunedPolicy, space: SearchSpace,
              model: PerfModel, traffic: Traffic, capacity: Capacity) -> TenantRule | None:
    """The cheapest (cell, up to which range) for `tenant`'s rows alone over `prefix`, the
    ranges above it left to the batch rules; None where no option beats the batch rules."""
    base = [policy.choose(batch) for _, batch in prefix]
    drafting = [cell for cell in base if cell[0] != "none"]
    if not drafting:
        return None
    deepest = max(d for _, d in drafting)
    cells = [("none", 0)] + sorted({(t, d) for t, _ in drafting for d in space.depths if d <= deepest})
    costs = {}
    for batch in {b for _, b in prefix}:
        at = dataclasses.replace(traffic.probe(batch), tenant_mix={tenant: 1.0}, bucket_mix={})
        for cell in {*cells, *base}:
            costs[batch, cell] = cell_cost(model, at, batch, cell, policy.draft_vocab, capacity)
    best = sum(costs[b, c] for (_, b), c in zip(prefix, base, strict=True))
    rule = None
    for cell in cells:
        for k, (upper, _) in enumerate(prefix):
            cost = (sum(costs[b, cell] for _, b in prefix[:k + 1])
                    + sum(costs[b, c] for (_, b), c in zip(prefix[k + 1:], base[k + 1:], strict=True)))
            if cost < best * (1 - 1e-9):
                best, rule = cost, TenantRule(tenant, cell[0], cell[1], upper)
    return rule
