"""Online validation: the new policy's measured goodput against the previous one's.

Goodput is compared at matched batch sizes, because load, not the policy,
decides most of the batch-size mix. For each batch size B seen at least
MIN_PER_BATCH times under both policies, with per-step goodput means c_B
(candidate) and b_B (baseline) and their standard errors,

    w_B      = candidate steps at B / candidate steps at all matched B
    change   = sum_B w_B (c_B - b_B) / sum_B w_B b_B
    noise    = z * sqrt(sum_B w_B^2 (se_c^2 + se_b^2)) / sum_B w_B b_B

and the candidate is rolled back when change < -max(margin, noise). Steps
where the candidate's exploration departed from it are left out. Fewer than
MIN_MATCHED matched candidate steps is "inconclusive" (the policy stays),
unless `against_prediction` finds the policy far below what the model
promised where the previous one has nothing to compare (a shift in load
moved the batch sizes, e.g. from batch 1-2 to batch 32). What is still
inconclusive then goes to `against_replaced`: the candidate's measured
goodput against the replaced policy's figures at the batch sizes the
candidate served (its measured steps where it has enough there, the model's
prediction elsewhere), so a low phase (batch 1-2, where the old policy was
never measured) and a draining one (each batch size seen a step or two)
still conclude keep or rollback. Only decode steps count (`own_steps`):
prefill is the same work under any policy.

    >>> from engine.types import StepStats
    >>> def s(b, tok, ms, v): return StepStats(batch_size=b, decode_tokens=tok, step_ms=ms, policy_version=v)
    >>> old = [s(2, 2, 10.0 + i % 2, 1) for i in range(30)]
    >>> new = [s(2, 2, 20.0 + i % 2, 2) for i in range(30)]
    >>> compare(new, old, TunedPolicy(version=2)).decision
    'rollback'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.policy import TunedPolicy
from engine.types import StepStats
from tuner.explore import is_exploration
from tuner.traffic import Traffic

MIN_PER_BATCH = 3
MIN_MATCHED = 20


@dataclass(frozen=True)
class BatchComparison:
    batch: int
    candidate_steps: int
    baseline_steps: int
    candidate_goodput: float
    baseline_goodput: float


@dataclass(frozen=True)
class Verdict:
    """keep, rollback or inconclusive, with the evidence."""

    decision: str
    reason: str
    candidate_goodput: float | None = None
    """Mean per-step goodput over matched batch sizes (weights w_B), tokens/s."""
    baseline_goodput: float | None = None
    change: float | None = None
    threshold: float | None = None
    matched_steps: int = 0
    per_batch: list[BatchComparison] = field(default_factory=list)
    baseline: str = "measured"
    """"measured": the previous policy's steps; "predicted": the model's figure for it;
    "pooled": its steps at some batch sizes, the model's figure at the others."""

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("candidate_goodput", "baseline_goodput", "change", "threshold"):
            d[k] = None if d[k] is None else round(d[k], 4)
        return d


def own_steps(rows: Sequence[StepStats], policy: TunedPolicy) -> list[StepStats]:
    """The decode steps of `policy`'s version that were not exploration. Steps that carried
    prefill are left out: their prefill is the same work whatever the policy, and how many
    of them a short window catches depends on when requests arrived (a large admission
    costs several decode steps), which would read as one policy being slower than another."""
    return [r for r in _decode(rows) if r.policy_version == policy.version
            and not is_exploration(policy, r.batch_size, r.technique, r.depth)]


def _decode(rows: Sequence[StepStats]) -> list[StepStats]:
    """The steps that carried no prefill (`own_steps`)."""
    return [r for r in rows if not r.prefill_tokens]


def compare(candidate: Sequence[StepStats], baseline: Sequence[StepStats], policy: TunedPolicy,
            previous: TunedPolicy | None = None, margin: float = 0.05, z: float = 2.0) -> Verdict:
    """Judge `policy` from its steps against `previous`'s (all baseline rows without one)."""
    cand = _by_batch(own_steps(candidate, policy))
    base = _by_batch(own_steps(baseline, previous) if previous is not None
                     else _decode(baseline))
    matched = [b for b in sorted(cand) if len(cand[b]) >= MIN_PER_BATCH
               and len(base.get(b, ())) >= MIN_PER_BATCH]
    n = sum(len(cand[b]) for b in matched)
    per = [BatchComparison(b, len(cand[b]), len(base[b]), _mean(cand[b]), _mean(base[b]))
           for b in matched]
    if n < MIN_MATCHED:
        return Verdict("inconclusive", f"only {n} candidate steps at batch sizes the previous "
                       f"policy also ran (need {MIN_MATCHED})", matched_steps=n, per_batch=per)
    weights = {b: len(cand[b]) / n for b in matched}
    c_mean = sum(weights[b] * _mean(cand[b]) for b in matched)
    b_mean = sum(weights[b] * _mean(base[b]) for b in matched)
    var = sum(weights[b] ** 2 * (_sem2(cand[b]) + _sem2(base[b])) for b in matched)
    change = (c_mean - b_mean) / b_mean if b_mean > 0 else 0.0
    threshold = max(margin, z * math.sqrt(var) / b_mean if b_mean > 0 else 0.0)
    if change < -threshold:
        decision = "rollback"
        reason = (f"measured goodput {c_mean:.1f} tokens/s is {-change:.1%} below the previous "
                  f"policy's {b_mean:.1f} at matched batch sizes (threshold {threshold:.1%})")
    else:
        decision = "keep"
        reason = (f"measured goodput {c_mean:.1f} tokens/s vs the previous policy's {b_mean:.1f} "
                  f"({change:+.1%}; rollback below -{threshold:.1%})")
    return Verdict(decision, reason, c_mean, b_mean, change, threshold, n, per)


MIN_PREDICTION_STEPS = 8
"""Steps of its own a candidate needs before its prediction is checked (and MIN_MATCHED
sequences in them)."""


MIN_BATCHED_SEQUENCES = 64
"""Sequences (summed over the steps) that stand in for MIN_PREDICTION_STEPS steps once there
are MIN_PER_BATCH steps: a step of batch 32 averages 32 sequences' drafts."""


def enough_evidence(steps: Sequence[StepStats]) -> bool:
    """Whether `steps` are enough for a verdict against a prediction: MIN_MATCHED sequences,
    in MIN_PREDICTION_STEPS steps or, in large batches, MIN_PER_BATCH steps holding
    MIN_BATCHED_SEQUENCES. A verify step at a large batch is slow, so MIN_PREDICTION_STEPS of
    them may not fit even a stretched window; counted by steps alone, a policy far below its
    prediction there would stay, as inconclusive, and serve the busy traffic.

    >>> from engine.types import StepStats
    >>> at = lambda b, n: [StepStats(batch_size=b, decode_tokens=b, step_ms=9.0)] * n
    >>> (enough_evidence(at(32, 3)), enough_evidence(at(32, 2)), enough_evidence(at(4, 7)),
    ...  enough_evidence(at(4, 8)))
    (True, False, False, True)
    """
    n, sequences = len(steps), sum(s.batch_size for s in steps)
    return sequences >= MIN_MATCHED and (n >= MIN_PREDICTION_STEPS or (
        n >= MIN_PER_BATCH and sequences >= MIN_BATCHED_SEQUENCES))


def against_prediction(verdict: Verdict, own: Sequence[StepStats], measured: float | None,
                       predicted: float | None, margin: float) -> Verdict:
    """An inconclusive `verdict` turned into a rollback when the candidate's `own` steps
    measured `margin` or more below the model's prediction at the batch sizes they ran: the
    model that chose it was wrong there, and the previous policy, chosen where it was
    measured, is the safer one to serve until the next retune refits. Evidence is counted
    per sequence too: 8 steps of batch 32 are 256 sequences' drafts.

    >>> from engine.types import StepStats
    >>> own = [StepStats(batch_size=4, decode_tokens=4, technique="ngram", depth=8, proposed=32,
    ...                  accepted_per_pos=(0,) * 8, propose_ms=1.0, step_ms=400.0, policy_version=1)] * 8
    >>> v = Verdict("inconclusive", "no matched steps")
    >>> (against_prediction(v, own, 23.0, 48.0, 0.3).decision,
    ...  against_prediction(v, own, 40.0, 48.0, 0.3).decision)
    ('rollback', 'inconclusive')
    >>> against_prediction(v, own[:7], 23.0, 48.0, 0.3).decision
    'inconclusive'
    """
    if (verdict.decision != "inconclusive" or not enough_evidence(own) or not measured
            or not predicted or measured >= (1.0 - margin) * predicted):
        return verdict
    change = measured / predicted - 1.0
    return Verdict("rollback", f"measured goodput {measured:.1f} tokens/s is {-change:.1%} below "
                   f"the model's {predicted:.1f} at the batch sizes served, where the previous "
                   f"policy has no steps to compare (threshold {margin:.0%})",
                   measured, None, change, margin, verdict.matched_steps, verdict.per_batch)


def unmatched(own: Sequence[StepStats], previous_own: Sequence[StepStats]) -> list[StepStats]:
    """The steps of `own` at batch sizes where `previous_own` has fewer than MIN_PER_BATCH
    steps: where only the model's prediction can judge the candidate (`against_prediction`).
    Where the previous policy was measured, `against_replaced` compares with its steps: a
    prediction made for the search's traffic is no baseline once the traffic has moved on:
    a policy chosen for a copy-heavy drain and measured on the prose that follows falls far
    below its prediction while matching the previous policy's steps at the same batch sizes.

    >>> from engine.types import StepStats
    >>> def s(b): return StepStats(batch_size=b, decode_tokens=b, step_ms=9.0)
    >>> [r.batch_size for r in unmatched([s(1), s(2), s(2)], [s(1)] * 3 + [s(2)] * 2)]
    [2, 2]
    """
    measured = _measured_sizes(previous_own)
    return [r for r in own if r.batch_size not in measured]


def _measured_sizes(steps: Sequence[StepStats]) -> dict[int, list[StepStats]]:
    """Batch size -> `steps` there, for the sizes with at least MIN_PER_BATCH of them: where a
    policy's own steps are evidence enough to compare with."""
    return {b: rows for b, rows in _rows_by_batch(steps).items() if len(rows) >= MIN_PER_BATCH}


def against_replaced(verdict: Verdict, own: Sequence[StepStats],
                     replaced: dict[int, tuple[float, float]], batch_weights: dict[int, float],
                     policy: TunedPolicy, previous: TunedPolicy, margin: float = 0.05,
                     z: float = 2.0, previous_own: Sequence[StepStats] = ()) -> Verdict:
    """An inconclusive `verdict` decided against the `previous` policy's figures at the batch
    sizes the candidate's `own` steps served: its measured (tokens per step, step ms) where
    `previous_own` (its own steps of the baseline window) has MIN_PER_BATCH steps at that
    size, else the model's prediction (`replaced`, per batch size). So a window that matched
    too few steps for `compare` (a drain moving through batch sizes one step each) pools the
    matched evidence with the prediction for the rest instead of ending inconclusive.
    Rollback when the candidate measured below that by more than max(margin, z standard
    errors of the per-step goodputs compared), else keep. Where both policies choose the
    same at every batch size served there is nothing to compare: keep. Too few steps
    (`enough_evidence`) stay inconclusive.

    >>> from engine.policy import BatchRule
    >>> from engine.types import StepStats
    >>> def s(ms, v=2): return StepStats(batch_size=1, decode_tokens=1, step_ms=ms, policy_version=v)
    >>> own = [s(20.0 + i % 2) for i in range(30)]  # ~49 tokens/s at batch 1
    >>> old, new = TunedPolicy(version=1), TunedPolicy((BatchRule(4, "ngram", 2),), 4, version=2)
    >>> v = Verdict("inconclusive", "no matched steps")
    >>> against_replaced(v, own, {1: (1.0, 10.0)}, {1: 1.0}, new, old).decision  # 100 predicted
    'rollback'
    >>> against_replaced(v, own, {1: (1.0, 20.0)}, {1: 1.0}, new, old).decision  # 50 predicted
    'keep'
    >>> measured = against_replaced(v, own, {1: (1.0, 10.0)}, {1: 1.0}, new, old,
    ...                             previous_own=[s(22.0, 1)] * 5)  # measured: 45 tokens/s
    >>> measured.decision, measured.baseline
    ('keep', 'measured')
    """
    rows = [r for r in own if r.batch_size in replaced]
    if verdict.decision != "inconclusive" or not enough_evidence(rows):
        return verdict
    served = sorted({r.batch_size for r in rows})
    if chooses_same(policy, previous, served):
        return dataclasses.replace(verdict, decision="keep", reason=(
            f"the replaced policy v{previous.version} chooses the same at the batch sizes "
            f"served ({_sizes(served)}); nothing to compare"))
    before = {b: steps for b, steps in _measured_sizes(previous_own).items() if b in served}
    figures = {**{b: replaced[b] for b in served}, **_figures(before)}
    measured = measured_goodput(rows, batch_weights)
    baseline = weighted_rate(figures, batch_weights)
    if not measured or not baseline:
        return verdict
    per = _by_batch(rows)
    w = {b: len(per[b]) / len(rows) for b in served}
    mean = sum(w[b] * _mean(per[b]) for b in served)
    spread = sum(w[b] ** 2 * (_sem2(per[b]) + (_sem2([r.goodput for r in before[b]])
                                                if b in before else 0.0)) for b in served)
    noise = z * math.sqrt(spread) / mean if mean else 0.0
    threshold, change = max(margin, noise), measured / baseline - 1.0
    kind = "measured" if len(before) == len(served) else "pooled" if before else "predicted"
    what = {"measured": f"v{previous.version}'s measured figures",
            "predicted": f"the model's figures for the replaced policy v{previous.version}",
            "pooled": (f"v{previous.version}'s measured figures at {_sizes(sorted(before))} "
                       "and the model's for it elsewhere")}[kind]
    where = f"at batch sizes {_sizes(served)} (threshold {threshold:.1%})"
    if change < -threshold:
        decision, reason = "rollback", (
            f"measured goodput {measured:.1f} tokens/s is {-change:.1%} below the "
            f"{baseline:.1f} of {what} {where}")
    else:
        decision, reason = "keep", (
            f"measured goodput {measured:.1f} tokens/s vs the {baseline:.1f} of {what} "
            f"({change:+.1%}) {where}")
    return Verdict(decision, reason, measured, baseline, change, threshold,
                   verdict.matched_steps, verdict.per_batch, baseline=kind)


MAX_FIGURE_BATCH = 256
"""Largest batch size `decode_figures` predicts (an engine with no batch cap: tests)."""


def decode_figures(policy: TunedPolicy, score: Callable[[TunedPolicy, Traffic], Any],
                   traffic: Traffic, sizes: range) -> dict[int, tuple[float, float]]:
    """`policy`'s predicted (tokens per step, step ms) of a decode step without prefill at
    every batch size of `sizes`: the window's own tenant mix and sampling at the sizes it
    observed, `Traffic.probe`'s elsewhere. Validation measures the new policy's decode steps
    only (`own_steps`), at whatever batch sizes the load brings during its window,
    often ones the search's traffic never showed (a busy phase draining).

    >>> from tuner.model import PerfModel
    >>> from tuner.objective import Capacity, evaluate
    >>> m = PerfModel(target=(10.0, 1.0, 0.0, 0.0, 1.0))
    >>> t = Traffic(10, {4: 1.0}, {4: 500.0}, 4.0, 4)
    >>> score = lambda p, on: evaluate(p, m, on, Capacity(999, 16))
    >>> fig = decode_figures(TunedPolicy(), score, t, range(1, 9))
    >>> sorted(fig) == list(range(1, 9)), fig[4], fig[8]  # no 500 ms of prefill at batch 4
    (True, (4.0, 14.0), (8.0, 18.0))
    """
    out = dict(score(policy, dataclasses.replace(traffic, prefill_per_step={})).per_batch)
    for batch in sizes:
        if batch not in out:
            out.update(score(policy, traffic.probe(batch)).per_batch)
    return out


def chooses_same(policy: TunedPolicy, other: TunedPolicy, batches: Sequence[int],
                 tenants: Collection[str] | None = None) -> bool:
    """Whether the two policies draft alike (batch rule and the tenant rules of `tenants`,
    None: every tenant) at each size.

    >>> from engine.policy import BatchRule, TenantRule
    >>> table = TunedPolicy((BatchRule(4, "ngram", 4), BatchRule(64)), 4)
    >>> chooses_same(table, TunedPolicy(), [8, 29]), chooses_same(table, TunedPolicy(), [3, 29])
    (True, False)
    >>> chat = dataclasses.replace(table, tenants=(TenantRule("chat", max_batch=4),))
    >>> chooses_same(table, chat, [2]), chooses_same(table, chat, [2], tenants=["copy"])
    (False, True)
    """
    return all(_choices(policy, b, tenants) == _choices(other, b, tenants) for b in batches)


def _choices(policy: TunedPolicy, batch: int, tenants: Collection[str] | None = None) -> tuple:
    """What `policy` drafts with at `batch`: the batch rule's choice and each tenant rule's
    (of `tenants` only, unless None)."""
    ruled = tuple(sorted((t.tenant, *policy.choose_row(batch, t.tenant)) for t in policy.tenants
                         if policy.tenant_rule(batch, t.tenant) and (tenants is None or t.tenant in tenants)))
    return policy.choose(batch), ruled


def _sizes(batches: Sequence[int]) -> str:
    return ", ".join(str(b) for b in batches)


def measured_goodput(rows: Sequence[StepStats], batch_weights: dict[int, float]) -> float | None:
    """Tokens/s of `rows` in the predicted figure's form, over the batch sizes present:
    1000 * sum_B w_B mean_tokens_B / sum_B w_B mean_ms_B (validation weighs each batch size
    by the candidate's own steps there: its tokens over its time)."""
    return weighted_rate(_figures(_rows_by_batch(rows)), batch_weights)


def _figures(by_batch: dict[int, list[StepStats]]) -> dict[int, tuple[float, float]]:
    """Batch size -> (mean tokens per step, mean step ms) of its steps."""
    return {b: (_mean([r.decode_tokens for r in steps]), _mean([r.step_ms for r in steps]))
            for b, steps in by_batch.items()}


def weighted_rate(per_batch: dict[int, tuple[float, float]],
                  batch_weights: dict[int, float]) -> float | None:
    """1000 * sum_B w_B tokens_B / sum_B w_B ms_B over the batch sizes in `per_batch`
    (weight 1 for a size the traffic never showed).

    >>> weighted_rate({1: (1.0, 10.0), 4: (4.0, 20.0)}, {1: 0.5, 4: 0.5, 8: 9.0})
    166.66666666666666
    """
    if not per_batch:
        return None
    w = {b: batch_weights.get(b, 1.0) for b in per_batch}
    time_ms = sum(w[b] * per_batch[b][1] for b in per_batch)
    return 1000.0 * sum(w[b] * per_batch[b][0] for b in per_batch) / time_ms if time_ms else None


def _rows_by_batch(rows: Sequence[StepStats]) -> dict[int, list[StepStats]]:
    out: dict[int, list[StepStats]] = {}
    for r in rows:
        out.setdefault(r.batch_size, []).append(r)
    return out


def _by_batch(rows: Sequence[StepStats]) -> dict[int, list[float]]:
    """Batch size -> the per-step goodputs of its steps."""
    return {b: [r.goodput for r in steps] for b, steps in _rows_by_batch(rows).items()}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _sem2(xs: list[float]) -> float:
    """Squared standard error of the mean."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)
