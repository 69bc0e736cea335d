"""The best policy of the search space for predicted goodput, solved exactly.

The objective (tuner.objective) sums over the observed batch sizes, and a
policy picks one cell (technique, depth) per batch-size range, so

    goodput = 1000 (T0 + sum_r T[r, c_r]) / (M0 + sum_r M[r, c_r])

where T[r, c] and M[r, c] are cell c's terms of the objective's two sums
over range r's batch sizes (`objective.goodput_terms`; T0, M0: batch sizes
above the last range, which never speculate). Steps:

1. Score each cell once with `evaluate` (a one-rule policy speculating at
   every batch size) and sum its per-batch figures per range.
2. Maximize the ratio by Dinkelbach's method: with g the goodput of the
   current choice, each range takes the cell maximizing T - g M / 1000 (for a
   fixed g the ranges are independent); repeat until no range changes. Each
   round raises g, and when none does, g is the maximum (a few rounds). On a
   tie a range keeps its cell.
3. KV pages: what speculation needs grows with the techniques a policy uses,
   its deepest draft and its crossover, and with nothing else; what tenants
   need depends on none of them. So for every footprint (techniques S, depth
   D, crossover X) that fits the pool at some split, step 2 runs over the
   cells of S no deeper than D in the ranges up to X. The best of those
   optima, at the smallest pool split that holds it, is the best feasible
   policy: every feasible policy lies inside its own footprint, and every
   policy inside a feasible footprint is feasible.
4. One solve per MTP draft vocabulary (it changes MTP's cells only).
5. Ranges without traffic: a range none of whose batch sizes the window
   observed adds nothing to either sum, so every cell ties there. Left at
   "none", a policy tuned on batch-8 steps would stop speculating when the
   load eases to batch 3, until a retune has seen batch 3. So each such range
   takes the cell with the lowest predicted step time per output token at
   its probe batch (the geometric middle of the range, `Traffic.probe`: the
   window's tenant mix and sampling share), among the cells its footprint
   allows: the marginal choice, since a little traffic there adds share ×
   (1 − g × ms/token) to the ratio's terms whatever g is. Only within what
   the step-time fit saw: a probe batch inside `PerfModel.batch_span`, a cell
   whose step runs no more token rows (batch × (1 + the drafts a row verifies))
   than `PerfModel.max_rows`; beyond them the model extrapolates. The fill never
   changes the goodput predicted on the observed traffic; between footprints
   of equal goodput the one whose unobserved ranges run fastest wins, then
   the one lending fewer pages. A range beyond what the fit saw keeps the
   serving policy's cell (`incumbent`), where a footprint allows it (between
   footprints of equal goodput and fill, the one keeping more wins): the
   window holds no evidence to change it. Left at "none", a first retune
   fitted on batch 1-2 would stop the starter policy's n-gram at batch 3-8,
   the sizes the load reaches next as it rises.

The p95 TPOT constraint and the Pareto front of the two-objective mode are
not sums over ranges: there the search (tuner.search) starts TPE from this
optimum instead of stopping at it.

    >>> from tuner.model import PerfModel
    >>> from tuner.objective import Capacity
    >>> from tuner.space import SearchSpace
    >>> from tuner.traffic import Traffic
    >>> from tuner.config import TunerConfig
    >>> model = PerfModel(target=(10.0, 1.0, 0.0, 0.0, 0.0), acceptance={"ngram": (0.9, 0.9)})
    >>> traffic = Traffic(steps=100, batch_weights={1: 0.5, 32: 0.5}, prefill_per_step={},
    ...                   concurrency=4.0, concurrency_max=32)
    >>> capacity = Capacity(total_pages=4096, page_size=16, max_depth=2, proposers={"ngram": (0, 0)})
    >>> space = SearchSpace.build(TunerConfig(ranges=(2, 64)), capacity)
    >>> best = solve(space, model, traffic, capacity)
    >>> best.choose(1), best.choose(32), best.crossover
    (('ngram', 2), ('ngram', 2), 64)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from engine.policy import BatchRule, TunedPolicy
from tuner.capacity import under_split
from tuner.model import PerfModel
from tuner.objective import (
    Capacity,
    drafted_depth,
    evaluate,
    goodput_terms,
    speculating_rules,
    speculation_pages_needed,
    tenant_pages_needed,
)
from tuner.space import SearchSpace
from tuner.traffic import Traffic

EVERYWHERE = 1 << 30
"""A crossover and range end above any batch size."""


@dataclass
class SolveCache:
    """What the solves of one search at its pool splits share (tuner.split). A split changes
    the figures of a cell only through the batch sizes the traffic runs at (`under_split`
    returns the same Traffic object where it moves none) and, for a technique whose KV the
    split lends (`Capacity.lent_kv`), the rows it holds. So a cell's per-batch figures, the
    footprints and the optimum over a footprint that allows no lent technique are computed
    once per Traffic object and reused at every split that keeps it: the same numbers,
    without re-pricing every cell at every split of the grid (11 by default), which took
    half of a search's CPU."""

    _held: dict[int, Traffic] = field(default_factory=dict)
    """Every Traffic a key names by id(), held so that no id is reused while the cache lives."""
    _probes: dict[tuple[int, int], Traffic] = field(default_factory=dict)
    _moves: dict[tuple[int, float], bool] = field(default_factory=dict)
    _figures: dict[tuple, dict[int, tuple[float, float]]] = field(default_factory=dict)
    footprints: dict[int, list[list[tuple[int, np.ndarray]]]] = field(default_factory=dict)
    """id(traffic) -> `_footprint_groups`."""
    optima: dict[tuple, tuple[np.ndarray, float]] = field(default_factory=dict)
    """(id(traffic), vocabulary, allowed mask) -> `_maximize`'s optimum."""

    def key(self, traffic: Traffic) -> int:
        self._held.setdefault(id(traffic), traffic)
        return id(traffic)

    def probe(self, traffic: Traffic, batch: int) -> Traffic:
        """traffic.probe(batch), one object per (traffic, batch)."""
        key = (self.key(traffic), batch)
        if key not in self._probes:
            self._probes[key] = traffic.probe(batch)
        return self._probes[key]

    def figures(self, model: PerfModel, traffic: Traffic, cell: tuple[str, int], vocab: int,
                capacity: Capacity) -> dict[int, tuple[float, float]]:
        """cell_figures, once per key: the split priced is part of it for a lent technique
        and where the split moves the traffic's batch sizes (a probe's may move where its
        window's do not)."""
        split = 0.0 if capacity.priced_split is None else capacity.priced_split  # as evaluate
        moves = self._moves.get((id(traffic), split))
        if moves is None:
            moves = self._moves[(self.key(traffic), split)] = (
                under_split(traffic, capacity, split) is not traffic)
        key = (self.key(traffic), cell, vocab, split if moves or cell[0] in capacity.lent_kv else None)
        if key not in self._figures:
            self._figures[key] = cell_figures(model, traffic, cell, vocab, capacity)
        return self._figures[key]


def solve(space: SearchSpace, model: PerfModel, traffic: Traffic,
          capacity: Capacity, incumbent: TunedPolicy | None = None) -> TunedPolicy | None:
    """The feasible policy of `space` with the highest predicted goodput (KV pages only, no
    TPOT target), or None when no policy fits the pool; ranges beyond the fit keep the
    `incumbent`'s cells (see the module docstring)."""
    ranked = solve_ranked(space, model, traffic, capacity, incumbent)
    return None if ranked is None else ranked[1]


Rank = tuple[float, float, int, int]
"""(goodput, ms per token over the unobserved ranges, minus the ranges kept from the
incumbent, pages): how `better` orders two solutions."""


def solve_ranked(space: SearchSpace, model: PerfModel, traffic: Traffic, capacity: Capacity,
                 incumbent: TunedPolicy | None = None,
                 cache: SolveCache | None = None) -> tuple[Rank, TunedPolicy] | None:
    """`solve`'s policy with its rank, so that a caller comparing solves (tuner.split, one per
    pool split) breaks a goodput tie as one solve does: on the unobserved ranges' speed.
    `cache` carries what solves of the same model at other splits computed (SolveCache)."""
    splits = _split_pages(space, capacity, tenant_pages_needed(traffic, capacity))
    if not splits:
        return None
    cache = SolveCache() if cache is None else cache
    cells = [("none", 0)] + [(t, d) for t in space.techniques if t != "none" for d in space.depths]
    lent = np.array([t in capacity.lent_kv for t, _ in cells])
    best: tuple[float, float, int, TunedPolicy] | None = None
    for vocab in space.draft_vocabs or (0,):
        tokens, ms, rest = _range_sums(space, cells, vocab, model, traffic, capacity, cache)
        empty, reach = _reach_costs(space, cells, vocab, model, traffic, capacity, cache)
        kept = _kept_cells(space, cells, vocab, traffic, capacity, empty, incumbent)
        seen: set[bytes] = set()
        for allowed in _footprints(space, cells, traffic, capacity, splits, cache):
            # no lent technique allowed: the same optimum at every split keeping this traffic
            shared = None if allowed[:, lent].any() else (cache.key(traffic), vocab, allowed.tobytes())
            optimum = None if shared is None else cache.optima.get(shared)
            if optimum is None:
                optimum = _maximize(tokens, ms, rest, allowed)
                if shared is not None:
                    cache.optima[shared] = optimum
            choice, goodput = optimum
            choice, fill = _fill(choice, reach, empty, allowed)
            keep = (kept >= 0) & allowed[np.arange(len(kept)), np.maximum(kept, 0)]
            choice, held = np.where(keep, kept, choice), -int(keep.sum())
            # many footprints give the same choice, and one that loses on goodput loses
            # whatever its pages: build and price a policy only for a new contender
            key = choice.tobytes()
            if key in seen or (best is not None and better(best[:3] + (0,), (goodput, fill, held, 0))):
                continue
            seen.add(key)
            policy = _policy(space, cells, choice, vocab)
            pages, split = _smallest_split(policy, traffic, capacity, splits)
            if best is None or better((goodput, fill, held, pages), best[:4]):
                best = (goodput, fill, held, pages, TunedPolicy(
                    policy.rules, policy.crossover, split, draft_vocab=vocab, source="tuner"))
    return None if best is None else (best[:4], best[4])


def better(new: Rank, old: Rank) -> bool:
    """(goodput, ms per token over the unobserved ranges, minus the ranges that keep the
    incumbent's cell, pages): higher goodput, then on a tie faster unobserved ranges, then
    more kept ranges, then fewer pages (module doc, 3 and 5)."""
    if new[0] != old[0] and not math.isclose(new[0], old[0], rel_tol=1e-12):
        return new[0] > old[0]
    if new[1] != old[1] and not math.isclose(new[1], old[1], rel_tol=1e-9):
        return new[1] < old[1]
    return new[2:] < old[2:]


def probe_batches(space: SearchSpace, traffic: Traffic, capacity: Capacity,
                  span: tuple[int, int] | None = None) -> dict[int, int]:
    """Range index -> the batch size an unobserved range is priced at: the geometric middle
    of (lower, upper], for each range that holds no observed batch size, that the engine can
    run (its lower end within `capacity.max_batch`) and whose probe lies within `span` (the
    batch sizes the step-time fit saw, `PerfModel.batch_span`; None: any). A model fitted on
    batch-1 steps alone cannot tell a step's cost from a row's: it put n-gram@8 up to batch 16.

    >>> from tuner.config import TunerConfig
    >>> space = SearchSpace.build(TunerConfig(ranges=(2, 4, 8, 16, 64)), Capacity(64, 16))
    >>> probe_batches(space, Traffic(1, {7: 1.0}, {}, 7.0, 7), Capacity(64, 16))
    {0: 1, 1: 3, 3: 12, 4: 32}
    >>> probe_batches(space, Traffic(1, {7: 1.0}, {}, 7.0, 7), Capacity(64, 16), span=(2, 16))
    {1: 3, 3: 12}
    """
    lo, hi = span or (0, 1 << 30)
    out, lower = {}, 0
    for i, upper in enumerate(space.ranges):
        probe = min(math.isqrt((lower + 1) * upper), capacity.max_batch)
        if (lower < capacity.max_batch and lo <= probe <= hi
                and not any(lower < b <= upper for b in traffic.batch_weights)):
            out[i] = probe
        lower = upper
    return out


def _reach_costs(space: SearchSpace, cells: list[tuple[str, int]], vocab: int, model: PerfModel,
                 traffic: Traffic, capacity: Capacity,
                 cache: SolveCache) -> tuple[np.ndarray, np.ndarray]:
    """(ranges to fill [ranges], each cell's predicted ms per output token at their probe
    batch [ranges, cells], infinite for a cell whose step runs more rows than any the fit saw;
    module doc, 5)."""
    probes = probe_batches(space, traffic, capacity, model.batch_span)
    empty = np.zeros(len(space.ranges), dtype=bool)
    cost = np.zeros((len(space.ranges), len(cells)))
    for r, batch in probes.items():
        empty[r] = True
        at = cache.probe(traffic, batch)
        for c, cell in enumerate(cells):
            cost[r, c] = cell_cost(model, at, batch, cell, vocab, capacity, cache)
    return empty, cost


def cell_cost(model: PerfModel, at: Traffic, batch: int, cell: tuple[str, int], vocab: int,
              capacity: Capacity, cache: SolveCache | None = None) -> float:
    """Predicted ms per output token of `cell` drafting every row of `at` (a probe at `batch`),
    infinite for a drafting cell whose step runs more rows than any the fit saw."""
    technique, depth = cell
    rows = batch * (1.0 + model.drafts_per_row(technique, drafted_depth(technique, depth, capacity),
                                               at.mix_at(batch), vocab))
    if technique != "none" and model.max_rows is not None and rows > model.max_rows:
        return math.inf
    figures = (cell_figures(model, at, cell, vocab, capacity) if cache is None
               else cache.figures(model, at, cell, vocab, capacity))
    per_step, step_ms = next(iter(figures.values()))
    return step_ms / per_step


def cell_figures(model: PerfModel, traffic: Traffic, cell: tuple[str, int], vocab: int,
                 capacity: Capacity) -> dict[int, tuple[float, float]]:
    """Batch size -> (tokens per step, step ms) of a one-rule policy drafting with `cell` at
    every batch size of `traffic` (evaluate's per_batch)."""
    one = TunedPolicy((BatchRule(EVERYWHERE, *cell),), crossover=EVERYWHERE, draft_vocab=vocab)
    return evaluate(one, model, traffic, capacity).per_batch


def _kept_cells(space: SearchSpace, cells: list[tuple[str, int]], vocab: int, traffic: Traffic,
                capacity: Capacity, filled: np.ndarray,
                incumbent: TunedPolicy | None) -> np.ndarray:
    """Per range, the index of the incumbent's cell at its probe batch where the window
    observed none of its batch sizes and the fill does not price it (beyond the fit's batch
    span), else -1 (module doc, 5).

    >>> from tuner.config import TunerConfig
    >>> space = SearchSpace.build(TunerConfig(ranges=(2, 4, 8, 64)), Capacity(64, 16))
    >>> table = TunedPolicy((BatchRule(4, "ngram", 4), BatchRule(8, "ngram", 2), BatchRule(64)), 8)
    >>> cells = [("none", 0), ("ngram", 2), ("ngram", 4)]
    >>> _kept_cells(space, cells, 0, Traffic(1, {1: 1.0}, {}, 1.0, 1), Capacity(64, 16),
    ...             np.zeros(4, dtype=bool), table).tolist()
    [-1, 2, 1, 0]
    """
    out = np.full(len(space.ranges), -1)
    if incumbent is None:
        return out
    for r, probe in probe_batches(space, traffic, capacity).items():
        cell = incumbent.choose(probe)
        same_vocab = cell[0] != "mtp" or incumbent.draft_vocab == vocab
        if not filled[r] and same_vocab and cell in cells:
            out[r] = cells.index(cell)
    return out


def _fill(choice: np.ndarray, cost: np.ndarray, empty: np.ndarray,
          allowed: np.ndarray) -> tuple[np.ndarray, float]:
    """`choice` with each unobserved range at its fastest allowed cell ("none" on a tie), and
    the sum of those cells' ms per token (module doc, 5)."""
    if not empty.any():
        return choice, 0.0
    costs = np.where(allowed, cost, np.inf)
    fastest = costs.argmin(axis=1)
    filled = np.where(empty, fastest, choice)
    return filled, float(costs[empty, fastest[empty]].sum())


def _range_sums(space: SearchSpace, cells: list[tuple[str, int]], vocab: int, model: PerfModel,
                traffic: Traffic, capacity: Capacity,
                cache: SolveCache) -> tuple[np.ndarray, np.ndarray, tuple]:
    """T, M ([ranges, cells]) and (T0, M0), in the objective's units (module doc, 1)."""
    owner = {b: next((i for i, upper in enumerate(space.ranges) if b <= upper), len(space.ranges))
             for b in traffic.batch_weights}
    n = len(space.ranges) + 1  # the last row: batch sizes above every range
    tokens, ms = np.zeros((n, len(cells))), np.zeros((n, len(cells)))
    shares = traffic.token_shares()
    for c, cell in enumerate(cells):
        for b, (per_step, step_ms) in cache.figures(model, traffic, cell, vocab, capacity).items():
            share, share_ms = goodput_terms(shares[b], per_step, step_ms)
            tokens[owner[b], c] += share
            ms[owner[b], c] += share_ms
    return tokens[:-1], ms[:-1], (tokens[-1, 0], ms[-1, 0])


def _maximize(tokens: np.ndarray, ms: np.ndarray, rest: tuple[float, float],
              allowed: np.ndarray) -> tuple[np.ndarray, float]:
    """Dinkelbach's method (module doc, 2): the best cell per range and its goodput."""
    rows = np.arange(tokens.shape[0])
    choice = np.zeros(tokens.shape[0], dtype=int)  # "none" is always allowed
    scale = 1e-12 * max(1.0, float(np.abs(tokens).max()))
    for _ in range(100):
        rate = (rest[0] + tokens[rows, choice].sum()) / (rest[1] + ms[rows, choice].sum())
        score = np.where(allowed, tokens - rate * ms, -np.inf)
        better = score.argmax(axis=1)
        changed = score[rows, better] > score[rows, choice] + scale
        if not changed.any():
            return choice, 1000.0 * rate
        choice = np.where(changed, better, choice)
    return choice, 1000.0 * rate  # not reached: each round raises the rate over a finite set


def _footprints(space: SearchSpace, cells: list[tuple[str, int]], traffic: Traffic,
                capacity: Capacity, splits: list[tuple[int, float]],
                cache: SolveCache) -> list[np.ndarray]:
    """The allowed-cell masks ([ranges, cells]) of every footprint that fits (module doc, 3)."""
    room = splits[-1][0]  # the most pages a split lends while tenants still fit
    groups = cache.footprints.get(cache.key(traffic))
    if groups is None:
        groups = cache.footprints[cache.key(traffic)] = _footprint_groups(space, cells, traffic,
                                                                            capacity)
    out = []
    for group in groups:
        for need, mask in group:
            if need > room:
                break  # a larger crossover needs at least as many pages
            out.append(mask)
    return out


def _footprint_groups(space: SearchSpace, cells: list[tuple[str, int]], traffic: Traffic,
                      capacity: Capacity) -> list[list[tuple[int, np.ndarray]]]:
    """Per (techniques, depth), the (pages speculation needs, allowed-cell mask) of each
    crossover, ascending: the footprints whatever the pages lent (`_footprints` takes those
    that fit)."""
    techniques = [t for t in space.techniques if t != "none"]
    drafted = [drafted_depth(t, d, capacity) if t != "none" else 0 for t, d in cells]
    depths = sorted(set(drafted) - {0})
    groups = []
    for k in range(len(techniques) + 1):
        for chosen in itertools.combinations(techniques, k):
            for depth in depths if chosen else [0]:
                used = {t: min(depth, max(drafted[c] for c, (u, _) in enumerate(cells) if u == t))
                        for t in chosen}
                cell_ok = np.array([t == "none" or (t in chosen and drafted[c] <= depth)
                                    for c, (t, _) in enumerate(cells)])
                group = []
                for x, crossover in enumerate(space.ranges if chosen else [0]):
                    range_ok = np.arange(len(space.ranges))[:, None] <= (x if chosen else -1)
                    group.append((speculation_pages_needed(used, crossover, traffic, capacity),
                                  cell_ok[None, :] & range_ok | (np.arange(len(cells)) == 0)))
                groups.append(group)
    return groups


def _policy(space: SearchSpace, cells: list[tuple[str, int]], choice: np.ndarray,
            vocab: int) -> TunedPolicy:
    """The rules of `choice`; the crossover at the end of the last range that speculates, no
    further than the engine verifies (the ranges above it are ties, their cells never run)."""
    rules = tuple(BatchRule(upper, *cells[c]) for upper, c in zip(space.ranges, choice))
    crossover = min(max((r.max_batch for r in rules if r.technique != "none"), default=0),
                    space.spec_max_batch)
    return TunedPolicy(rules, crossover, draft_vocab=vocab, source="tuner")


def _split_pages(space: SearchSpace, capacity: Capacity, tenant_need: int) -> list[tuple[int, float]]:
    """(pages lent, split) of every split on the grid that leaves tenants their pages, ascending."""
    grid = space.pool_splits() if space.max_pool_split > 0 else [0.0]
    lent = [(math.floor(capacity.total_pages * s), s) for s in grid]
    return [(p, s) for p, s in lent if capacity.total_pages - p >= tenant_need]


def _smallest_split(policy: TunedPolicy, traffic: Traffic, capacity: Capacity,
                    splits: list[tuple[int, float]]) -> tuple[int, float]:
    """(pages speculation needs, the smallest split lending that many); the footprint that
    produced `policy` fits, so one does."""
    need = speculation_pages_needed(speculating_rules(policy, capacity), policy.crossover, traffic,
                                    capacity)
    return need, next(s for p, s in splits if p >= need)
