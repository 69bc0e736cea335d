"""The runtime decode policy: an immutable value the engine swaps between steps.

A policy says, for each batch-size range, which technique drafts and how deep;
the crossover batch size above which speculation is off whatever the table
says; and the pool split, the share of the fixed KV pool that speculation may
hold instead of tenant pages. The tuner produces new versions; the engine
applies them atomically at the start of a step and stamps every StepStats
with the version that produced it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

TECHNIQUES = ("none", "ngram", "mtp", "early_exit", "draft")
MAX_POOL_SPLIT = 0.5


@dataclass(frozen=True)
class BatchRule:
    """Technique and depth for batch sizes up to and including max_batch."""

    max_batch: int
    """Upper end of this batch-size range (ranges are ascending, the last covers the rest)."""
    technique: str = "none"
    """One of TECHNIQUES."""
    depth: int = 0
    """Draft tokens proposed per sequence per step (0 with technique "none")."""

    def __post_init__(self) -> None:
        if self.technique not in TECHNIQUES:
            raise ValueError(f"technique {self.technique!r} is not one of {TECHNIQUES}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch} must be >= 1")
        if (self.technique == "none") != (self.depth == 0):
            raise ValueError(f"technique={self.technique!r} and depth={self.depth} disagree "
                             "(depth 0 exactly when the technique is 'none')")
        if not 0 <= self.depth <= 8:
            raise ValueError(f"depth={self.depth} must be in [0, 8]")


@dataclass(frozen=True)
class TunedPolicy:
    """What to do at each batch size; see the module docstring."""

    rules: tuple[BatchRule, ...] = (BatchRule(1 << 30),)
    """Ascending by max_batch; a batch larger than every range uses the last rule."""
    crossover: int = 0
    """Speculation is off for batch sizes above this (0: never speculate)."""
    pool_split: float = 0.0
    """Share of the KV pool lent to speculation, in [0, MAX_POOL_SPLIT]."""
    version: int = 0
    """Increases with every policy the daemon applies."""
    draft_vocab: int = 0
    """Output vocabulary of the MTP heads, the N most frequent ids (0: the proposer's default,
    its smallest compiled one)."""
    source: str = "default"
    """Who made it: default, tuner or admin."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Free-form notes (e.g. the tuner's predicted goodput)."""

    def __post_init__(self) -> None:
        if not self.rules:
            raise ValueError("a policy needs at least one batch rule")
        bounds = [r.max_batch for r in self.rules]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"rule max_batch values {bounds} must be strictly ascending")
        if not 0.0 <= self.pool_split <= MAX_POOL_SPLIT:
            raise ValueError(f"pool_split={self.pool_split} must be in [0, {MAX_POOL_SPLIT}]")
        if self.crossover < 0:
            raise ValueError(f"crossover={self.crossover} must be >= 0")

    def choose(self, batch_size: int) -> tuple[str, int]:
        """(technique, depth) for a decode batch of this size.

        Example: TunedPolicy((BatchRule(4, "ngram", 3), BatchRule(64)), crossover=4).choose(2)
        == ("ngram", 3); .choose(8) == ("none", 0).
        """
        if batch_size > self.crossover:
            return "none", 0
        for r in self.rules:
            if batch_size <= r.max_batch:
                return r.technique, r.depth
        return self.rules[-1].technique, self.rules[-1].depth

    @property
    def max_depth(self) -> int:
        return max(r.depth for r in self.rules)

    def techniques(self) -> set[str]:
        return {r.technique for r in self.rules if r.technique != "none"}

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_dict(d: dict) -> "TunedPolicy":
        rules = tuple(BatchRule(**r) for r in d.get("rules", ()))
        rest = {k: v for k, v in d.items() if k != "rules"}
        return TunedPolicy(rules=rules, **rest) if rules else TunedPolicy(**rest)


NEVER = TunedPolicy()
