"""The acceptance side of the performance model, fitted from recorded steps and requests.

Acceptance is a conditional rate per technique and draft position (deeper
positions than any step measured have rate 0), counted so that steps of
different depths mix correctly: a step of depth d with n speculating
sequences (proposed / d) offers position 0 to n sequences and position
i > 0 to those that accepted position i - 1 (accepted_per_pos[i-1]). MTP
steps are keyed by their policy's draft vocabulary ("mtp@8192") when one was
set; the plain technique key pools every vocabulary.

Small samples. A rate is a beta posterior mean, (accepted + m * prior) /
(offered + m) with m = PRIOR_OFFERS pseudo-offers, never the raw ratio: 3
drafts offered and 3 accepted say little, and a raw 3/3 would make the
search speculate deep on them. The prior is the next pool up at the same
position: a tenant's rates ("ngram|copy") shrink toward the technique's
("ngram"), one MTP draft vocabulary's ("mtp@8192") toward every
vocabulary's ("mtp"), and a technique's toward every technique's at that
position (NEUTRAL_RATE where nothing was offered there; a position past
every pool's reuses the key's previous rate). With many offers the
estimate converges to the observed rate. Tenant factors from requests
shrink the same way toward the overall rate.

Tenants. A step's rows count under their tenant ("ngram|copy") too: every
row class of a step that records them (tuner.rows; rows of several tenants,
techniques and depths share a step under per-tenant rules), else the whole
step when its batch held one tenant. A tenant with enough such offers (MIN_REACHED at position 0)
gets its own rates for the technique, since acceptance depends on the
technique and the text together (n-gram lookups pay on copy-heavy tenants,
not on prose). Otherwise a per-tenant factor (the tenant's
accepted/proposed over everyone's, from requests) scales the odds of the
pooled rates, so a rate stays below 1 and the tenant mix the rates were
measured on averages back to about them. Once any tenant is measured, a
tenant with no finished requests yet gets factor 0 (no credit until its
own requests show some) rather than the rates of the tenants that were
measured, which may be far easier to draft for. A technique never measured
has rate 0, so the search cannot prefer what nobody has seen.

Draft share. Not every sequence drafts: an n-gram lookup finds nothing in
most prose, and a row without a draft verifies nothing and emits one token.
The draft share (equivalent full drafts, proposed / depth, over the decode
rows of steps without prefill) is fitted per technique key and single-tenant
key like the rates, and scales the drafted tokens: 1 + share * the sum of
the reach probabilities. Rates measured only on the rows that drafted would
otherwise be applied to every row.

Depth factors. Rates counted per step do not carry across depths: a deep
draft eats an easy (copyable) stretch in few steps, so a larger share of
its steps fall where drafts fail, and its position-0 rate and draft share
come out lower than a shallow draft's on the same text. Rates pooled over
the window's depths would then favour whichever depth ran on the easiest
stretch. So each technique key gets a depth factor per measured depth: the
drafted tokens its steps accepted over those the pooled rates and share
predict for the same steps (at least MIN_REACHED drafting sequences),
shrunk toward 1 like the rates: a weighted mean of the measured ratio and 1
with DEPTH_PRIOR_SEQUENCES pseudo-sequences at 1. One sequence's accepted
drafts vary about as much as their mean, so n sequences measure the ratio
to about 1/sqrt(n); factors spread about 0.15 around 1, so 1/0.15^2 ~ 50
sequences of evidence weigh as much as the prior. Unshrunk, the one step
exploration ran at a depth would set its factor alone, and a low reading
would keep the search off that depth until exploration happened to visit it
again. A depth not measured takes the nearest
measured depth's factor (the deeper one on a tie); tuner.model caps the
accepted draft at the depth.

Delivered drafts. The counts are the engine's (StepStats.accepted): a draft
that verification accepted but a stop, max_tokens or the context cut off
counts as rejected. So a rate is the chance a draft reaches the request, the
cost of drafting past requests' ends included, and the tokens per step the
model predicts are the goodput the steps record (decode_tokens): on short
outputs a deep draft's last positions earn less, as they deliver less.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.types import StepStats
from tuner.data import RequestRow
from tuner.rows import Drafts, units

MIN_REACHED = 10
"""Evidence before a tenant gets its own rates (offers at position 0), draft share (rows) or
factor (drafts in requests), and before a depth gets a factor (drafting sequences)."""
PRIOR_OFFERS = 5.0
"""Strength of the beta prior, in offers: a rate measured on that many is half prior, half data."""
NEUTRAL_RATE = 0.5
"""The prior where no pool has seen the position (only while nothing at all was measured)."""
MAX_RATE = 0.99
TENANT_FACTOR_RANGE = (0.25, 2.0)
DEPTH_FACTOR_RANGE = (0.25, 4.0)
DEPTH_PRIOR_SEQUENCES = 50.0
"""Strength of a depth factor's prior (1), in drafting sequences (module doc, Depth factors)."""


def scale_odds(rate: float, factor: float) -> float:
    """`rate` with its odds multiplied by `factor` (stays in [0, 1]).

    >>> round(scale_odds(0.8, 2.0), 4), scale_odds(0.5, 1.0)
    (0.8889, 0.5)
    """
    if rate <= 0.0 or rate >= 1.0:
        return rate
    return rate * factor / (1.0 - rate + rate * factor)


def technique_key(technique: str, version: int, vocab_of: Mapping[int, int]) -> str:
    """"mtp@V" for MTP steps of a policy with draft vocabulary V, else the technique.

    >>> technique_key("mtp", 3, {3: 8192}), technique_key("ngram", 3, {3: 8192})
    ('mtp@8192', 'ngram')
    """
    vocab = vocab_of.get(version, 0) if technique == "mtp" else 0
    return f"mtp@{vocab}" if vocab else technique


def step_keys(s: StepStats, vocab_of: Mapping[int, int], per_tenant: bool = False) -> set[str]:
    """The keys a step counts under: its technique (pooling every MTP vocabulary) and its
    technique_key, and with `per_tenant` those with "|tenant" when its batch held one tenant."""
    keys = {s.technique, technique_key(s.technique, s.policy_version, vocab_of)}
    if per_tenant and len(s.tenants) == 1:
        keys |= {f"{k}|{s.tenants[0]}" for k in keys}
    return keys


def unit_keys(u: Drafts, version: int, vocab_of: Mapping[int, int],
              per_tenant: bool = False) -> set[str]:
    """step_keys of one unit of a step (tuner.rows): with `per_tenant`, also under its tenant."""
    keys = {u.technique, technique_key(u.technique, version, vocab_of)}
    if per_tenant and u.tenant is not None:
        keys |= {f"{k}|{u.tenant}" for k in keys}
    return keys


def to_depth(rates: Sequence[float], depth: int) -> list[float]:
    """`rates` at positions 0..depth-1, the last one repeating (none measured: 0).

    >>> to_depth((0.8, 0.5), 3), to_depth((), 2)
    ([0.8, 0.5, 0.5], [0.0, 0.0])
    """
    return [rates[min(i, len(rates) - 1)] if rates else 0.0 for i in range(depth)]


def drafted(rates: Sequence[float]) -> float:
    """Expected accepted drafts of one drafting sequence: sum_i prod_{j<=i} rates_j.

    >>> drafted([0.5, 0.5])
    0.75
    """
    reach, total = 1.0, 0.0
    for rate in rates:
        reach *= rate
        total += reach
    return total


def _drafting_decode(u: Drafts) -> bool:
    """Rows assigned a technique, of a step without prefill: a step with prefill counts its
    prefilling sequences in batch_size, which never draft."""
    return bool(u.depth) and u.technique != "none" and u.decode_only and u.rows > 0


def fit_acceptance(steps: Sequence[StepStats], vocab_of: Mapping[int, int]) -> dict[str, tuple]:
    """Technique key (and technique|tenant key) -> conditional rate per draft position."""
    reached: dict[str, list[float]] = {}
    accepted: dict[str, list[float]] = {}
    for s in steps:
        for u in units(s):
            if not u.drafts:
                continue
            per_pos = u.accepted_per_pos
            for key in unit_keys(u, s.policy_version, vocab_of, per_tenant=True):
                r, a = reached.setdefault(key, []), accepted.setdefault(key, [])
                while len(r) < u.depth:
                    r.append(0.0), a.append(0.0)
                for i in range(u.depth):
                    r[i] += u.speculating if i == 0 else (per_pos[i - 1] if i - 1 < len(per_pos) else 0)
                    a[i] += per_pos[i] if i < len(per_pos) else 0
    out = _shrunk(reached, accepted)
    # a trailing 0: positions deeper than any step measured earn nothing (rates are repeated
    # past their last entry, and the last measured rate says nothing about deeper positions)
    return {key: rates + (0.0,) for key, rates in out.items()  # a tenant's own rates need evidence
            if "|" not in key or reached[key][0] >= MIN_REACHED}


def prior_key(key: str) -> str | None:
    """The pool a key's rates shrink toward (None: every technique's).

    >>> prior_key("ngram|copy"), prior_key("mtp@8192|copy"), prior_key("mtp@8192"), prior_key("ngram")
    ('ngram', 'mtp@8192', 'mtp', None)
    """
    if "|" in key:
        return key.split("|", 1)[0]
    if "@" in key:
        return key.split("@", 1)[0]
    return None


def _shrunk(reached: Mapping[str, list[float]],
            accepted: Mapping[str, list[float]]) -> dict[str, tuple[float, ...]]:
    """Every key's rates, each shrunk toward its prior_key's (the plain keys toward all
    techniques pooled): parents first, so a prior is itself already shrunk."""
    plain = [k for k in reached if prior_key(k) is None]
    pooled_r: list[float] = []
    pooled_a: list[float] = []
    for key in plain:
        for i, (r, a) in enumerate(zip(reached[key], accepted[key])):
            if i == len(pooled_r):
                pooled_r.append(0.0), pooled_a.append(0.0)
            pooled_r[i] += r
            pooled_a[i] += a
    everyone = _rates(pooled_r, pooled_a)
    out: dict[str, tuple[float, ...]] = {}
    for key in sorted(reached, key=lambda k: ("@" in k) + 2 * ("|" in k)):  # parents first
        parent = prior_key(key)
        prior = everyone if parent is None else out.get(parent, everyone)
        out[key] = _rates(reached[key], accepted[key], prior)
    return out


def fit_draft_share(steps: Sequence[StepStats], vocab_of: Mapping[int, int]) -> dict[str, float]:
    """Technique key (and technique|tenant key) -> share of decode rows that draft."""
    rows: dict[str, float] = {}
    drafting: dict[str, float] = {}
    for s in steps:
        for u in units(s):
            if not _drafting_decode(u):
                continue
            for key in unit_keys(u, s.policy_version, vocab_of, per_tenant=True):
                rows[key] = rows.get(key, 0.0) + u.rows
                drafting[key] = drafting.get(key, 0.0) + u.speculating
    return {key: min(1.0, drafting[key] / n) for key, n in rows.items()
            if n >= MIN_REACHED or "|" not in key}


def fit_depth_factors(steps: Sequence[StepStats], vocab_of: Mapping[int, int],
                      acceptance: Mapping[str, tuple[float, ...]],
                      draft_share: Mapping[str, float]) -> dict[str, dict[int, float]]:
    """Technique key -> depth -> accepted drafted tokens of its decode steps over what the
    pooled rates and share predict for them, shrunk toward 1 (module doc); depths with fewer
    than MIN_REACHED drafting sequences are left out. A row class (tuner.rows) is predicted
    from its tenant's own rates and share where the tenant has them, as the model applies
    the factor on top of those: under per-tenant rules the deep drafts go to the easiest
    tenants, and pooled rates would read that as a depth effect."""
    sums: dict[tuple[str, int], list[float]] = {}  # measured, predicted, drafting sequences
    for s in steps:
        for u in units(s):
            if not _drafting_decode(u):
                continue
            for key in unit_keys(u, s.policy_version, vocab_of):
                own = f"{key}|{u.tenant}" if u.classed and f"{key}|{u.tenant}" in acceptance else key
                rates = acceptance.get(own, ())
                acc = sums.setdefault((key, u.depth), [0.0, 0.0, 0.0])
                acc[0] += sum(u.accepted_per_pos)
                acc[1] += u.rows * draft_share.get(own, draft_share.get(key, 1.0)) * drafted(
                    to_depth(rates, u.depth)) if rates else 0.0
                acc[2] += u.speculating
    out: dict[str, dict[int, float]] = {}
    for (key, depth), (measured, predicted, drafting) in sums.items():
        if drafting < MIN_REACHED or not acceptance.get(key):
            continue
        if predicted > 0:
            lo, hi = DEPTH_FACTOR_RANGE
            ratio = shrunk(drafting * measured / predicted, drafting, 1.0, DEPTH_PRIOR_SEQUENCES)
            out.setdefault(key, {})[depth] = min(hi, max(lo, ratio))
    return out


def shrunk(accepted: float, offered: float, prior: float, m: float = PRIOR_OFFERS) -> float:
    """The beta posterior mean (a + m p) / (n + m) of `accepted` of `offered` with m
    pseudo-offers (PRIOR_OFFERS unless given) at the prior rate p.

    >>> shrunk(3, 3, 0.5), shrunk(0, 0, 0.4)
    (0.6875, 0.4)
    """
    return (accepted + m * prior) / (offered + m)


def _rates(reached: Sequence[float], accepted: Sequence[float],
           prior: Sequence[float] = ()) -> tuple[float, ...]:
    """Conditional rates, each the beta posterior mean (a + m p) / (r + m) with m =
    PRIOR_OFFERS and p the prior's rate at that position (past the prior: the previous rate
    here, at position 0 NEUTRAL_RATE).

    >>> _rates([3], [3], [0.5])  # 3 of 3: not 100 %
    (0.6875,)
    >>> [round(x, 3) for x in _rates([1000, 0], [900, 0], [0.5])]  # many offers: the data
    [0.898, 0.898]
    """
    out: list[float] = []
    for i, (r, a) in enumerate(zip(reached, accepted)):
        p = prior[i] if i < len(prior) else out[-1] if out else NEUTRAL_RATE
        out.append(min(MAX_RATE, shrunk(a, r, p)))
    return tuple(out)


def tenant_factors(requests: Sequence[RequestRow]) -> dict[str, float]:
    """Tenant -> its accepted/proposed over everyone's (tenants with MIN_REACHED drafts), the
    tenant's rate shrunk toward everyone's by PRIOR_OFFERS drafts (module doc)."""
    proposed = sum(r.proposed_tokens for r in requests)
    if not proposed:
        return {}
    overall = sum(r.accepted_tokens for r in requests) / proposed
    totals: dict[str, list[int]] = {}
    for r in requests:
        t = totals.setdefault(r.tenant, [0, 0])
        t[0] += r.proposed_tokens
        t[1] += r.accepted_tokens
    lo, hi = TENANT_FACTOR_RANGE
    return {tenant: min(hi, max(lo, shrunk(a, p, overall) / overall))
            if overall > 0 else 1.0 for tenant, (p, a) in totals.items() if p >= MIN_REACHED}


def step_coverage(steps: Sequence[StepStats]) -> dict[str, dict[int, int]]:
    """Technique -> depth -> steps measured."""
    out: dict[str, dict[int, int]] = {}
    for s in steps:
        per = out.setdefault(s.technique, {})
        per[s.depth] = per.get(s.depth, 0) + 1
    return out


MIN_WINDOW_STEPS = 20
"""Drafting steps of a technique a fit window needs for its per-tenant acceptance to stand on
the window alone (`remembered`)."""


def _root(key: str) -> str:
    return key.split("|", 1)[0].split("@", 1)[0]


def remembered(recent: Sequence[StepStats], older: Sequence[StepStats],
               vocab_of: Mapping[int, int], acceptance: dict[str, tuple],
               draft_share: dict[str, float],
               depth_factor: dict[str, dict[int, float]]) -> tuple[dict, dict, dict]:
    """`acceptance`, `draft_share` and `depth_factor` (fitted on the window's `recent` steps)
    with the per-tenant entries ("ngram|copy") of each technique the window drafted with on
    fewer than MIN_WINDOW_STEPS steps, fitted on that technique's `older` steps and its
    recent ones, where the window has none of its own; and those techniques' depth factors
    where the window has none.

    Acceptance follows the technique and the tenant's text, not the load, but a window only
    holds what its policy ran: after a busy stretch served plainly it holds only the few
    n-gram steps exploration ran, so when the batch drains to a copy tenant's long requests
    the search would know no n-gram rates and keep decoding plainly where n-gram pays.
    Only tenants measured before get remembered rates; the others keep the window's (a technique's pooled rate
    stays the window's, so a tenant never measured is not credited with the copy tenant's).

    >>> from engine.types import StepStats
    >>> def s(t, d, acc): return StepStats(batch_size=1, decode_tokens=1 + acc, technique=t,
    ...     depth=d, proposed=d, accepted=acc, accepted_per_pos=tuple(int(i < acc) for i in range(d)),
    ...     step_ms=10.0, tenants=("copy",))
    >>> old = [s("ngram", 4, 3)] * 30
    >>> acc, share, depth = remembered([s("none", 0, 0)] * 50, old, {}, {}, {}, {})
    >>> sorted(acc), round(acc["ngram|copy"][0], 2), share["ngram|copy"], sorted(depth)
    (['ngram|copy'], 0.99, 1.0, ['ngram'])
    >>> remembered([s("ngram", 4, 1)] * 20, old, {}, {"ngram": (0.5,)}, {}, {})[0]  # enough of its own
    {'ngram': (0.5,)}
    """
    drafting: dict[str, int] = {}
    for s in recent:
        if s.technique != "none" and s.proposed > 0:
            drafting[s.technique] = drafting.get(s.technique, 0) + 1
    sparse = {s.technique for s in older if s.technique != "none" and s.proposed > 0
              and drafting.get(s.technique, 0) < MIN_WINDOW_STEPS}
    if not sparse:
        return acceptance, draft_share, depth_factor
    steps = [s for s in (*older, *recent) if s.technique in sparse]
    old_rates, old_share = fit_acceptance(steps, vocab_of), fit_draft_share(steps, vocab_of)
    old_depth = fit_depth_factors(steps, vocab_of, old_rates, old_share)
    acceptance, draft_share = dict(acceptance), dict(draft_share)
    for key, rates in old_rates.items():
        if "|" in key and _root(key) in sparse and key not in acceptance:
            acceptance[key] = rates
    for key, share in old_share.items():
        if "|" in key and _root(key) in sparse and key not in draft_share:
            draft_share[key] = share
    depth_factor = {**{k: v for k, v in old_depth.items() if _root(k) in sparse}, **depth_factor}
    return acceptance, draft_share, depth_factor
