"""The performance model: step time and acceptance, fitted from recorded steps.

Step time splits into the target model's forward and the proposer's work:

    step_ms = target(B, q, P) + propose(technique, B, depth)
    target  = t0 + t1*B + t3*B*q + t4*P               (q = 1 + depth, P = prefill tokens)
    propose = p0 + p1*B + p2*B*depth                  (one fit per technique; 0 for "none")

B*q is the rows the forward runs (every row passes the layers and the
262k-row output layer), B the sequences whose cache it reads. The fit has no
q-only term (t2 is kept in the tuple for a caller's own model, fitted as 0):
with one, a startup profile at batch 1-2 explained the cost of deeper
verifies by q alone, and the model carried that to batch 32 as almost free
(n-gram@8 there predicted ~2x faster than the 2.2 s it took). Per row, the
forward costs about the same at batch 1 (a 9-row verify) as at batch 32
(7.5-11 ms here), so the rows term carries across batch sizes.

B and q are the shape the step ran at: the engine pads a batch to its next
compiled batch size and a verify to its next compiled query length (the
`Padding` the search passes in), so batch 17 costs what batch 32 does.
Fitted on the unpadded sizes, the busy phase's steps at batch 9-24 were
predicted 30% faster than measured.

The target part is shared by all techniques (verification is the same
forward whatever drafted it), fitted on step_ms - propose_ms by least squares
weighted by 1/step_ms (so it minimizes relative error). Each proposer's part
is fitted on its propose_ms. Every coefficient is a cost, so both fits are
non-negative least squares: a busy minute of few, slow steps (26 steps at
batch 4-32) once gave an unconstrained fit of t0 = 418, t1 = -44, t2 = -57,
whose extrapolation to a deep draft predicted 1247 tokens/s where 66 came.

Acceptance is a conditional rate per technique and draft position (deeper
positions than any step measured have rate 0), counted
so that steps of different depths mix correctly: a step of depth d with n
speculating sequences (proposed / d) offers position 0 to n sequences and
position i > 0 to those that accepted position i - 1 (accepted_per_pos[i-1]).
MTP steps are keyed by their policy's draft vocabulary ("mtp@8192") when one
was set. Steps whose batch held one tenant also count under that tenant
("ngram|copy"): a tenant with enough such offers (MIN_REACHED at position
0) gets its own rates for the technique, since acceptance depends on the
technique and the text together (n-gram lookups pay on copy-heavy tenants,
not on prose). Otherwise a per-tenant factor (the tenant's accepted/proposed
over everyone's, from requests) scales the odds of the pooled rates (so a
rate stays below 1 and the tenant mix the rates were measured on averages
back to about them); once any tenant is measured, a tenant with no finished
requests yet gets factor 0 (no credit until its own requests show some), not
the pooled rates of the tenants that were measured. A technique never measured has rate 0, so the search
cannot prefer what nobody has seen.

Not every sequence drafts: an n-gram lookup finds nothing in most prose, and
a row without a draft verifies nothing and emits one token. The draft share
(equivalent full drafts, proposed / depth, over the decode rows of steps
without prefill) is fitted per technique key and single-tenant key like the
rates, and scales the drafted tokens: 1 + share * sum of the reach
probabilities. Without it, rates measured on the rows that drafted were
applied to every row, and deep n-gram at batch 32 on mixed traffic was
predicted ~1.5x what it measured.

Rates counted per step do not carry across depths: a deep draft eats an
easy (copyable) stretch in few steps, so a larger share of its steps fall
where drafts fail. In one copy phase, position 0 was accepted 0.80 / 0.68 /
0.59 of the time at n-gram@2 / @4 / @8 on mixed batches, and the draft share
fell from 0.91 to 0.82; rates pooled over the window's depths (mostly the
profile's @8 and the default @4, early and copy-rich) predicted @8 best at
batch 2, where it measured 15% below @2. So each technique key gets a depth
factor per measured depth: the drafted tokens its steps accepted over those
the pooled rates and share predict for the same steps (at least MIN_REACHED
drafting sequences). A depth not measured takes the nearest measured depth's
factor (the deeper one on a tie), and the accepted draft never exceeds the
depth.

    >>> m = PerfModel(target=(1, 0, 0, 0, 0), acceptance={"ngram": (0.5, 0.5)})
    >>> m.expected_tokens_per_seq("ngram", 2)   # 1 + 0.5 + 0.25
    1.75
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from tuner.data import RequestRow, StepRow

MIN_FIT_ROWS = 8
MIN_REACHED = 10
"""Offers needed before a position's rate is trusted; rarer positions reuse the previous rate."""
MAX_RATE = 0.99
TENANT_FACTOR_RANGE = (0.25, 2.0)
DEPTH_FACTOR_RANGE = (0.25, 4.0)


class NotEnoughTelemetry(ValueError):
    """Too few steps to fit the model."""


@dataclass(frozen=True)
class Padding:
    """The compiled shapes steps run padded to (empty: the step's own sizes).

    >>> Padding(batch=(1, 2, 4, 8), query=(1, 2, 3, 5)).pad(3, 4)
    (4, 5)
    """

    batch: tuple[int, ...] = ()
    """Compiled batch sizes, ascending."""
    query: tuple[int, ...] = ()
    """Compiled query lengths (1 + depth), ascending."""

    def pad(self, batch: float, q: int) -> tuple[float, int]:
        return _next(batch, self.batch), int(_next(q, self.query))


def _next(n: float, sizes: tuple[int, ...]) -> float:
    """The smallest of `sizes` >= n (n itself beyond the largest)."""
    return next((s for s in sizes if s >= n), n)


@dataclass(frozen=True)
class ErrorReport:
    """Prediction error on measured steps (absolute percentage errors)."""

    rows: int
    step_ms_median_ape: float
    step_ms_mape: float
    step_ms_p90_ape: float
    goodput_median_ape: float
    goodput_mape: float

    def to_dict(self) -> dict[str, float]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class PerfModel:
    """Fitted coefficients; see the module docstring."""

    target: tuple[float, ...]
    """(t0, t1, t2, t3, t4) of the shared target forward."""
    propose: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    """Technique key -> (p0, p1, p2)."""
    acceptance: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Technique key -> conditional acceptance per draft position."""
    tenant_factor: Mapping[str, float] = field(default_factory=dict)
    """Tenant -> factor on every acceptance rate (1 when unknown)."""
    coverage: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    """Technique -> depth -> steps measured."""
    draft_share: Mapping[str, float] = field(default_factory=dict)
    """Technique key -> share of decode rows that draft (1 when unknown)."""
    depth_factor: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    """Technique key -> measured depth -> factor on the drafted tokens (see the module doc)."""
    floor_ms: float = 0.01
    """Predictions never go below this (a quarter of the fastest step seen)."""
    padding: Padding = Padding()
    """The shapes steps run padded to; step time is a function of those."""

    # -- fitting ------------------------------------------------------------
    @staticmethod
    def fit(steps: Sequence[StepRow], requests: Sequence[RequestRow] = (),
            vocab_of: Mapping[int, int] | None = None, buckets: Padding = Padding(),
            history: Sequence[StepRow] = ()) -> PerfModel:
        """Fit on `steps` (and per-tenant acceptance on `requests`), steps padded by `buckets`;
        `history` (older steps, see cost_history) joins the step-time fits only."""
        if len(steps) < MIN_FIT_ROWS:
            raise NotEnoughTelemetry(f"{len(steps)} steps; the model needs at least {MIN_FIT_ROWS}")
        vocab_of = vocab_of or {}
        timed = [*history, *steps]
        acceptance = _fit_acceptance(steps, vocab_of)
        draft_share = _fit_draft_share(steps, vocab_of)
        return PerfModel(
            target=_fit_target(timed, buckets),
            propose=_fit_propose(timed, vocab_of),
            acceptance=acceptance,
            tenant_factor=_tenant_factors(requests),
            coverage=_coverage(steps),
            draft_share=draft_share,
            depth_factor=_fit_depth_factors(steps, vocab_of, acceptance, draft_share),
            floor_ms=0.25 * min(s.step_ms for s in steps),
            padding=buckets,
        )

    @staticmethod
    def fit_with_report(steps: Sequence[StepRow], requests: Sequence[RequestRow] = (),
                        vocab_of: Mapping[int, int] | None = None, holdout_every: int = 5,
                        buckets: Padding = Padding(),
                        history: Sequence[StepRow] = ()) -> tuple[PerfModel, ErrorReport]:
        """Fit without every `holdout_every`-th step, report the error on those, refit on all."""
        held = [s for i, s in enumerate(steps) if i % holdout_every == holdout_every - 1]
        train = [s for i, s in enumerate(steps) if i % holdout_every != holdout_every - 1]
        report = PerfModel.fit(train, requests, vocab_of, buckets, history).error_report(
            held, vocab_of)
        return PerfModel.fit(steps, requests, vocab_of, buckets, history), report

    # -- predictions ----------------------------------------------------------
    def predict_step_ms(self, technique: str, depth: int, batch: float, prefill: float = 0.0,
                        draft_vocab: int = 0) -> float:
        """Predicted step time (ms) of a decode batch of `batch` at `depth`."""
        padded, q = self.padding.pad(batch, 1 + depth)
        t = self.target
        ms = t[0] + t[1] * padded + t[2] * q + t[3] * padded * q + t[4] * prefill
        if depth and technique != "none":  # proposers work on the real rows (fitted so)
            p = self._lookup(self.propose, technique, draft_vocab) or (0.0, 0.0, 0.0)
            ms += max(0.0, p[0] + p[1] * batch + p[2] * batch * depth)
        return max(ms, self.floor_ms)

    def prefill_ms(self, prefill: float) -> float:
        """The prefill part of a step's time: t4 per prefill token."""
        return self.target[4] * prefill

    def rates(self, technique: str, depth: int, tenant: str | None = None,
              draft_vocab: int = 0) -> list[float]:
        """Conditional acceptance at positions 0..depth-1 (the last measured rate repeats)."""
        own = self._lookup(self.acceptance, technique, draft_vocab, tenant) if tenant else None
        known = own or self._lookup(self.acceptance, technique, draft_vocab) or ()
        factor = 1.0 if own or tenant is None else self.factor_of(tenant)
        return [min(MAX_RATE, scale_odds(base, factor)) for base in _to_depth(known, depth)]

    def factor_of(self, tenant: str) -> float:
        """The tenant's factor on the pooled odds. Once any tenant is measured, one not yet
        measured gets 0: no credit from speculation until its own requests show some, as a
        technique never measured earns nothing. With 1, the first busy retune after a
        copy-heavy phase credited new chat and prose tenants with the copy tenant's rates
        and chose n-gram@8 at batch 32 (predicted 48 tokens/s, measured 23); with the lowest
        measured factor, a window whose only measured tenant was "copy" (factor 1) did the
        same at n-gram@4 (s8b: predicted 118, measured 76). With no tenant measured at all,
        the pooled rates are all there is about anyone: factor 1.

        >>> PerfModel(target=(1, 0, 0, 0, 0), tenant_factor={"copy": 1.0}).factor_of("chat")
        0.0
        >>> PerfModel(target=(1, 0, 0, 0, 0)).factor_of("chat")
        1.0
        """
        known = self.tenant_factor.get(tenant)
        if known is not None:
            return known
        return 0.0 if self.tenant_factor else 1.0

    def share(self, technique: str, tenant: str | None = None, draft_vocab: int = 0) -> float:
        """Share of decode rows that draft (the tenant's own when measured, else pooled, else 1)."""
        own = self._lookup(self.draft_share, technique, draft_vocab, tenant) if tenant else None
        pooled = self._lookup(self.draft_share, technique, draft_vocab)
        return float(own if own is not None else pooled if pooled is not None else 1.0)

    def expected_tokens_per_seq(self, technique: str, depth: int, tenant: str | None = None,
                                draft_vocab: int = 0) -> float:
        """1 + min(depth, factor * share * sum_i prod_{j<=i} alpha_j): tokens one sequence
        emits per step (factor: see factor_at)."""
        if technique == "none" or not depth:
            return 1.0
        drafted = (_drafted(self.rates(technique, depth, tenant, draft_vocab))
                   * self.share(technique, tenant, draft_vocab))
        return 1.0 + min(float(depth), drafted * self.factor_at(technique, depth, draft_vocab))

    def factor_at(self, technique: str, depth: int, draft_vocab: int = 0) -> float:
        """The depth factor on drafted tokens: the depth's own, else the nearest measured
        depth's (the deeper on a tie), else 1.

        >>> m = PerfModel(target=(1, 0, 0, 0, 0), depth_factor={"ngram": {2: 1.1, 8: 0.7}})
        >>> m.factor_at("ngram", 2), m.factor_at("ngram", 5), m.factor_at("ngram", 4), m.factor_at("mtp", 4)
        (1.1, 0.7, 1.1, 1.0)
        """
        per_depth = self._lookup(self.depth_factor, technique, draft_vocab)
        if not per_depth:
            return 1.0
        nearest = min(per_depth, key=lambda d: (abs(d - depth), -d))
        return float(per_depth[nearest])

    def tokens_per_seq_mix(self, technique: str, depth: int, mix: Mapping[str, float],
                           draft_vocab: int = 0) -> float:
        """Expected tokens per sequence per step for a tenant mix (weights sum to 1)."""
        if not mix:
            return self.expected_tokens_per_seq(technique, depth, None, draft_vocab)
        return sum(w * self.expected_tokens_per_seq(technique, depth, t, draft_vocab)
                   for t, w in mix.items())

    def error_report(self, steps: Sequence[StepRow],
                     vocab_of: Mapping[int, int] | None = None) -> ErrorReport:
        """Absolute percentage errors of step time and per-step goodput on `steps`."""
        vocab_of = vocab_of or {}
        ms_err, gp_err = [], []
        for s in steps:
            vocab = vocab_of.get(s.policy_version, 0)
            ms = self.predict_step_ms(s.technique, s.depth, s.batch_size, s.prefill_tokens, vocab)
            tokens = s.batch_size * self.expected_tokens_per_seq(s.technique, s.depth, None, vocab)
            ms_err.append(abs(ms - s.step_ms) / s.step_ms)
            if s.decode_tokens:
                gp_err.append(abs(tokens / ms - s.decode_tokens / s.step_ms)
                              / (s.decode_tokens / s.step_ms))
        if not ms_err:
            nan = float("nan")
            return ErrorReport(0, nan, nan, nan, nan, nan)
        ms_a, gp_a = np.asarray(ms_err), np.asarray(gp_err or [np.nan])
        return ErrorReport(len(ms_err), float(np.median(ms_a)), float(ms_a.mean()),
                           float(np.quantile(ms_a, 0.9)), float(np.median(gp_a)),
                           float(gp_a.mean()))

    @staticmethod
    def _lookup(table: Mapping[str, tuple], technique: str, draft_vocab: int,
                tenant: str | None = None) -> tuple | None:
        suffix = f"|{tenant}" if tenant else ""
        if technique == "mtp" and draft_vocab and f"mtp@{draft_vocab}{suffix}" in table:
            return table[f"mtp@{draft_vocab}{suffix}"]
        return table.get(technique + suffix)

    def summary(self) -> dict:
        """A JSON-able description (for retune details and /admin/tuner)."""
        return {"target": [round(c, 5) for c in self.target],
                "propose": {k: [round(c, 5) for c in v] for k, v in self.propose.items()},
                "acceptance": {k: [round(r, 4) for r in v] for k, v in self.acceptance.items()},
                "tenant_factor": {k: round(v, 4) for k, v in self.tenant_factor.items()},
                "draft_share": {k: round(v, 4) for k, v in self.draft_share.items()},
                "depth_factor": {k: {str(d): round(f, 4) for d, f in v.items()}
                                 for k, v in self.depth_factor.items()},
                "coverage": {k: {str(d): n for d, n in v.items()}
                             for k, v in self.coverage.items()}}


def scale_odds(rate: float, factor: float) -> float:
    """`rate` with its odds multiplied by `factor` (stays in [0, 1]).

    >>> round(scale_odds(0.8, 2.0), 4), scale_odds(0.5, 1.0)
    (0.8889, 0.5)
    """
    if rate <= 0.0 or rate >= 1.0:
        return rate
    return rate * factor / (1.0 - rate + rate * factor)


MIN_SHAPE_STEPS = 10
"""Steps of a (batch, query length) shape the fit window needs before older ones stay out."""


def cost_history(recent: Sequence[StepRow], older: Sequence[StepRow],
                 buckets: Padding = Padding()) -> list[StepRow]:
    """The newest `older` steps of each padded (batch, query length) shape that `recent` holds
    fewer than MIN_SHAPE_STEPS of, up to that many: what the step-time fit adds to the fit
    window. A busy minute holds only batch-32 steps of one or two depths; fitted alone it once
    found a constant 819 ms a step (no cost per row) and predicted n-gram@8 at batch 32 at
    104 tokens/s, where the copy phase before had measured every depth at batch 1-2.

    >>> def s(b, d): return StepRow(0.0, b, 0, b, "none", d, 0, (), 0.0, 10.0, 0, 0)
    >>> len(cost_history([s(32, 1)] * 12, [s(32, 1)] * 5 + [s(1, 8)] * 30))
    10
    """
    counts: dict[tuple, int] = {}
    for s in recent:
        shape = buckets.pad(s.batch_size, 1 + s.depth)
        counts[shape] = counts.get(shape, 0) + 1
    out = []
    for s in reversed(older):  # newest first
        shape = buckets.pad(s.batch_size, 1 + s.depth)
        if counts.get(shape, 0) < MIN_SHAPE_STEPS:
            counts[shape] = counts.get(shape, 0) + 1
            out.append(s)
    out.reverse()
    return out


def technique_key(technique: str, version: int, vocab_of: Mapping[int, int]) -> str:
    """"mtp@V" for MTP steps of a policy with draft vocabulary V, else the technique."""
    vocab = vocab_of.get(version, 0) if technique == "mtp" else 0
    return f"mtp@{vocab}" if vocab else technique


def _keys(s: StepRow, vocab_of: Mapping[int, int], per_tenant: bool = False) -> set[str]:
    """The keys a step counts under: its technique (pooling every MTP vocabulary) and its
    technique_key, and with `per_tenant` those with "|tenant" when its batch held one tenant."""
    keys = {s.technique, technique_key(s.technique, s.policy_version, vocab_of)}
    if per_tenant and len(s.tenants) == 1:
        keys |= {f"{k}|{s.tenants[0]}" for k in keys}
    return keys


def _drafting_decode(s: StepRow) -> bool:
    """A speculative step without prefill: a step with prefill counts its prefilling
    sequences in batch_size, which never draft."""
    return bool(s.depth) and s.technique != "none" and not s.prefill_tokens and s.batch_size > 0


def _to_depth(rates: Sequence[float], depth: int) -> list[float]:
    """`rates` at positions 0..depth-1, the last one repeating (none measured: 0)."""
    return [rates[min(i, len(rates) - 1)] if rates else 0.0 for i in range(depth)]


def _drafted(rates: Sequence[float]) -> float:
    """Expected accepted drafts of one drafting sequence: sum_i prod_{j<=i} rates_j."""
    reach, drafted = 1.0, 0.0
    for rate in rates:
        reach *= rate
        drafted += reach
    return drafted


def _weighted_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of relative error: rows scaled by 1 / y."""
    w = 1.0 / np.maximum(y, 1e-6)
    return _nnls(x * w[:, None], y * w)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x c - y| over c >= 0 (columns scaled to unit norm first, for conditioning)."""
    from scipy.optimize import nnls

    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(x / norms, y, maxiter=50 * x.shape[1])
    return coef / norms


def _fit_target(steps: Sequence[StepRow], buckets: Padding) -> tuple[float, ...]:
    shapes = [buckets.pad(s.batch_size, 1 + s.depth) for s in steps]
    b = np.array([shape[0] for shape in shapes], float)
    q = np.array([shape[1] for shape in shapes], float)
    p = np.array([s.prefill_tokens for s in steps], float)
    x = np.column_stack([np.ones_like(b), b, b * q, p])
    y = np.array([max(s.step_ms - s.propose_ms, 1e-3) for s in steps], float)
    t0, t1, t3, t4 = (float(c) for c in _weighted_lstsq(x, y))
    return (t0, t1, 0.0, t3, t4)


def _fit_propose(steps: Sequence[StepRow], vocab_of: Mapping[int, int]) -> dict[str, tuple]:
    groups: dict[str, list[StepRow]] = {}
    for s in steps:
        if s.depth and s.technique != "none":  # the plain key pools every MTP vocabulary
            for key in _keys(s, vocab_of):
                groups.setdefault(key, []).append(s)
    out = {}
    for key, rows in groups.items():
        b = np.array([s.batch_size for s in rows], float)
        d = np.array([s.depth for s in rows], float)
        y = np.array([s.propose_ms for s in rows], float)
        x = np.column_stack([np.ones_like(b), b, b * d])
        coef = _nnls(x, y)
        out[key] = (float(coef[0]), float(coef[1]), float(coef[2]))
    return out


def _fit_acceptance(steps: Sequence[StepRow], vocab_of: Mapping[int, int]) -> dict[str, tuple]:
    reached: dict[str, list[float]] = {}
    accepted: dict[str, list[float]] = {}
    for s in steps:
        if not s.depth or s.technique == "none" or not s.proposed:
            continue
        for key in _keys(s, vocab_of, per_tenant=True):
            r, a = reached.setdefault(key, []), accepted.setdefault(key, [])
            while len(r) < s.depth:
                r.append(0.0), a.append(0.0)
            for i in range(s.depth):
                r[i] += s.speculating if i == 0 else s.accepted_per_pos[i - 1]
                a[i] += s.accepted_per_pos[i] if i < len(s.accepted_per_pos) else 0
    # a trailing 0: positions deeper than any step measured earn nothing (rates() repeats the
    # last entry; repeating the last measured rate once credited n-gram@8 at batch 32 with the
    # second position's 0.85 from a window of depth-2 steps)
    out = {key: _rates(reached[key], accepted[key]) + (0.0,) for key in reached}
    return {key: rates for key, rates in out.items()  # a tenant's own rates need evidence
            if "|" not in key or reached[key][0] >= MIN_REACHED}


def _fit_draft_share(steps: Sequence[StepRow], vocab_of: Mapping[int, int]) -> dict[str, float]:
    rows: dict[str, float] = {}
    drafted: dict[str, float] = {}
    for s in steps:
        if not _drafting_decode(s):
            continue
        for key in _keys(s, vocab_of, per_tenant=True):
            rows[key] = rows.get(key, 0.0) + s.batch_size
            drafted[key] = drafted.get(key, 0.0) + s.speculating
    return {key: min(1.0, drafted[key] / n) for key, n in rows.items()
            if n >= MIN_REACHED or "|" not in key}


def _fit_depth_factors(steps: Sequence[StepRow], vocab_of: Mapping[int, int],
                       acceptance: Mapping[str, tuple[float, ...]],
                       draft_share: Mapping[str, float]) -> dict[str, dict[int, float]]:
    """Technique key -> depth -> accepted drafted tokens of its decode steps over what the
    pooled rates and share predict for them (module doc); depths with fewer than MIN_REACHED
    drafting sequences are left out."""
    sums: dict[tuple[str, int], list[float]] = {}  # measured, rows, drafting sequences
    for s in steps:
        if not _drafting_decode(s):
            continue
        for key in _keys(s, vocab_of):
            acc = sums.setdefault((key, s.depth), [0.0, 0.0, 0.0])
            acc[0] += sum(s.accepted_per_pos)
            acc[1] += s.batch_size
            acc[2] += s.speculating
    out: dict[str, dict[int, float]] = {}
    for (key, depth), (measured, rows, drafting) in sums.items():
        rates = acceptance.get(key, ())
        if drafting < MIN_REACHED or not rates:
            continue
        predicted = rows * draft_share.get(key, 1.0) * _drafted(_to_depth(rates, depth))
        if predicted > 0:
            lo, hi = DEPTH_FACTOR_RANGE
            out.setdefault(key, {})[depth] = min(hi, max(lo, measured / predicted))
    return out


def _rates(reached: list[float], accepted: list[float]) -> tuple[float, ...]:
    """Conditional rates; positions offered fewer than MIN_REACHED times reuse the previous rate."""
    out: list[float] = []
    for r, a in zip(reached, accepted):
        if r >= MIN_REACHED or (r > 0 and not out):
            out.append(min(MAX_RATE, a / r))
        elif out:
            out.append(out[-1])
    return tuple(out)


def _tenant_factors(requests: Sequence[RequestRow]) -> dict[str, float]:
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
    return {tenant: min(hi, max(lo, (a / p) / overall)) if overall > 0 else 1.0
            for tenant, (p, a) in totals.items() if p >= MIN_REACHED}


def _coverage(steps: Sequence[StepRow]) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for s in steps:
        per = out.setdefault(s.technique, {})
        per[s.depth] = per.get(s.depth, 0) + 1
    return out
