"""Exploration: a policy wrapper that keeps the model's estimates fresh.

The engine asks its policy `choose(batch)` once per decode step (on the
engine thread). `ExploringPolicy` answers like the policy it wraps except:

- during a short **profile** (its first `profile_steps` decisions), every
  other decision goes to the next unmeasured (technique, depth) cell in
  turn, so a fresh daemon measures each cell a few times on live traffic;
- afterwards a share `share` of decisions tries a neighbouring depth: the
  next shallower or deeper of the verified depths (the shallowest where the
  policy says "none", with a loaded technique in turn). A neighbour is what a local decision needs
  (should this batch size go one step deeper or shallower?) and it costs
  little: a random depth once sent 2% of batch-32 steps to depth 4 and 8,
  2-6x the cost of a plain step on CPU, ~7% of the busy phase's engine time.
  Deep cells at large batches are still predicted, from the rows a step runs
  (see tuner.model) and acceptance measured at any batch size.

It exposes `version`, `max_depth`, `techniques()` and every other attribute
of the wrapped TunedPolicy, so `EngineCore.set_policy` and the step records
treat it as that policy; the validator tells exploration steps apart
because their (technique, depth) is not what the wrapped policy chooses.
Its random stream is seeded and only the engine thread draws from it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from engine.policy import TunedPolicy


def profile_depths(max_depth: int) -> tuple[int, ...]:
    """The depths a startup profile measures: only the deepest. One such step measures every
    draft position's acceptance and the largest verify shape; shallower step times follow
    from the rows a step runs (tuner.model), and exploration visits them as neighbours.
    Profiling depths 2 and 1 as well cost ~10% of a short copy-heavy phase at batch 1,
    where they emit far less than the deepest draft.

    >>> profile_depths(4), profile_depths(1)
    ((4,), (1,))
    """
    return (max_depth,)


def gap_cells(coverage: Mapping[str, Mapping[int, int]], techniques: Sequence[str],
              max_depth: int, min_steps: int = 20) -> list[tuple[str, int]]:
    """(technique, depth) cells of the profile depths measured fewer than `min_steps` times,
    technique by technique in the order given (cheapest first).

    >>> gap_cells({"ngram": {4: 50}, "mtp": {4: 3}}, ["ngram", "mtp", "draft"], 4)
    [('mtp', 4), ('draft', 4)]
    """
    return [(t, d) for t in techniques for d in profile_depths(max_depth)
            if coverage.get(t, {}).get(d, 0) < min_steps]


class ExploringPolicy:
    """`policy` plus exploration (see the module docstring)."""

    def __init__(self, policy: TunedPolicy, *, share: float, techniques: Sequence[str],
                 max_depth: int, depths: Sequence[int] | None = None,
                 profile: Sequence[tuple[str, int]] = (), profile_steps: int = 0,
                 seed: int = 0) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share={share} must be in [0, 1]")
        self.policy = policy
        self.share = share
        self.explore_techniques = tuple(t for t in techniques if t != "none")
        self.explore_depth = max_depth
        self.explore_depths = tuple(depths or range(1, max_depth + 1))
        """The depths exploration tries (those verified without padding)."""
        self._profile = list(profile)
        self._profile_left = profile_steps if self._profile else 0
        self._rng = random.Random(seed)
        self._turn = 0
        self.explored = 0
        """Decisions that departed from the policy (read for tests and status)."""

    # -- what the engine calls -------------------------------------------------
    def choose(self, batch_size: int) -> tuple[str, int]:
        chosen = self.policy.choose(batch_size)
        if not self.explore_techniques:
            return chosen
        if self._profile_left > 0:
            self._profile_left -= 1
            if self._profile_left % 2 == 0:
                return self._departed(self._profile[self._next_turn(len(self._profile))])
        if self.share and self._rng.random() < self.share:
            return self._departed(self._alternative(chosen))
        return chosen

    @property
    def max_depth(self) -> int:
        return max(self.policy.max_depth, self.explore_depth)

    def techniques(self) -> set[str]:
        return self.policy.techniques() | set(self.explore_techniques)

    def __getattr__(self, name: str) -> Any:
        if name == "policy":  # not yet set (never recurse)
            raise AttributeError(name)
        return getattr(self.policy, name)

    # -- helpers --------------------------------------------------------------
    def _alternative(self, chosen: tuple[str, int]) -> tuple[str, int]:
        """A neighbouring cell of `chosen` (see the module docstring)."""
        technique, depth = chosen
        depths = self.explore_depths
        if technique == "none" or not depth:
            return self.explore_techniques[self._next_turn(len(self.explore_techniques))], depths[0]
        lower = [d for d in depths if d < depth]
        higher = [d for d in depths if d > depth]
        options = [(technique, d) for d in (lower[-1:] + higher[:1]) if d <= self.explore_depth]
        return self._rng.choice(options) if options else chosen

    def _next_turn(self, n: int) -> int:
        self._turn += 1
        return self._turn % n

    def _departed(self, cell: tuple[str, int]) -> tuple[str, int]:
        self.explored += 1
        return cell


def unwrap(policy: Any) -> TunedPolicy:
    """The TunedPolicy under any exploration wrapper."""
    return policy.policy if isinstance(policy, ExploringPolicy) else policy


def is_exploration(policy: TunedPolicy, batch: int, technique: str, depth: int) -> bool:
    """Whether a step departed from `policy` on purpose (a "none" step never counts:
    the engine also falls back to plain decoding when a proposer has no drafts)."""
    return technique != "none" and (technique, depth) != policy.choose(batch)
