"""The price of a step whose rows draft differently: per-tenant rules in one batch.

Under a policy with tenant rules (engine.policy.TenantRule) a decode batch of
B rows holds rows of several tenants, each drafting with its own (technique,
depth) or not at all. The objective (tuner.objective.evaluate) prices such a
batch from the traffic's tenant mix at B (`Traffic.mix_at`, weights w_t),
taking the rows as B draws from that mix:

- tokens: B * sum_t w_t * e_t, e_t the tokens one row of tenant t emits at
  its own (technique, depth) with its own rates (PerfModel's per-tenant
  rates and draft share);
- the target forward runs every row at the verify depth, the deepest row's:
  P(max depth <= d) = (sum of w_t over tenants with depth <= d) ** B, and the
  step costs the model's step time at that depth (its sampling terms
  included), averaged over that distribution;
- each proposer that runs costs p0 + p1 * rows + p2 * rows * depth over its
  own rows: p1 * B * W + p2 * B * sum w_t d_t in expectation (W the weight of
  its tenants), and p0 times the chance that any of its rows is present,
  1 - (1 - W) ** B.

Where the engine compiles segmented verifies (the model's
`Padding.segments`), the rows that draft nothing (weight w0: depth 0) may
run as a plain segment beside the drafting rows' verify instead of padded
to the verify depth. The target forward is then priced over k plain rows
and the drafting rows' deepest depth d jointly:
P(k plain, every drafting row's depth <= d) = C(B, k) w0^k W_d^(B-k), W_d the
weight of the drafting tenants with depth <= d (differences over d give
P(k, max = d)); each (k, d) costs the model's step at the rows the engine
runs (`PerfModel.predict_step_ms(..., plain=k)`: segmented where
engine.types.segment_split says so, else every row at d; k = B is plain
decode). Summed over k this is the padded formula above, which a model
without segments keeps, term for term. The proposers' terms do not change.

With one (technique, depth) for every row this is the model's
`predict_step_ms` exactly, so a policy without tenant rules is priced as
before. `Pricer` caches the model's figures per batch size (and the target
part per batch and mix of depths), so a search can price thousands of
candidate rule sets against one traffic.

    >>> from dataclasses import replace
    >>> from tuner.model import PerfModel
    >>> from tuner.shapes import Padding
    >>> m = PerfModel(target=(10.0, 0.0, 0.0, 1.0, 0.0), acceptance={"ngram": (0.5,)},
    ...               propose={"ngram": (1.0, 0.0, 0.0)})
    >>> p = Pricer(m)
    >>> round(p.step_ms(2, [(1.0, "ngram", 2)]), 3), m.predict_step_ms("ngram", 2, 2)
    (17.0, 17.0)
    >>> # a quarter of the steps hold no drafting row: 0.25 * 12 + 0.75 * (16 + 1)
    >>> round(p.step_ms(2, [(0.5, "ngram", 2), (0.5, "none", 0)]), 3)
    15.75
    >>> # with segments (1 plain, 1 drafting, q 3) half the steps run 1 + 3 rows, not 2 * 3:
    >>> # 0.25 * 12 + 0.5 * (14 + 1) + 0.25 * (16 + 1)
    >>> s = Pricer(replace(m, padding=Padding((1, 2), (1, 2, 3), frozenset({(1, 1, 3)}))))
    >>> round(s.step_ms(2, [(0.5, "ngram", 2), (0.5, "none", 0)]), 3)
    14.75
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

from tuner.model import PerfModel

Row = tuple[float, str, int]
"""(weight, technique, depth) of one tenant's rows in a batch (depth 0: no draft)."""


class Pricer:
    """A model's step times and tokens per row at given batch sizes, cached."""

    def __init__(self, model: PerfModel, draft_vocab: int = 0,
                 sampled: dict[int, float] | None = None,
                 sampled_steps: dict[int, float] | None = None) -> None:
        self.model, self.vocab = model, draft_vocab
        self.sampled, self.sampled_steps = sampled or {}, sampled_steps or {}
        self._target: dict[tuple[int, int, int], float] = {}
        self._tokens: dict[tuple, float] = {}
        self._mixes: dict[tuple, float] = {}

    def target_ms(self, batch: int, depth: int, plain: int = 0) -> float:
        """The step time of `batch` rows verified at `depth`, `plain` of them drafting nothing
        (a plain segment where the engine runs one), without any proposer."""
        key = (batch, depth, plain)
        if key not in self._target:
            self._target[key] = self.model.predict_step_ms(
                "none", depth, batch, 0.0, self.vocab, self.sampled.get(batch, 0.0),
                self.sampled_steps.get(batch, 0.0), plain)
        return self._target[key]

    def tokens(self, technique: str, depth: int, tenant: str | None,
               hold: float | None = None) -> float:
        """Tokens one row of `tenant` emits per step at (technique, depth)."""
        key = (technique, depth, tenant, hold)
        if key not in self._tokens:
            self._tokens[key] = self.model.expected_tokens_per_seq(technique, depth, tenant,
                                                                   self.vocab, hold)
        return self._tokens[key]

    def step_ms(self, batch: int, rows: Sequence[Row]) -> float:
        """Expected step time of a batch whose rows draw from `rows` (module docstring)."""
        total = sum(w for w, _, _ in rows)
        if total <= 0:
            return self.target_ms(batch, 0)
        by_depth: dict[int, float] = {}
        by_technique: dict[str, list[float]] = {}
        for w, technique, depth in rows:
            depth = depth if technique != "none" else 0
            by_depth[depth] = by_depth.get(depth, 0.0) + w / total
            if depth:
                acc = by_technique.setdefault(technique, [0.0, 0.0])
                acc[0] += w / total
                acc[1] += w / total * depth
        ms = self._forward_ms(batch, tuple(sorted(by_depth.items())))
        for technique, (share, rows_depth) in by_technique.items():
            p0, p1, p2 = self.model.propose_terms(technique, self.vocab)
            ms += p0 * (1.0 - (1.0 - min(1.0, share)) ** batch) + p1 * batch * share
            ms += p2 * batch * rows_depth
        return ms

    def _forward_ms(self, batch: int, by_depth: tuple[tuple[int, float], ...]) -> float:
        """Expected target step time of `batch` rows whose depths draw from `by_depth` ((depth,
        weight) ascending, weights summing to 1), cached per batch and mix (module docstring).
        Where no compiled segmented verify holds `batch` rows, every row runs at the deepest
        depth, as without segments."""
        key = (batch, by_depth)
        if key not in self._mixes:
            segments = self.model.padding.segments
            segmented = int(batch) == batch and batch <= max((bp + bv for bp, bv, _ in segments),
                                                             default=0)
            self._mixes[key] = (self._segmented_ms(int(batch), by_depth) if segmented
                                else self._padded_ms(batch, by_depth))
        return self._mixes[key]

    def _padded_ms(self, batch: int, by_depth: tuple[tuple[int, float], ...]) -> float:
        """Every row at the deepest row's depth: P(max depth <= d) = (weight of depths <= d)^B."""
        ms, below, reach = 0.0, 0.0, 0.0
        for depth, weight in by_depth:
            below += weight
            p = min(1.0, below) ** batch
            ms += (p - reach) * self.target_ms(batch, depth)
            reach = p
        return ms

    def _segmented_ms(self, batch: int, by_depth: tuple[tuple[int, float], ...]) -> float:
        """Over k plain rows (depth 0) and the drafting rows' deepest depth d jointly:
        P(k, max <= d) = C(B, k) w0^k W_d^(B - k), each (k, d) at the rows the engine runs."""
        w0 = sum(w for d, w in by_depth if d == 0)
        ms = w0 ** batch * self.target_ms(batch, 0)  # k = B: plain decode
        for k in range(batch):
            ways = comb(batch, k) * w0 ** k
            below, reach = 0.0, 0.0
            for depth, weight in by_depth:
                if depth == 0:
                    continue
                below += weight
                p = min(1.0, below) ** (batch - k)
                ms += ways * (p - reach) * self.target_ms(batch, depth, k)
                reach = p
        return ms
