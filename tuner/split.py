"""The best policy over pool splits: one exact solve per split, capacity priced at it.

tuner.exact maximizes goodput over (technique, depth) per batch-size range
for one set of batch sizes and draft shares. The pool split moves both
(tuner.capacity): it decides the batch sizes the pool admits and the rows a
draft model's lent pages hold. So for every split s on the grid:

1. remap the traffic to the batches it runs at under s (`under_split`) and
   price capacity at s (`Capacity.priced_split`), so each cell's terms are
   its terms at s;
2. solve exactly over the footprints that fit s's lent pages;
3. give the optimum the split s and score it as any policy is scored.

The best of those is the best policy of the space: any policy at split s is
one of step 2's candidates. Among the splits that tie on goodput the
smallest wins, with one exception: speculating needs a few lent pages
(verify slots), so at split 0 every batch-size range without traffic is left
plain (tuner.exact, 5), and the smallest split above 0 wins over it where its
solve fills those ranges faster. With split 0 on any tie, a retune of a busy
window (observed only at batch sizes where speculation does not pay, so
every split ties) would choose a policy that stops speculating when the load
drains to batch 1-4, where the solve at the smallest lending split fills them.
Larger splits are not lent for the fill: pages a tenant may need are not
spent on batch sizes nobody has run. Where no split
moves anything (no technique of the space keeps its KV in lent pages and the
pool holds every demand at every split), one solve is all of them, and
tuner.exact's smallest feasible split is the answer.

    >>> from tuner.objective import Capacity  # 210 pages of 16 tokens; the draft's KV in lent pages
    >>> cap = Capacity(total_pages=210, page_size=16, max_depth=2, proposers={"draft": (0, 0)},
    ...                lent_kv={"draft": 1.0})
    >>> from tuner.traffic import Traffic  # two sequences of 160 tokens at a time
    >>> light = Traffic(steps=100, batch_weights={2: 1.0}, prefill_per_step={}, concurrency=2.0,
    ...                 concurrency_max=2, mean_prompt_tokens=100, mean_output_tokens=60)
    >>> from tuner.model import PerfModel  # drafts accepted 90% of the time at each position
    >>> model = PerfModel(target=(10.0, 1.0, 0.0, 0.0, 0.0), acceptance={"draft": (0.9, 0.9)})
    >>> from tuner.config import TunerConfig
    >>> from tuner.space import SearchSpace
    >>> space = SearchSpace.build(TunerConfig(ranges=(4, 64), max_pool_split=0.5), cap)
    >>> best = solve_splits(space, model, light, cap)
    >>> best.choose(2), best.pool_split  # 2 sequences of 10 pages, a page of verify slots: 21 of 210
    (('draft', 2), 0.1)
"""

from __future__ import annotations

import dataclasses

from engine.policy import TunedPolicy
from tuner.capacity import under_split
from tuner.exact import Rank, SolveCache, better, solve, solve_ranked
from tuner.model import PerfModel
from tuner.objective import Capacity, evaluate
from tuner.space import SearchSpace
from tuner.traffic import Traffic


def solve_splits(space: SearchSpace, model: PerfModel, traffic: Traffic,
                 capacity: Capacity, incumbent: TunedPolicy | None = None) -> TunedPolicy | None:
    """The feasible policy of `space` with the highest predicted goodput over its pool splits
    (KV pages only, no TPOT target), or None when none fits; see the module docstring."""
    grid = space.pool_splits() if space.max_pool_split > 0 else [0.0]
    lent = set(capacity.lent_kv) & set(space.techniques)
    if not lent and all(under_split(traffic, capacity, s) is traffic for s in grid):
        return solve(space, model, traffic, capacity, incumbent)
    found: list[tuple[float, Rank, TunedPolicy]] = []
    cache = SolveCache()  # what the splits' solves share (figures of cells they price alike)
    for split in grid:
        at = dataclasses.replace(capacity, priced_split=split)
        one = dataclasses.replace(space, max_pool_split=split, pool_split_step=split or 1.0)
        ranked = solve_ranked(one, model, under_split(traffic, capacity, split), at, incumbent, cache)
        if ranked is None:
            continue
        (_, fill, held, _), policy = ranked
        policy = dataclasses.replace(policy, pool_split=split)
        ev = evaluate(policy, model, traffic, capacity)
        if ev.feasible:
            found.append((split, (ev.goodput, fill, held, 0), policy))
    if not found:
        return None
    top = max(rank[0] for _, rank, _ in found)
    tied = [(s, rank, p) for s, rank, p in found if rank[0] >= top * (1 - 1e-9)]
    # the fill may lend the smallest split that speculates at all, not more (module doc)
    reach = max(min(s for s, _, _ in tied), min((s for s in grid if s > 0), default=0.0))
    best = None
    for split, rank, policy in tied:  # the grid ascends: a full tie keeps the smaller split
        rank = (top, *rank[1:])
        if split <= reach and (best is None or better(rank, best[0])):
            best = (rank, policy)
    return None if best is None else best[1]
