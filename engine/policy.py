"""The runtime decode policy: an immutable value the engine swaps between steps.

A policy says, for each batch-size range, which technique drafts and how deep;
the crossover batch size above which speculation is off whatever the table
says; and the pool split, the share of the fixed KV pool that speculation may
hold instead of tenant pages. The tuner produces new versions; the engine
applies them atomically at the start of a step and stamps every StepStats
with the version that produced it.

A served policy may also carry an `Exploration`: a small share of decode
steps tries a neighbouring (technique, depth) cell, and a short startup
profile measures cells the telemetry lacks, so the tuner's model stays fed.
The policy stays a value; `StepChooser`, owned by the engine and drawing from
the engine's seeded random stream, applies the exploration step by step. Such steps are
stamped with the technique and depth they ran and the policy's version.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

TECHNIQUES = ("none", "ngram", "mtp", "early_exit", "draft")
MAX_POOL_SPLIT = 0.5
MAX_DEPTH = 8


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
        if not 0 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth={self.depth} must be in [0, {MAX_DEPTH}]")


@dataclass(frozen=True)
class Exploration:
    """Which cells a served policy tries besides its own choice, and how often."""

    share: float = 0.0
    """Share of decode steps (after the profile) that try a neighbouring cell."""
    techniques: tuple[str, ...] = ()
    """Techniques exploration may use, cheapest first (tried in turn where the policy says none)."""
    depths: tuple[int, ...] = ()
    """Depths exploration tries, ascending: the next shallower or deeper one of the chosen depth."""
    profile: tuple[tuple[str, int], ...] = ()
    """(technique, depth) cells the startup profile measures, in turn."""
    profile_steps: int = 0
    """Decode steps at the start of this policy of which every other one runs a profile cell."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share={self.share} must be in [0, 1]")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps={self.profile_steps} must be >= 0")
        if self.techniques and not self.depths:
            raise ValueError(f"techniques={self.techniques} need at least one depth to try")
        if list(self.depths) != sorted(set(self.depths)) or not all(
                1 <= d <= MAX_DEPTH for d in self.depths):
            raise ValueError(f"depths={self.depths} must be ascending, in [1, {MAX_DEPTH}]")
        for technique, depth in [(t, 1) for t in self.techniques] + list(self.profile):
            BatchRule(1, technique, depth)  # "none", an unknown name or a bad depth raises

    def cells(self) -> set[tuple[str, int]]:
        """Every (technique, depth) this exploration may run."""
        return {(t, d) for t in self.techniques for d in self.depths} | set(self.profile)

    @staticmethod
    def from_dict(d: dict) -> Exploration:
        return Exploration(share=float(d.get("share", 0.0)),
                           techniques=tuple(d.get("techniques", ())),
                           depths=tuple(d.get("depths", ())),
                           profile=tuple((str(t), int(n)) for t, n in d.get("profile", ())),
                           profile_steps=int(d.get("profile_steps", 0)))


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
    explore: Exploration | None = None
    """What the engine tries besides the rules (None: nothing); the daemon adds it to the
    policies it serves, the stored policy has none."""

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
        """(technique, depth) for a decode batch of this size, by the rules alone.

        Example: TunedPolicy((BatchRule(4, "ngram", 3), BatchRule(64)), crossover=4).choose(2)
        == ("ngram", 3); .choose(8) == ("none", 0).
        """
        if batch_size > self.crossover:
            return "none", 0
        for r in self.rules:
            if batch_size <= r.max_batch:
                return r.technique, r.depth
        return self.rules[-1].technique, self.rules[-1].depth

    def _cells(self) -> set[tuple[str, int]]:
        rules = {(r.technique, r.depth) for r in self.rules}
        return rules | (self.explore.cells() if self.explore else set())

    @property
    def max_depth(self) -> int:
        """The deepest draft the engine may run under this policy, exploration included."""
        return max(d for _, d in self._cells())

    def techniques(self) -> set[str]:
        """The techniques the engine may run under this policy, exploration included."""
        return {t for t, _ in self._cells() if t != "none"}

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.explore is None:
            del d["explore"]
        return d

    @staticmethod
    def from_dict(d: dict) -> TunedPolicy:
        rules = tuple(BatchRule(**r) for r in d.get("rules", ()))
        rest = {k: v for k, v in d.items() if k not in ("rules", "explore")}
        if d.get("explore"):
            rest["explore"] = Exploration.from_dict(d["explore"])
        return TunedPolicy(rules=rules, **rest) if rules else TunedPolicy(**rest)


NEVER = TunedPolicy()


class StepChooser:
    """The engine's side of the serving policy: each decode step's (technique, depth).

    Answers like `policy.choose` except where the policy's exploration departs:
    during the profile (its first `profile_steps` decisions) every other one runs
    the next profile cell; afterwards a share `share` of decisions tries the
    next shallower or deeper depth of `depths` (where the policy says "none",
    the shallowest, with a technique in turn). A neighbour is what a local
    decision needs (should this batch size go one step deeper or shallower?)
    and costs little next to a far depth. One engine owns one chooser, calls it
    on its thread only and hands it its random stream, seeded once.

    >>> import numpy as np
    >>> chooser = StepChooser(np.random.default_rng(0))
    >>> rules = (BatchRule(4, "ngram", 2), BatchRule(64))
    >>> chooser.start(TunedPolicy(rules, crossover=4, explore=Exploration(
    ...     share=1.0, techniques=("ngram",), depths=(1, 2, 4))))
    >>> sorted({chooser.choose(2) for _ in range(50)}), chooser.choose(8)
    ([('ngram', 1), ('ngram', 4)], ('ngram', 1))
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self.policy: TunedPolicy = NEVER
        self._rng = rng
        self._profile_left = 0
        self._profile_turn = 0
        self._technique_turn = 0

    def start(self, policy: TunedPolicy) -> None:
        """Serve `policy` from the next decision on; its profile starts over."""
        self.policy = policy
        explore = policy.explore
        self._profile_left = explore.profile_steps if explore and explore.profile else 0
        self._profile_turn = 0

    def choose(self, batch_size: int) -> tuple[str, int]:
        chosen = self.policy.choose(batch_size)
        explore = self.policy.explore
        if explore is None or not explore.techniques:
            return chosen
        if self._profile_left > 0:
            self._profile_left -= 1
            if self._profile_left % 2 == 0:
                self._profile_turn += 1
                return explore.profile[(self._profile_turn - 1) % len(explore.profile)]
        if explore.share and self._rng.random() < explore.share:
            return self._neighbour(explore, chosen)
        return chosen

    def _neighbour(self, explore: Exploration, chosen: tuple[str, int]) -> tuple[str, int]:
        technique, depth = chosen
        if technique == "none" or not depth:
            self._technique_turn += 1
            turn = (self._technique_turn - 1) % len(explore.techniques)
            return explore.techniques[turn], explore.depths[0]
        options = ([d for d in explore.depths if d < depth][-1:]
                   + [d for d in explore.depths if d > depth][:1])
        if not options:
            return chosen
        return technique, options[int(self._rng.integers(len(options)))]
