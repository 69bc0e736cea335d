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

The best of those, the smaller split on a tie, is the best policy of the
space: any policy at split s is one of step 2's candidates. Where no split
moves anything (no technique of the space keeps its KV in lent pages and the
pool holds every demand at every split), one solve is all of them, and
tuner.exact's smallest feasible split is the answer.

    >>> from tuner.config import TunerConfig
    >>> from tuner.model import PerfModel
    >>> from tuner.objective import Capacity
    >>> from tuner.space import SearchSpace
    >>> from tuner.traffic import Traffic
    >>> model = PerfModel(target=(10.0, 1.0, 0.0, 0.0, 0.0), acceptance={"draft": (0.9, 0.9)})
    >>> light = Traffic(steps=100, batch_weights={2: 1.0}, prefill_per_step={}, concurrency=2.0,
    ...                 concurrency_max=2, mean_prompt_tokens=100, mean_output_tokens=60)
    >>> cap = Capacity(total_pages=210, page_size=16, max_depth=2, proposers={"draft": (0, 0)},
    ...                lent_kv={"draft": 1.0})
    >>> space = SearchSpace.build(TunerConfig(ranges=(4, 64), max_pool_split=0.5), cap)
    >>> best = solve_splits(space, model, light, cap)
    >>> best.choose(2), best.pool_split  # 2 sequences of 10 pages, a page of verify slots: 21 of 210
    (('draft', 2), 0.1)
"""

from __future__ import annotations

import dataclasses

from engine.policy import TunedPolicy
from tuner.capacity import under_split
from tuner.exact import solve
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
    best: tuple[float, TunedPolicy] | None = None
    for split in grid:
        at = dataclasses.replace(capacity, priced_split=split)
        one = dataclasses.replace(space, max_pool_split=split, pool_split_step=split or 1.0)
        policy = solve(one, model, under_split(traffic, capacity, split), at, incumbent)
        if policy is None:
            continue
        policy = dataclasses.replace(policy, pool_split=split)
        ev = evaluate(policy, model, traffic, capacity)
        if ev.feasible and (best is None or ev.goodput > best[0] * (1 + 1e-9)):
            best = (ev.goodput, policy)
    return None if best is None else best[1]
