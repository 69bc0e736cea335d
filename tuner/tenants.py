"""Per-tenant rules on top of the best single-rule policy: which tenant drafts how.

The batch-rule optimum (tuner.split / tuner.exact, or TPE's best) gives every
row of a batch one (technique, depth). Tenants differ: acceptance of a
copy-heavy tenant may be four times a prose tenant's, so at a moderate batch
the best policy may draft deep for one tenant and not at all for another.
`add_tenant_rules(base, ...)`:

1. Tenants: those of the traffic's mixes at the batch sizes that may
   speculate (up to spec_max_batch), with at least MIN_SHARE of their rows
   (tokens, for steps without row classes); at most MAX_TENANTS, the largest
   first.
2. Options per tenant: no rule (its rows follow the batch rules), or a rule
   (technique, depth, max_batch) over the space's cells, "none" included,
   and the crossover choices as max_batch, keeping one per set of observed
   batch sizes it covers (the others price the same). A candidate keeps the
   base's batch rules and split (the smallest larger split of the grid
   where its rules need more speculation pages); its crossover rises to the largest
   max_batch of a drafting tenant rule, the batch rules above the base's
   crossover saying "none", so rows without a rule draft where they did.
3. Search, every candidate priced by tuner.objective.evaluate (one Pricer
   shared, so each (batch, depth) and (tenant, cell) is priced once):
   exactly, every combination, while there are at most `exact_limit`;
   beyond that, coordinate ascent (each tenant's best option in turn, the
   others fixed, until none changes), then Optuna's multivariate TPE
   (`trials` trials of an in-memory study, seeded with the ascent's result
   and with no rules; the speculation KV pages and the TPOT target as
   constraints, `Trial.set_constraint`). Step time couples the tenants (the
   forward's rows are every tenant's rows together, and its cost is convex in
   them, tuner.mixed; each proposer's fixed cost is paid once), so the
   objective is not a sum over tenants.
4. The best feasible candidate is kept only when its predicted goodput beats
   the base's by more than `min_gain` (a margin against the model's error:
   considering tenant rules must not cost goodput where they do not pay);
   otherwise the base is returned unchanged. `TenantSearch` records the
   decision, the predicted gain over the best single-rule policy, the
   method and its seconds (a retune's details.tenants).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from engine.policy import BatchRule, TenantRule, TunedPolicy
from tuner.capacity import under_split
from tuner.mixed import Pricer
from tuner.model import PerfModel
from tuner.objective import Capacity, Evaluation, evaluate
from tuner.space import SearchSpace
from tuner.traffic import Traffic

CONSTRAINT_NAMES = ("tenant_kv_pages", "speculation_kv_pages", "p95_tpot_ms")
MIN_SHARE = 0.02
"""Share of the speculating batch sizes' mix a tenant needs to get a rule of its own."""
MAX_TENANTS = 8
"""Most tenants given rules (the largest by share)."""

optuna.logging.set_verbosity(optuna.logging.WARNING)

Option = tuple[str, int, int] | None
"""(technique, depth, max_batch) of a tenant rule; None: no rule."""


@dataclass
class TenantSearch:
    """What the per-tenant search did and decided (JSON-able via to_dict)."""

    method: str = "skipped"
    """"exact", "tpe" or "skipped" (no tenant to give a rule)."""
    seconds: float = 0.0
    candidates: int = 0
    """Candidates priced."""
    space: int = 0
    """Combinations of options (the product over tenants)."""
    single_goodput: float = 0.0
    """Predicted goodput of the best single-rule policy (the base)."""
    tenant_goodput: float = 0.0
    """Predicted goodput of the best candidate with tenant rules."""
    chosen: bool = False
    """Whether the tenant rules beat the base by more than the margin and were kept."""
    margin: float = 0.0
    rules: list[dict[str, Any]] = field(default_factory=list)
    """The best candidate's rules ({tenant, technique, depth, max_batch}), kept or not."""
    fill: list[dict[str, Any]] = field(default_factory=list)
    """Rules tuner.tenant_fill added afterwards where the window held none of a tenant's rows."""

    @property
    def gain(self) -> float:
        """Predicted goodput of the tenant rules over the best single-rule policy, minus 1."""
        return self.tenant_goodput / self.single_goodput - 1.0 if self.single_goodput else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {k: (round(v, 4) if isinstance(v, float) else v)
             for k, v in dataclasses.asdict(self).items()}
        return {**d, "gain": round(self.gain, 4)}


def add_tenant_rules(base: TunedPolicy, space: SearchSpace, model: PerfModel, traffic: Traffic,
                     capacity: Capacity, *, tpot_target_ms: float = 0.0, min_gain: float = 0.03,
                     exact_limit: int = 1024, trials: int = 64,
                     seed: int | None = None) -> tuple[TunedPolicy, TenantSearch]:
    """`base` with the best per-tenant rules when they pay by more than `min_gain`, else
    `base`; and the search's record (module docstring)."""
    start = time.perf_counter()
    info = TenantSearch(margin=min_gain)
    pricers: dict[float, Pricer] = {}  # one cache per pool split (the traffic it runs at)

    def score(policy: TunedPolicy) -> tuple[TunedPolicy, Evaluation]:
        """`policy` priced; where its tenant rules need more speculation pages than its split
        lends, at the smallest split of the grid that lends them."""
        info.candidates += 1
        split = policy.pool_split if capacity.priced_split is None else capacity.priced_split
        if split not in pricers:
            at = under_split(traffic, capacity, split)
            pricers[split] = Pricer(model, base.draft_vocab, at.sampled_rows, at.sampled_steps)
        ev = evaluate(policy, model, traffic, capacity, tpot_target_ms, pricers[split])
        if ev.spec_pages_needed > ev.spec_pages and policy.tenants:
            wider = _wider_split(space, capacity, policy.pool_split, ev.spec_pages_needed)
            if wider is not None:
                return score(dataclasses.replace(policy, pool_split=wider))
        return policy, ev

    at_split = under_split(traffic, capacity, base.pool_split
                           if capacity.priced_split is None else capacity.priced_split)

    _, single = score(base)
    info.single_goodput = info.tenant_goodput = single.goodput
    tenants = candidate_tenants(at_split, capacity)
    options = {t: tenant_options(space, at_split, capacity) for t in tenants}
    info.space = math.prod(len(o) for o in options.values()) if tenants else 0
    if not tenants or info.space <= 1:
        info.seconds = round(time.perf_counter() - start, 4)
        return base, info

    def value(choice: Sequence[Option]) -> tuple[float, TunedPolicy, Evaluation]:
        policy, ev = score(with_tenants(base, dict(zip(tenants, choice))))
        return (ev.goodput if ev.feasible else -math.inf), policy, ev

    lists = [options[t] for t in tenants]
    if info.space <= exact_limit:
        info.method = "exact"
        best = max((value(c) for c in itertools.product(*lists)), key=lambda v: v[0])
    else:
        info.method = "tpe"
        ascent = _ascent(lists, value)
        best = _tpe(tenants, lists, value, ascent, trials, seed)
    goodput, policy, _ = best
    if math.isfinite(goodput):
        info.tenant_goodput = goodput
        info.rules = [dataclasses.asdict(r) for r in policy.tenants]
    info.chosen = bool(policy.tenants) and goodput > single.goodput * (1.0 + min_gain)
    info.seconds = round(time.perf_counter() - start, 4)
    return (policy if info.chosen else base), info


def _wider_split(space: SearchSpace, capacity: Capacity, split: float, pages: int) -> float | None:
    """The smallest split of the space's grid above `split` that lends `pages` (None: none
    does, or the split is priced fixed)."""
    if capacity.priced_split is not None or space.max_pool_split <= 0:
        return None
    return next((s for s in space.pool_splits()
                 if s > split and math.floor(capacity.total_pages * s) >= pages), None)


def candidate_tenants(traffic: Traffic, capacity: Capacity) -> list[str]:
    """Tenants with at least MIN_SHARE of the mix (rows, or tokens) at batch sizes that may
    speculate, weighted by each batch size's share of the tokens; the largest first (at most
    MAX_TENANTS).

    >>> t = Traffic(1, {1: 0.5, 64: 0.5}, {}, 1.0, 64, token_weights={1: 0.2, 64: 0.8},
    ...             bucket_mix={1: {"a": 0.9, "b": 0.1}, 64: {"c": 1.0}})
    >>> candidate_tenants(t, Capacity(64, 16, spec_max_batch=32))
    ['a', 'b']
    """
    shares = traffic.token_shares()
    weight: dict[str, float] = {}
    for batch, share in shares.items():
        if batch <= capacity.spec_max_batch:
            for tenant, w in traffic.mix_at(batch).items():
                weight[tenant] = weight.get(tenant, 0.0) + share * w
    total = sum(weight.values())
    ranked = sorted((t for t, w in weight.items() if total and w / total >= MIN_SHARE),
                    key=lambda t: (-weight[t], t))
    return ranked[:MAX_TENANTS]


def tenant_options(space: SearchSpace, traffic: Traffic, capacity: Capacity) -> list[Option]:
    """No rule, then every (technique, depth, max_batch) of the space (module doc, 2)."""
    batches = sorted(b for b in traffic.batch_weights if b <= capacity.spec_max_batch)
    uppers, covered = [], set()
    for upper in sorted(c for c in space.crossovers if c > 0):
        reach = tuple(b for b in batches if b <= upper)
        if reach and reach not in covered:
            covered.add(reach)
            uppers.append(upper)
    cells = [("none", 0)] + [(t, d) for t in space.techniques if t != "none"
                             for d in space.depths]
    return [None] + [(t, d, u) for t, d in cells for u in uppers]


def with_tenants(base: TunedPolicy, choice: dict[str, Option]) -> TunedPolicy:
    """`base` with a tenant rule per chosen option (module doc, 2).

    >>> base = TunedPolicy((BatchRule(2, "ngram", 2), BatchRule(8), BatchRule(64)), crossover=2)
    >>> p = with_tenants(base, {"copy": ("ngram", 4, 8), "chat": None})
    >>> p.crossover, [(r.max_batch, r.technique) for r in p.rules], p.choose_row(6, "chat")
    (8, [(2, 'ngram'), (8, 'none'), (64, 'none')], ('none', 0))
    """
    rules = tuple(TenantRule(t, o[0], o[1], o[2]) for t, o in choice.items() if o is not None)
    if not rules:
        return base
    drafting = [r.max_batch for r in rules if r.technique != "none"]
    crossover = max([base.crossover, *drafting])
    batch_rules = base.rules
    if crossover > base.crossover:  # rows without a rule still stop at the old crossover
        batch_rules = tuple(r if r.max_batch <= base.crossover else BatchRule(r.max_batch)
                            for r in base.rules)
        if base.crossover > 0 and base.crossover not in {r.max_batch for r in base.rules}:
            batch_rules = tuple(sorted((*batch_rules, BatchRule(
                base.crossover, *base.choose(base.crossover))), key=lambda r: r.max_batch))
    return dataclasses.replace(base, rules=batch_rules, crossover=crossover, tenants=rules,
                               version=0, source="tuner", extra={}, explore=None)


Value = Any
"""value(choice) -> (goodput or -inf when infeasible, policy, evaluation)."""


def _ascent(lists: list[list[Option]], value: Value) -> tuple:
    """Coordinate ascent from "no rules": each tenant's best option with the others fixed,
    in turn, until a full pass changes nothing (at most 4 passes)."""
    choice = [None] * len(lists)
    best = value(choice)
    for _ in range(4):
        changed = False
        for k, options in enumerate(lists):
            for option in options:
                if option == choice[k]:
                    continue
                trial = choice[:k] + [option] + choice[k + 1:]
                v = value(trial)
                if v[0] > best[0] * (1 + 1e-9):
                    best, choice, changed = v, trial, True
        if not changed:
            break
    return tuple(choice), best


def _labels(option: Option) -> dict[str, Any]:
    if option is None:
        return {"tech": "batch"}
    return {"tech": option[0], "depth": option[1], "upto": option[2]}


def _tpe(tenants: list[str], lists: list[list[Option]], value: Value, ascent: tuple,
         trials: int, seed: int | None) -> tuple:
    """Optuna's multivariate TPE over each tenant's (technique, depth, max_batch), seeded with
    the ascent's choice and with no rules; the best feasible candidate seen (the ascent's
    included)."""
    techs = sorted({o[0] for options in lists for o in options if o is not None})
    depths = sorted({o[1] for options in lists for o in options if o is not None and o[1]})
    uppers = sorted({o[2] for options in lists for o in options if o is not None})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=True, n_startup_trials=min(16, trials // 2))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    seen: dict[tuple, tuple] = {}
    for choice in (ascent[0], (None,) * len(tenants)):
        params = {}
        for k, option in enumerate(choice):
            params.update({f"{key}_{k}": v for key, v in _labels(option).items()})
        study.enqueue_trial(params)
    best = ascent[1]
    for _ in range(trials):
        trial = study.ask()
        choice = []
        for k in range(len(tenants)):
            tech = trial.suggest_categorical(f"tech_{k}", ["batch", *techs])
            if tech == "batch":
                choice.append(None)
                continue
            depth = 0 if tech == "none" else trial.suggest_categorical(f"depth_{k}", depths)
            upto = trial.suggest_categorical(f"upto_{k}", uppers)
            choice.append((tech, depth, upto) if (tech, depth, upto) in lists[k] else None)
        key = tuple(choice)
        if key not in seen:
            seen[key] = value(list(choice))
        v = seen[key]
        ev = v[2]
        for name, c in zip(CONSTRAINT_NAMES, ev.constraints(), strict=True):
            trial.set_constraint(name, c)
        study.tell(trial, v[0] if math.isfinite(v[0]) else 0.0)
        if v[0] > best[0]:
            best = v
    return best
