"""The price of a step whose rows draft differently: per-tenant rules in one batch.

Under a policy with tenant rules (engine.policy.TenantRule) a decode batch of
B rows holds rows of several tenants, each drafting with its own (technique,
depth) or not at all. The objective (tuner.objective.evaluate) prices such a
batch from the traffic's tenant mix at B (`Traffic.mix_at`, weights w_t),
taking the rows as B draws from that mix:

- tokens: B * sum_t w_t * e_t, e_t the tokens one row of tenant t emits at
  its own (technique, depth) with its own rates (PerfModel's per-tenant
  rates and draft share);
- the target forward runs each row at its own depth (engine/step/ragged_step.py):
  1 + n_t token rows for a row of tenant t, n_t the drafts such a row verifies
  on average (its depth times its draft share, `PerfModel.drafts_per_row`), so
  R = B * sum_t w_t (1 + n_t) and the step costs the model's forward at those
  rows (`PerfModel.forward_ms`, its sampling terms included). The forward is
  convex in R (t5): pricing the mean rows leaves out the spread of R over the
  draws, a slight underestimate at small batches;
- each proposer that runs costs p0 + p1 * rows + p2 * rows * depth over its
  own rows: p1 * B * W + p2 * B * sum w_t d_t in expectation (W the weight of
  its tenants), and p0 times the chance that any of its rows is present,
  1 - (1 - W) ** B.

With one (technique, depth) for every row this is the model's
`predict_step_ms` exactly, so a policy without tenant rules is priced as
before. `Pricer` caches the model's tokens and drafts per row, so a search
can price thousands of candidate rule sets against one traffic.

    >>> from tuner.model import PerfModel
    >>> m = PerfModel(target=(10.0, 0.0, 0.0, 1.0, 0.0), acceptance={"ngram": (0.5,)},
    ...               propose={"ngram": (1.0, 0.0, 0.0)})
    >>> p = Pricer(m)
    >>> round(p.step_ms(2, [(1.0, "ngram", 2, 2.0)]), 3), m.predict_step_ms("ngram", 2, 2)
    (17.0, 17.0)
    >>> # half the rows draft 2 (3 token rows each), half none (1 each): 10 + 2 * 2 rows, and
    >>> # the proposer in the three steps of four that hold a drafting row: 0.75
    >>> round(p.step_ms(2, [(0.5, "ngram", 2, 2.0), (0.5, "none", 0, 0.0)]), 3)
    14.75
"""

from __future__ import annotations

from collections.abc import Sequence

from tuner.model import PerfModel

Row = tuple[float, str, int, float]
"""(weight, technique, depth, drafts) of one tenant's rows in a batch (depth 0: no draft;
drafts: what one such row verifies on average, `Pricer.drafts`)."""


class Pricer:
    """A model's step times and tokens per row at given batch sizes, cached."""

    def __init__(self, model: PerfModel, draft_vocab: int = 0,
                 sampled: dict[int, float] | None = None,
                 sampled_steps: dict[int, float] | None = None) -> None:
        self.model, self.vocab = model, draft_vocab
        self.sampled, self.sampled_steps = sampled or {}, sampled_steps or {}
        self._tokens: dict[tuple, float] = {}
        self._drafts: dict[tuple, float] = {}

    def tokens(self, technique: str, depth: int, tenant: str | None,
               hold: float | None = None) -> float:
        """Tokens one row of `tenant` emits per step at (technique, depth)."""
        key = (technique, depth, tenant, hold)
        if key not in self._tokens:
            self._tokens[key] = self.model.expected_tokens_per_seq(technique, depth, tenant,
                                                                   self.vocab, hold)
        return self._tokens[key]

    def drafts(self, technique: str, depth: int, tenant: str | None,
               hold: float | None = None) -> float:
        """Drafts one row of `tenant` verifies per step at (technique, depth), on average."""
        key = (technique, depth, tenant, hold)
        if key not in self._drafts:
            self._drafts[key] = self.model.drafts_per_row(
                technique, depth, {tenant: 1.0} if tenant else None, self.vocab, hold)
        return self._drafts[key]

    def step_ms(self, batch: int, rows: Sequence[Row]) -> float:
        """Expected step time of a batch whose rows draw from `rows` (module docstring)."""
        total = sum(r[0] for r in rows)
        if total <= 0:
            return self.model.predict_step_ms("none", 0, batch, 0.0, self.vocab,
                                              self.sampled.get(batch, 0.0),
                                              self.sampled_steps.get(batch, 0.0))
        per_row = 0.0
        by_technique: dict[str, list[float]] = {}
        for w, technique, depth, drafts in rows:
            depth = depth if technique != "none" else 0
            per_row += w / total * (1.0 + (drafts if depth else 0.0))
            if depth:
                acc = by_technique.setdefault(technique, [0.0, 0.0])
                acc[0] += w / total
                acc[1] += w / total * depth
        ms = max(self.model.forward_ms(batch, batch * per_row, 0.0, self.sampled.get(batch, 0.0),
                                       self.sampled_steps.get(batch, 0.0)), self.model.floor_ms)
        for technique, (share, rows_depth) in by_technique.items():
            p0, p1, p2 = self.model.propose_terms(technique, self.vocab)
            ms += p0 * (1.0 - (1.0 - min(1.0, share)) ** batch) + p1 * batch * share
            ms += p2 * batch * rows_depth
        return ms
