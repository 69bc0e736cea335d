"""What a policy would do on the observed traffic: goodput, p95 TPOT and KV capacity.

For each observed batch size B (u_B: its share of the output tokens) the
policy picks (technique, depth); the model gives the step time ms_B and the
tokens one sequence delivers e_B for the tenant mix (drafts past a request's
end count as rejected: tuner.acceptance, "Delivered drafts"). The tokens served at each
batch size are the work, whatever the policy, so a policy that emits more per
step needs fewer steps there (u_B / (B e_B) of them, not the observed share):

    goodput  = 1000 * sum_B u_B / sum_B u_B * ms_B / (B * e_B)     (tokens/s)
    TPOT_B   = ms_B / e_B, and its p95 over output tokens (weight u_B)

So each batch size favours its own fastest cell (most tokens per ms at B):
holding the share of *steps* fixed instead would reward emitting more tokens
per step wherever steps are slow and penalise longer steps wherever they are
fast, whatever they emit (speculating at batch 32 and not at batch 1 as soon
as the window holds both).

Tenant rules (engine.policy.TenantRule): at a batch size where one applies,
the rows of the traffic's tenant mix draft with their own (technique,
depth) and the batch is priced row by row (tuner.mixed: tokens from each
tenant's own rates, step time from the token rows the rows run, each at its
own depth, and the proposers that run); elsewhere as above. Either way a
drafting row costs 1 + the drafts it verifies on average (its depth times the
draft share, PerfModel.drafts_per_row), the share its tokens count.

Memory, in pages of the KV pool: speculation gets floor(total * pool_split)
and must fit its proposers' resident bytes, their per-sequence bytes and
the depth extra verify slots of every speculating sequence; tenants get the
rest and must hold the observed concurrency at its mean footprint
(prompt + output) where the whole pool holds it. Constraint values follow
Optuna: <= 0 is feasible.

Capacity (tuner.capacity, whose docstring states the model): the split also
moves goodput. Tenants' pages admit a number of sequences; steps that wanted
more (batch + waiting) run at that many, each batch size's tokens at the
step time of the batch they run at, so a split that binds the pool costs the
throughput the smaller batch loses. A draft model's KV comes from the lent
pages, so it drafts for the share of each batch they hold. Where even the
whole pool cannot hold the observed concurrency (a memory-bound load), the
tenant constraint keeps one sequence and the objective prices the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from engine.policy import TunedPolicy
from tuner.capacity import (
    Capacity,
    admitted_at,
    held_at,
    lender_footprint,
    pages_of_tokens,
    pages_per_sequence,
    under_split,
)
from tuner.mixed import Pricer
from tuner.model import PerfModel
from tuner.traffic import Traffic


@dataclass(frozen=True)
class Evaluation:
    """One policy on the observed traffic."""

    goodput: float
    p95_tpot_ms: float
    tenant_pages: int
    tenant_pages_needed: int
    spec_pages: int
    spec_pages_needed: int
    tpot_excess_ms: float = 0.0
    """p95 TPOT above the target (0 when met or when there is no target)."""
    admitted: int = 0
    """Sequences the tenants' pages admit at the observed footprint (tuner.capacity)."""
    held_share: float = 1.0
    """Share of the rows a lent-KV technique speculates on that the lent pages hold (token
    weighted; 1 without one)."""
    per_batch: dict[int, tuple[float, float]] = field(default_factory=dict, compare=False)
    """Batch size -> (predicted tokens per step, predicted step ms); not in to_dict()."""

    def constraints(self) -> list[float]:
        """Optuna constraint values (<= 0 feasible): tenant KV, speculation KV, TPOT."""
        return [float(self.tenant_pages_needed - self.tenant_pages),
                float(self.spec_pages_needed - self.spec_pages), self.tpot_excess_ms]

    @property
    def feasible(self) -> bool:
        return all(c <= 0 for c in self.constraints())

    def violations(self) -> list[str]:
        out = []
        if self.tenant_pages_needed > self.tenant_pages:
            out.append(f"KV capacity: tenants need {self.tenant_pages_needed} pages (the observed "
                       f"concurrency, or one sequence where the pool binds at any split), the pool "
                       f"split leaves {self.tenant_pages}")
        if self.spec_pages_needed > self.spec_pages:
            out.append(f"speculation needs {self.spec_pages_needed} pages, "
                       f"the pool split gives {self.spec_pages}")
        if self.tpot_excess_ms > 0:
            out.append(f"p95 TPOT {self.p95_tpot_ms:.2f} ms exceeds the target by "
                       f"{self.tpot_excess_ms:.2f} ms")
        return out

    def to_dict(self) -> dict:
        d = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()
             if k != "per_batch"}
        return {**d, "feasible": self.feasible, "violations": self.violations()}


def evaluate(policy: TunedPolicy, model: PerfModel, traffic: Traffic, capacity: Capacity,
             tpot_target_ms: float = 0.0, pricer: Pricer | None = None) -> Evaluation:
    """Predicted goodput, p95 TPOT and page budgets of `policy` (see the module docstring).
    `per_batch` is keyed by the batch sizes the policy runs at (tuner.capacity: fewer where the
    split binds the pool). A batch where a tenant rule applies is priced row by row
    (tuner.mixed); `pricer`, when given, caches those figures across calls (same model,
    draft vocabulary and traffic at the same split)."""
    tokens = time_ms = held = lent_tokens = 0.0
    tpot: list[tuple[float, float]] = []  # (TPOT ms, weight)
    per_batch: dict[int, tuple[float, float]] = {}
    tenant_pages, tenant_need, spec_pages, spec_need = _pages(policy, traffic, capacity)
    split = policy.pool_split if capacity.priced_split is None else capacity.priced_split
    footprint = lender_footprint(traffic, capacity)
    tenant_footprint = pages_per_sequence(traffic, capacity)
    traffic = under_split(traffic, capacity, split)
    shares = traffic.token_shares()
    if policy.tenants and pricer is None:
        pricer = Pricer(model, policy.draft_vocab, traffic.sampled_rows, traffic.sampled_steps)
    for batch in traffic.batch_weights:
        rows = tenant_rows(policy, batch, traffic.mix_at(batch), capacity)
        if rows is not None:  # rows of several (technique, depth): priced row by row
            holds = {t: held_at(capacity, split, spec_need, capacity.lent_kv[t], footprint, batch)
                     for t in {r[2] for r in rows} & set(capacity.lent_kv)}
            lent = [(r[1], holds[r[2]]) for r in rows if r[2] in holds and r[3]]
            held += shares[batch] * sum(w * h for w, h in lent)
            lent_tokens += shares[batch] * sum(w for w, _ in lent)
            per_seq = sum(w * pricer.tokens(t, d, tenant, holds.get(t)) for tenant, w, t, d in rows)
            core_ms = pricer.step_ms(batch, [(w, t, d, pricer.drafts(t, d, tenant, holds.get(t)))
                                             for tenant, w, t, d in rows])
            ms = _with_prefill(core_ms, model, traffic, batch, per_seq)
            share, share_ms = goodput_terms(shares[batch], batch * per_seq, ms)
            tokens, time_ms = tokens + share, time_ms + share_ms
            per_batch[batch] = (batch * per_seq, ms)
            tpot.append((ms / per_seq, share))
            continue
        technique, depth = _choice(policy, batch, capacity)
        hold = None  # a lent-KV technique drafts for the rows its pages hold
        if technique in capacity.lent_kv and depth:
            hold = held_at(capacity, split, spec_need, capacity.lent_kv[technique], footprint, batch)
            held, lent_tokens = held + shares[batch] * hold, lent_tokens + shares[batch]
        mix = traffic.mix_at(batch)
        per_seq = model.tokens_per_seq_mix(technique, depth, mix, policy.draft_vocab, hold)
        ms = _with_prefill(model.predict_step_ms(technique, depth, batch, 0.0, policy.draft_vocab,
                                                 traffic.sampled_rows.get(batch, 0.0),
                                                 traffic.sampled_steps.get(batch, 0.0),
                                                 model.drafts_per_row(technique, depth, mix,
                                                                      policy.draft_vocab, hold)),
                           model, traffic, batch, per_seq)
        share, share_ms = goodput_terms(shares[batch], batch * per_seq, ms)
        tokens += share
        time_ms += share_ms
        per_batch[batch] = (batch * per_seq, ms)
        tpot.append((ms / per_seq, share))
    p95 = weighted_quantile(tpot, 0.95)
    excess = max(0.0, p95 - tpot_target_ms) if tpot_target_ms > 0 else 0.0
    return Evaluation(1000.0 * tokens / time_ms if time_ms > 0 else 0.0, p95,
                      tenant_pages, tenant_need, spec_pages, spec_need, excess,
                      admitted_at(capacity, split, tenant_footprint),
                      held / lent_tokens if lent_tokens > 0 else 1.0, per_batch)


def _with_prefill(core_ms: float, model: PerfModel, traffic: Traffic, batch: int,
                  per_seq: float) -> float:
    """A step's time with the observed prefill charged per output token (evaluate): a step
    that emits more carries more of it (fewer steps, the same prompts). Charged per step, it
    would make deep drafts look best wherever steps admit many prompt tokens."""
    prefill_ms = model.prefill_ms(traffic.prefill_per_step.get(batch, 0.0))
    seen = traffic.tokens_per_step.get(batch) or float(batch)
    return core_ms + prefill_ms * batch * per_seq / seen


def tenant_rows(policy: TunedPolicy, batch: int, mix: Mapping[str, float],
                capacity: Capacity) -> list[tuple[str, float, str, int]] | None:
    """(tenant, weight, technique, depth) of each tenant of `mix` at `batch` under `policy`'s
    row choices (engine.policy.TunedPolicy.choose_row), as the engine drafts them; None
    where no tenant rule applies there (the batch rule prices every row)."""
    if (not policy.tenants or not mix or batch > policy.crossover
            or batch > capacity.spec_max_batch
            or all(policy.tenant_rule(batch, t) is None for t in mix)):
        return None
    total = sum(mix.values())
    out = []
    for tenant, w in mix.items():
        technique, depth = policy.choose_row(batch, tenant)
        if technique not in capacity.proposers or not depth:
            technique, depth = "none", 0
        out.append((tenant, w / total, technique, drafted_depth(technique, depth, capacity)))
    return out


def goodput_terms(share: float, tokens_per_step: float, step_ms: float) -> tuple[float, float]:
    """One batch size's terms of the goodput sums: its share of the tokens and the step time
    emitting them takes at `tokens_per_step` (module docstring).

    >>> goodput_terms(0.25, 4.0, 20.0)  # a quarter of the tokens, 5 ms per token
    (0.25, 1.25)
    """
    return share, share * step_ms / tokens_per_step


def _choice(policy: TunedPolicy, batch: int, capacity: Capacity) -> tuple[str, int]:
    technique, depth = policy.choose(batch)
    if batch > capacity.spec_max_batch or technique not in capacity.proposers:
        return "none", 0
    return technique, drafted_depth(technique, depth, capacity)


def _pages(policy: TunedPolicy, traffic: Traffic, capacity: Capacity) -> tuple[int, int, int, int]:
    """(tenant pages, tenant pages needed, speculation pages, speculation pages needed)."""
    spec_pages = math.floor(capacity.total_pages * policy.pool_split)
    spec_need = speculation_pages_needed(speculating_rules(policy, capacity), policy.crossover,
                                         traffic, capacity)
    return (capacity.total_pages - spec_pages, tenant_pages_needed(traffic, capacity),
            spec_pages, spec_need)


def tenant_pages_needed(traffic: Traffic, capacity: Capacity) -> int:
    """Pages tenants must keep: the observed concurrency at its mean footprint (prompt +
    output) where the whole pool holds it; where it does not (a memory-bound load, requests
    wait at any split) one sequence's, and the objective prices how much a split deepens the
    wait (tuner.capacity).

    >>> busy = Traffic(1, {1: 1.0}, {}, 8.0, 8, mean_prompt_tokens=100, mean_output_tokens=60)
    >>> tenant_pages_needed(busy, Capacity(100, 16)), tenant_pages_needed(busy, Capacity(79, 16))
    (80, 10)
    """
    per_sequence = (pages_of_tokens(traffic.tokens_per_sequence, capacity)
                    if traffic.tokens_per_sequence > 0 else  # no finished request: pages held
                    math.ceil(pages_per_sequence(traffic, capacity)))
    concurrency = math.ceil(traffic.required_concurrency)
    if admitted_at(capacity, 0.0, per_sequence) >= concurrency:
        return concurrency * per_sequence
    return per_sequence


def speculation_pages_needed(used: Mapping[str, int], crossover: int, traffic: Traffic,
                             capacity: Capacity) -> int:
    """Pages speculation needs: the proposers' resident and per-sequence bytes and the verify
    slots of every speculating sequence, for `used` (technique -> deepest depth it drafts)
    at batch sizes up to `crossover`. It grows with each of the three and depends on the
    traffic only through its concurrency."""
    speculating = min(math.ceil(traffic.required_concurrency), crossover, capacity.spec_max_batch)
    if speculating <= 0 or not used:
        return 0
    depth = max(used.values())
    spec_bytes = sum(capacity.proposers[t][0] for t in used)
    spec_bytes += speculating * depth * max(capacity.proposers[t][1] for t in used)
    need = math.ceil(speculating * depth / capacity.page_size)
    if capacity.page_bytes > 0:
        need += math.ceil(spec_bytes / capacity.page_bytes)
    return need


def drafted_depth(technique: str, depth: int, capacity: Capacity) -> int:
    """The depth the engine really drafts for a rule: no deeper than it verifies or than
    the technique drafts (e.g. its MTP heads)."""
    return min(depth, capacity.max_depth, capacity.proposer_depths.get(technique, depth))


def speculating_rules(policy: TunedPolicy, capacity: Capacity) -> dict[str, int]:
    """Technique -> deepest depth over the rules (batch and tenant) that apply at or below the
    crossover."""
    used: dict[str, int] = {}
    lower = 0  # a rule covers batch sizes (lower, max_batch]
    for rule in policy.rules:
        if lower < policy.crossover and rule.technique in capacity.proposers:
            depth = drafted_depth(rule.technique, rule.depth, capacity)
            used[rule.technique] = max(used.get(rule.technique, 0), depth)
        lower = rule.max_batch
    for t in policy.tenants:  # a tenant rule applies at batch sizes up to the crossover
        if policy.crossover > 0 and t.technique in capacity.proposers:
            depth = drafted_depth(t.technique, t.depth, capacity)
            used[t.technique] = max(used.get(t.technique, 0), depth)
    return used


def weighted_quantile(values: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of (value, weight) pairs (the smallest value covering q of the weight).

    >>> weighted_quantile([(1.0, 1), (5.0, 1), (9.0, 8)], 0.15)
    5.0
    """
    pairs = sorted(v for v in values if v[1] > 0)
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return 0.0
    acc = 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= q * total:
            return value
    return pairs[-1][0]
