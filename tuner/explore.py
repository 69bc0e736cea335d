"""Exploration: what the daemon adds to each policy it serves to keep the model's estimates fresh.

A served policy carries an `engine.policy.Exploration`, which the engine
applies with its own random stream (`engine.step.chooser.StepChooser`):

- during a short **profile** (the first `profile_steps` decisions of the
  first policy served after startup), every other decision goes to the next
  (technique, depth) cell the telemetry lacks, so a fresh daemon measures
  each cell a few times on live traffic;
- afterwards a share `explore_share` of decisions tries a neighbouring
  depth: the next shallower or deeper of the searched depths (every depth
  up to the engine's max_depth unless Capacity.depths names some; the
  shallowest where the policy says "none", with a
  loaded technique in turn). A neighbour is what a local decision needs
  (should this batch size go one step deeper or shallower?) and costs far
  less than a random depth, which at a large batch can take several times a
  plain step. Deep cells at large batches are still predicted, from the
  rows a step runs (tuner.model) and acceptance measured at any batch size.

`ExplorationPlan` builds those values from the engine's capacity and the
tuner's config; the validator tells exploration steps apart because their
(technique, depth) is not what the policy's rules choose (`is_exploration`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

from sqlalchemy import Engine

from engine.policy import Exploration, TunedPolicy
from store.db import session_scope
from tuner.config import TunerConfig
from tuner.data import coverage
from tuner.objective import Capacity


def profile_depths(max_depth: int) -> tuple[int, ...]:
    """The depths a startup profile measures: only the deepest. One such step measures every
    draft position's acceptance and the largest verify shape; shallower step times follow
    from the rows a step runs (tuner.model), and exploration visits them as neighbours, so
    profiling shallower depths too would spend steps where they emit far less.

    >>> profile_depths(4), profile_depths(1)
    ((4,), (1,))
    """
    return (max_depth,)


def gap_cells(seen: Mapping[str, Mapping[int, int]], techniques: Sequence[str],
              max_depth: int, min_steps: int = 20) -> list[tuple[str, int]]:
    """(technique, depth) cells of the profile depths measured fewer than `min_steps` times,
    technique by technique in the order given (cheapest first).

    >>> gap_cells({"ngram": {4: 50}, "mtp": {4: 3}}, ["ngram", "mtp", "draft"], 4)
    [('mtp', 4), ('draft', 4)]
    """
    return [(t, d) for t in techniques for d in profile_depths(max_depth)
            if seen.get(t, {}).get(d, 0) < min_steps]


def is_exploration(policy: TunedPolicy, batch: int, technique: str, depth: int) -> bool:
    """Whether a step departed from `policy`'s rules on purpose (a "none" step never counts:
    the engine also falls back to plain decoding when a proposer has no drafts).

    >>> from engine.policy import BatchRule
    >>> p = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4)
    >>> is_exploration(p, 2, "ngram", 4), is_exploration(p, 2, "ngram", 2), is_exploration(p, 2, "none", 0)
    (True, False, False)

    With tenant rules a step's rows draft with several (technique, depth) choices; it
    records the technique of the most drafting rows and the deepest row's depth. So it is
    exploration when its technique or its depth is none of the choices the policy makes
    at that batch size (the batch rule's and every applicable tenant rule's).

    >>> from engine.policy import TenantRule
    >>> q = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4,
    ...                 tenants=(TenantRule("code", "mtp", 4, max_batch=4),))
    >>> is_exploration(q, 2, "ngram", 4), is_exploration(q, 2, "ngram", 1), is_exploration(q, 8, "mtp", 4)
    (False, True, True)
    """
    if technique == "none":
        return False
    if (technique, depth) == policy.choose(batch):
        return False
    tenants = getattr(policy, "tenants", ())
    if not tenants or batch > policy.crossover:
        return True
    choices = {policy.choose(batch)} | {(t.technique, t.depth) for t in tenants
                                        if batch <= t.max_batch}
    drafting = {c for c in choices if c[0] != "none"}
    return technique not in {t for t, _ in drafting} or depth not in {d for _, d in drafting}


class ExplorationPlan:
    """Adds exploration to each policy the keeper serves; the first one also profiles the gaps.

    >>> cap = Capacity(64, 16, max_depth=8, depths=(1, 2, 4, 8), proposer_depths={"mtp": 4},
    ...                proposers={"mtp": (1 << 20, 0), "ngram": (0, 0)})
    >>> plan = ExplorationPlan(cap, TunerConfig(explore_share=0.05))
    >>> plan.techniques, plan.depths, plan.gaps_of({"ngram": {8: 99}})
    (['ngram', 'mtp'], (1, 2, 4, 8), [('mtp', 4)])
    >>> plan(TunedPolicy(version=3)).explore.share
    0.05
    """

    def __init__(self, capacity: Capacity, config: TunerConfig) -> None:
        # cheapest first: what costs no memory is profiled (and can pay) soonest
        self.techniques = sorted(capacity.proposers, key=lambda t: (capacity.proposers[t][0], t))
        self.max_depth = min(capacity.max_depth, config.max_depth)
        verified = tuple(d for d in capacity.depths if d <= self.max_depth)
        self.depths = verified or tuple(range(1, self.max_depth + 1))
        """The depths exploration tries (the searched depths: Capacity.depths, else all)."""
        self.proposer_depth = {t: min(self.max_depth, capacity.proposer_depths.get(t, self.max_depth))
                               for t in self.techniques}
        self.catch_up = tuple(t for t in self.techniques if t in capacity.lent_kv)
        """Techniques whose first drafts for a row prefill it into a cache of their own (the
        draft model): explored only up to the policy's crossover (engine.policy.Exploration)."""
        self.lend_split = config.pool_split_step if config.max_pool_split > 0 else 0.0
        """The pool split a policy is served with at least while its profile has a cell of a
        technique that drafts in lent pages (the smallest split the search tries): lent no
        pages, the draft model cannot draft, and its turns would run plain and measure nothing."""
        self.share = config.explore_share
        self.profile_steps = config.profile_steps
        self.gaps: list[tuple[str, int]] = []
        """Cells the first served policy profiles (measure_gaps fills it)."""
        self.enabled = config.enabled and bool(self.techniques) and self.max_depth >= 1

    def gaps_of(self, seen: Mapping[str, Mapping[int, int]]) -> list[tuple[str, int]]:
        """The cells to profile, given technique -> depth -> steps measured."""
        return [cell for t in self.techniques for cell in gap_cells(seen, [t], self.proposer_depth[t])]

    def measure_gaps(self, db: Engine, window_s: float, instance: str | None = "") -> None:
        """Find the cells the last `window_s` of `instance`'s telemetry lacks (step times are
        per instance, so each replica profiles its own)."""
        with session_scope(db) as session:
            seen = coverage(session, time.time() - window_s, instance=instance)
        self.gaps = self.gaps_of(seen)

    def __call__(self, policy: TunedPolicy) -> TunedPolicy:
        """`policy` as served: with exploration (and, the first time, the profile). A profile
        with a lent-pages technique's cell is served with at least `lend_split` (the recorded
        policy keeps its own split; the next retune's policy says what it lends); where the
        served policy lends nothing, exploration leaves those techniques out.

        >>> cap = Capacity(64, 16, max_depth=8, depths=(1, 2, 4, 8), proposers={"ngram": (0, 0),
        ...                "draft": (1 << 20, 0)}, lent_kv={"draft": 1.0})
        >>> plan = ExplorationPlan(cap, TunerConfig(pool_split_step=0.05))
        >>> plan.gaps = [("ngram", 8), ("draft", 8)]
        >>> first = plan(TunedPolicy(version=1))
        >>> first.pool_split, first.explore.profile, first.explore.techniques
        (0.05, (('ngram', 8), ('draft', 8)), ('ngram', 'draft'))
        >>> later = plan(TunedPolicy(version=2))
        >>> later.pool_split, later.explore.profile, later.explore.techniques
        (0.0, (), ('ngram',))
        """
        if not self.enabled:
            return policy
        profile, self.gaps = tuple(self.gaps), []  # only the first policy after startup profiles
        split = policy.pool_split
        if not split and any(t in self.catch_up for t, _ in profile):
            split = self.lend_split
            profile = profile if split else tuple(c for c in profile if c[0] not in self.catch_up)
        techniques = tuple(t for t in self.techniques if split or t not in self.catch_up)
        return dataclasses.replace(policy, pool_split=split, explore=Exploration(
            share=self.share, techniques=techniques, depths=self.depths,
            profile=profile, profile_steps=self.profile_steps if profile else 0,
            catch_up=tuple(t for t in self.catch_up if t in techniques)))
