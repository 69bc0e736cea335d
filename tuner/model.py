"""The performance model: step time and acceptance, fitted from recorded steps.

A step is one ragged forward (engine/step/ragged_step.py): every decode row verifies its own
drafts at its own depth and the prefill chunks ride in the same call, so nothing is padded
to a compiled batch size or query length. Step time splits into the target model's forward
and the proposer's work:

    step_ms = target(B, R, P) + sampling(S, A, R) + propose(technique, B, depth)
    target  = t0 + t1*B + t3*R + t5*R^2 + t4*P        (R = decode token rows, P = prefill tokens)
    sampling = s0*S*R/D + s1*A*R                      (S = rows that sample, A = 1 if any does)
    propose = p0 + p1*B + p2*B*depth                  (per technique, on its rows; 0 for "none")

R is the token rows the step's D decode rows run: each row 1 + the drafts it verifies (a row
at depth d that drafted d tokens runs 1 + d, one whose proposer found none runs 1), and each
of them passes the layers and the output layer. B is the sequences whose cache the step
reads (its decode rows and its prefill chunks), P the prompt tokens its chunks run: they
reach the output layer only at a chunk's last token, so they have a term of their own. A
recorded step ran R = D + proposed (tuner.stepfit.ran); a prediction runs R = B*(1 + n),
n = depth × the share of rows that draft (`drafts_per_row`: the fitted draft share, the
same share its tokens count), so rows that draft nothing cost one row, not the depth. The
fit has no q-only term (t2 is kept in the tuple for a caller's own model, fitted as 0):
with one, steps measured at small batches could explain the cost of deeper verifies by
depth alone, and the model would carry that to large batches as almost free. The rows term
carries across batch sizes, but a row does not cost the same everywhere: a forward of a few
rows is bound by reading the weights, so a row it adds is nearly free, while a large verify
is bound by compute and each row it adds costs several times as much. Linear in R, a fit
over every shape prices a large verify well below its cost, and the search then drafts at
large batches where drafting does not pay; t5*R^2 makes the row cost grow with the rows
(convex, as non-negative), so a large verify the window has not run is priced closer to its
cost instead of far below it.

The context the rows read has no term: attention reads each row's cached tokens, but steps
do not record how many (`kv_pages_used` counts the pool's pages, prefix-cache pages and
sequences the step did not run included), so that cost rides on t1 at the context the
fitted traffic had.

The target part is shared by all techniques (verification is the same
forward whatever drafted it), fitted on step_ms - propose_ms by least squares
weighted by 1/step_ms (so it minimizes relative error), each step at the rows it ran.
The proposers' parts are fitted jointly on propose_ms, each on the rows that drafted with it
(tuner.rows): under per-tenant rules one step may run several proposers and
records their sum. Every coefficient is a cost, so both fits are
non-negative least squares: a few slow, collinear steps (one busy minute at
nearly one batch size) can otherwise fit negative per-row costs whose
extrapolation predicts deep drafts far faster than plain decoding.

Sampling (temperature > 0) costs more than an argmax: the top-k / top-p
filter and the draw run at each verified position. An engine that
samples only the rows that ask pays s0 per sampled row and position; one that
runs its sampler over every row of the step once any row samples pays s1 per
row of such steps (R). A sampled row counts at the step's mean rows per decode row, R/D
(steps do not record which rows sampled): an approximation on steps whose rows verify
different depths. Both terms are fitted with the target part (non-negative; 0 where no
step sampled), so a window of greedy steps predicts sampled traffic no cheaper than it
runs, and the objective prices the share of sampled rows the traffic shows
(`Traffic.sampled_rows`, `Traffic.sampled_steps`).

A window of busy traffic may hold only one or two (batch size, depth) shapes;
`cost_history` (tuner.stepfit) adds older steps of the shapes it lacks to the step-time
fits (not to acceptance), because step times follow the machine and the rows, not the
traffic.

Acceptance (conditional rates per technique, draft position and tenant; the
share of rows that draft; a factor per measured depth) is fitted in
tuner.acceptance, whose docstring says how and why:

    tokens per sequence per step = 1 + min(depth, factor * share * sum_i prod_{j<=i} rate_j)

    >>> m = PerfModel(target=(1, 0, 0, 0, 0), acceptance={"ngram": (0.5, 0.5)})
    >>> m.expected_tokens_per_seq("ngram", 2)   # 1 + 0.5 + 0.25
    1.75
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from engine.types import StepStats
from tuner.acceptance import (
    MAX_RATE,
    drafted,
    fit_acceptance,
    fit_depth_factors,
    fit_draft_share,
    remembered,
    scale_odds,
    step_coverage,
    tenant_factors,
    to_depth,
)
from tuner.data import RequestRow
from tuner.rows import propose_columns
from tuner.stepfit import fit_propose, fit_target, ran

MIN_FIT_ROWS = 8


class NotEnoughTelemetry(ValueError):
    """Too few steps to fit the model."""


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
    rows_sq: float = 0.0
    """t5: ms per squared decode token row (the convex part of the rows cost; module docstring)."""
    sampling: tuple[float, float] = (0.0, 0.0)
    """(s0, s1): ms per sampled row and verified position; ms per decode token row of a step
    where any row samples (see the module docstring)."""
    batch_span: tuple[int, int] | None = None
    """(smallest, largest) batch size among the steps the step-time fit saw (the fit window and
    the cost history); None: no bound (a model made by hand). Beyond it the per-row and
    per-step costs are extrapolated: the exact solve prices no unobserved range there."""
    max_rows: int | None = None
    """The most decode token rows (R: decode rows plus the drafts they verified,
    tuner.stepfit.ran) one of those steps ran; None: no bound. The exact solve fills no
    unobserved range with a cell whose step would run more (tuner.exact)."""

    # -- fitting ------------------------------------------------------------
    @staticmethod
    def fit(steps: Sequence[StepStats], requests: Sequence[RequestRow] = (),
            vocab_of: Mapping[int, int] | None = None,
            history: Sequence[StepStats] = ()) -> PerfModel:
        """Fit on `steps` (and per-tenant acceptance on `requests`); `history` (older steps,
        see tuner.stepfit.cost_history) joins the step-time fits only."""
        if len(steps) < MIN_FIT_ROWS:
            raise NotEnoughTelemetry(f"{len(steps)} steps; the model needs at least {MIN_FIT_ROWS}")
        vocab_of = vocab_of or {}
        timed = [*history, *steps]
        acceptance = fit_acceptance(steps, vocab_of)
        draft_share = fit_draft_share(steps, vocab_of)
        target, rows_sq, sampling = fit_target(timed)
        return PerfModel(
            target=target,
            rows_sq=rows_sq,
            sampling=sampling,
            propose=fit_propose(timed, vocab_of),
            acceptance=acceptance,
            tenant_factor=tenant_factors(requests),
            coverage=step_coverage(steps),
            draft_share=draft_share,
            depth_factor=fit_depth_factors(steps, vocab_of, acceptance, draft_share),
            floor_ms=0.25 * min(s.step_ms for s in steps),
            batch_span=(min(s.batch_size for s in timed), max(s.batch_size for s in timed)),
            max_rows=int(max(ran(s)[1] for s in timed)),
        )

    @staticmethod
    def fit_with_report(steps: Sequence[StepStats], requests: Sequence[RequestRow] = (),
                        vocab_of: Mapping[int, int] | None = None, holdout_every: int = 5,
                        history: Sequence[StepStats] = ()) -> tuple[PerfModel, ErrorReport]:
        """Fit without every `holdout_every`-th step, report the error on those, refit on all."""
        held = [s for i, s in enumerate(steps) if i % holdout_every == holdout_every - 1]
        train = [s for i, s in enumerate(steps) if i % holdout_every != holdout_every - 1]
        report = PerfModel.fit(train, requests, vocab_of, history).error_report(held, vocab_of)
        return PerfModel.fit(steps, requests, vocab_of, history), report

    def remembering(self, recent: Sequence[StepStats], older: Sequence[StepStats],
                    vocab_of: Mapping[int, int]) -> PerfModel:
        """This model with the per-tenant acceptance of techniques its window (`recent`)
        barely ran, fitted on their `older` steps (tuner.acceptance.remembered)."""
        acceptance, share, depth = remembered(recent, older, vocab_of, self.acceptance,
                                              self.draft_share, self.depth_factor)
        return replace(self, acceptance=acceptance, draft_share=share, depth_factor=depth)

    # -- predictions ----------------------------------------------------------
    def predict_step_ms(self, technique: str, depth: int, batch: float, prefill: float = 0.0,
                        draft_vocab: int = 0, sampled: float = 0.0,
                        any_sampled: float | None = None, drafts: float | None = None) -> float:
        """Predicted step time (ms) of a decode batch of `batch` rows at `depth`, `sampled` of
        its rows sampling (a mean for traffic), `any_sampled` the chance that any row does
        (default: 1 when sampled > 0) and each row verifying `drafts` drafts on average
        (default: `drafts_per_row`, the fitted draft share of the depth).

        >>> m = PerfModel(target=(10.0, 0, 0, 1.0, 0), draft_share={"ngram": 0.5})
        >>> m.predict_step_ms("ngram", 4, 4), m.predict_step_ms("ngram", 4, 4, drafts=4.0)
        (22.0, 30.0)

        (10 + 4 rows × (1 + 4 × 0.5) token rows; 10 + 4 × 5 where every row drafts 4.)
        """
        if drafts is None:
            drafts = self.drafts_per_row(technique, depth, None, draft_vocab)
        ms = self.forward_ms(batch, batch * (1.0 + drafts), prefill, sampled, any_sampled)
        if depth and technique != "none":  # proposers work on the real rows (fitted so)
            ms += self._propose_ms(technique, depth, batch, draft_vocab)
        return max(ms, self.floor_ms)

    def drafts_per_row(self, technique: str, depth: int, mix: Mapping[str, float] | None = None,
                       draft_vocab: int = 0, share: float | None = None) -> float:
        """Drafts one decode row verifies on average at (technique, depth), the token rows it
        runs beyond its one (module docstring): the depth times the share of rows that draft,
        each tenant's of `mix` (weighted) where measured, else the pooled one; `share` given
        replaces them (a draft model's follows the pool split, as in expected_tokens_per_seq).

        >>> m = PerfModel(target=(1, 0, 0, 0, 0), draft_share={"ngram": 0.5, "ngram|copy": 1.0})
        >>> m.drafts_per_row("ngram", 4), m.drafts_per_row("ngram", 4, {"copy": 0.5, "chat": 0.5})
        (2.0, 3.0)
        """
        if technique == "none" or not depth:
            return 0.0
        if share is None:
            total = sum(mix.values()) if mix else 0.0
            share = (sum(w * self.share(technique, t, draft_vocab) for t, w in mix.items()) / total
                     if mix and total > 0 else self.share(technique, None, draft_vocab))
        return depth * float(share)

    def forward_ms(self, read: float, rows: float, prefill: float = 0.0, sampled: float = 0.0,
                   any_sampled: float | None = None, decode: float | None = None) -> float:
        """The target forward and sampling terms of a step reading `read` sequences' cache and
        running `rows` decode token rows over `decode` decode rows (default `read`), with
        `prefill` prompt tokens beside them (module docstring)."""
        if any_sampled is None:
            any_sampled = 1.0 if sampled > 0 else 0.0
        per_row = rows / max(decode if decode is not None else read, 1.0)
        return (self._terms_ms(read, rows, per_row) + self.target[4] * prefill
                + self.sampling[0] * sampled * per_row + self.sampling[1] * any_sampled * rows)

    def _terms_ms(self, read: float, rows: float, per_row: float) -> float:
        """The target forward's terms alone (no sampling or prefill)."""
        t = self.target
        return t[0] + t[1] * read + t[2] * per_row + t[3] * rows + self.rows_sq * rows * rows

    def _propose_ms(self, technique: str, depth: int, batch: float, draft_vocab: int) -> float:
        p = self._lookup(self.propose, technique, draft_vocab) or (0.0, 0.0, 0.0)
        return max(0.0, p[0] + p[1] * batch + p[2] * batch * depth)

    def propose_terms(self, technique: str, draft_vocab: int = 0) -> tuple[float, float, float]:
        """(p0, p1, p2) of a proposer (zeros for "none" or one never measured)."""
        if technique == "none":
            return 0.0, 0.0, 0.0
        p = self._lookup(self.propose, technique, draft_vocab) or (0.0, 0.0, 0.0)
        return float(p[0]), float(p[1]), float(p[2])

    def prefill_ms(self, prefill: float) -> float:
        """The prefill part of a step's time: t4 per prefill token."""
        return self.target[4] * prefill

    def rates(self, technique: str, depth: int, tenant: str | None = None,
              draft_vocab: int = 0) -> list[float]:
        """Conditional acceptance at positions 0..depth-1 (the last measured rate repeats)."""
        own = self._lookup(self.acceptance, technique, draft_vocab, tenant) if tenant else None
        known = own or self._lookup(self.acceptance, technique, draft_vocab) or ()
        factor = 1.0 if own or tenant is None else self.factor_of(tenant)
        return [min(MAX_RATE, scale_odds(base, factor)) for base in to_depth(known, depth)]

    def factor_of(self, tenant: str) -> float:
        """The tenant's factor on the pooled odds. Once any tenant is measured, one not yet
        measured gets 0: no credit from speculation until its own requests show some, as a
        technique never measured earns nothing. Factor 1 (or the lowest measured factor)
        would credit new tenants with the rates of whichever tenants happened to be
        measured, e.g. a copy-heavy one. With no tenant measured at all, the pooled rates
        are all there is about anyone: factor 1.

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
                                draft_vocab: int = 0, share: float | None = None) -> float:
        """1 + min(depth, factor * share * sum_i prod_{j<=i} alpha_j): tokens one sequence
        emits per step (factor: see factor_at); `share` given replaces the fitted draft share
        (a draft model's follows the pool split: tuner.capacity)."""
        if technique == "none" or not depth:
            return 1.0
        if share is None:
            share = self.share(technique, tenant, draft_vocab)
        tokens = drafted(self.rates(technique, depth, tenant, draft_vocab)) * share
        return 1.0 + min(float(depth), tokens * self.factor_at(technique, depth, draft_vocab))

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
                           draft_vocab: int = 0, share: float | None = None) -> float:
        """Expected tokens per sequence per step for a tenant mix (weights sum to 1)."""
        if not mix:
            return self.expected_tokens_per_seq(technique, depth, None, draft_vocab, share)
        return sum(w * self.expected_tokens_per_seq(technique, depth, t, draft_vocab, share)
                   for t, w in mix.items())

    def error_report(self, steps: Sequence[StepStats],
                     vocab_of: Mapping[int, int] | None = None) -> ErrorReport:
        """Absolute percentage errors of step time and per-step goodput on `steps`."""
        vocab_of = vocab_of or {}
        ms_err, gp_err = [], []
        for s in steps:
            vocab = vocab_of.get(s.policy_version, 0)
            if len({(c.technique, c.depth) for c in s.row_classes}) > 1:
                ms, tokens = self._per_row(s, vocab)
            else:
                ms = self._ran_ms(s)
                if s.depth and s.technique != "none":
                    ms += self._propose_ms(s.technique, s.depth, s.batch_size, vocab)
                ms = max(ms, self.floor_ms)
                tokens = s.batch_size * self.expected_tokens_per_seq(s.technique, s.depth, None,
                                                                     vocab)
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

    def _ran_ms(self, s: StepStats) -> float:
        """The target forward and sampling of a recorded step at the rows it ran
        (tuner.stepfit.ran)."""
        read, rows, decode = ran(s)
        return self.forward_ms(read, rows, s.prefill_tokens, s.sampled_rows, decode=decode)

    def _per_row(self, s: StepStats, vocab: int) -> tuple[float, float]:
        """(step ms, tokens) predicted for a step whose rows drafted with several (technique,
        depth) choices: the target at the rows it ran (each row at its own depth), each
        proposer on its own rows, each row class's tokens at its own
        choice and tenant."""
        ms = max(self._ran_ms(s), self.floor_ms)
        for technique, (n_ran, rows, rows_depth) in propose_columns(s, lambda t: t).items():
            p0, p1, p2 = self.propose_terms(technique, vocab)
            ms += max(0.0, p0 * n_ran + p1 * rows + p2 * rows_depth)
        tokens = sum(c.rows * self.expected_tokens_per_seq(c.technique, c.depth, c.tenant, vocab)
                     for c in s.row_classes)
        return ms, tokens

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
                "rows_sq": round(self.rows_sq, 6),
                "sampling": [round(c, 5) for c in self.sampling],
                "propose": {k: [round(c, 5) for c in v] for k, v in self.propose.items()},
                "acceptance": {k: [round(r, 4) for r in v] for k, v in self.acceptance.items()},
                "tenant_factor": {k: round(v, 4) for k, v in self.tenant_factor.items()},
                "draft_share": {k: round(v, 4) for k, v in self.draft_share.items()},
                "depth_factor": {k: {str(d): round(f, 4) for d, f in v.items()}
                                 for k, v in self.depth_factor.items()},
                "coverage": {k: {str(d): n for d, n in v.items()}
                             for k, v in self.coverage.items()},
                "batch_span": list(self.batch_span) if self.batch_span else None,
                "max_rows": self.max_rows}

