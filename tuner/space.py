"""The search space: a TunedPolicy as Optuna parameters, and back.

Parameters (static, so TPE sees the same space in every trial):

    tech_<i>, depth_<i>   technique and depth for batch-size range i (depth unused with "none";
                          one of Capacity.depths, else of every depth to max_depth)
    crossover             0 (never speculate) or a range's upper end, up to the largest batch
                          the engine verifies (Capacity.spec_max_batch, itself offered where
                          it falls inside the last range): the search never proposes
                          speculation the engine would clamp
    pool_split            share of the KV pool lent to speculation, on a grid
    draft_vocab           MTP draft vocabulary, only when an MTP proposer is loaded

The study name carries a fingerprint of the space, so a changed space
(another proposer loaded, other ranges) starts a new study instead of
confusing the old one; the same space continues the same study.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import optuna

from engine.policy import BatchRule, TunedPolicy
from tuner.config import TunerConfig
from tuner.objective import Capacity


@dataclass(frozen=True)
class SearchSpace:
    ranges: tuple[int, ...]
    techniques: tuple[str, ...]
    """"none" first, then the loaded proposers."""
    max_depth: int
    depths: tuple[int, ...]
    """The depths offered (Capacity.depths up to max_depth)."""
    max_pool_split: float
    pool_split_step: float
    draft_vocabs: tuple[int, ...] = ()
    """The config's draft vocabularies the engine compiled; empty unless "mtp" is among the
    techniques (or the engine compiled none of them: its default then serves)."""
    two_objective: bool = False
    spec_max_batch: int = 1 << 30
    """The engine's largest verified batch: no crossover above it (module docstring)."""

    @staticmethod
    def build(config: TunerConfig, capacity: Capacity) -> SearchSpace:
        techniques = capacity.techniques
        deepest = max(1, min(config.max_depth, capacity.max_depth))
        depths = tuple(d for d in capacity.depths or range(1, deepest + 1) if 1 <= d <= deepest)
        compiled = [v for v in config.draft_vocabs if v in capacity.draft_vocabs]
        vocabs = tuple(compiled) if capacity.draft_vocabs else config.draft_vocabs
        return SearchSpace(
            ranges=config.ranges, techniques=techniques, max_depth=deepest, depths=depths or (1,),
            max_pool_split=config.max_pool_split, pool_split_step=config.pool_split_step,
            draft_vocabs=vocabs if "mtp" in techniques else (),
            two_objective=config.two_objective, spec_max_batch=capacity.spec_max_batch,
        )  # fmt: skip

    def fingerprint(self) -> str:
        """Eight hex digits that change whenever the space does."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def study_name(self, prefix: str) -> str:
        return f"{prefix}-{self.fingerprint()}"

    @property
    def crossovers(self) -> tuple[int, ...]:
        """0 and the range ends up to spec_max_batch (and it, when a range straddles it)."""
        cap = self.spec_max_batch
        return (0, *(r for r in self.ranges if r < cap), *((cap,) if cap <= self.ranges[-1] else ()))

    def pool_splits(self) -> list[float]:
        n = round(self.max_pool_split / self.pool_split_step)
        return [round(i * self.pool_split_step, 6) for i in range(n + 1)]

    def suggest(self, trial: optuna.Trial) -> TunedPolicy:
        """The policy of one trial (version 0, source "tuner")."""
        rules = []
        for i, upper in enumerate(self.ranges):
            technique = trial.suggest_categorical(f"tech_{i}", self.techniques)
            depth = trial.suggest_categorical(f"depth_{i}", self.depths)
            rules.append(BatchRule(upper, technique, 0 if technique == "none" else depth))
        crossover = trial.suggest_categorical("crossover", self.crossovers)
        split = trial.suggest_float("pool_split", 0.0, self.max_pool_split,
                                    step=self.pool_split_step) if self.max_pool_split > 0 else 0.0
        vocab = (trial.suggest_categorical("draft_vocab", self.draft_vocabs)
                 if self.draft_vocabs else 0)
        return TunedPolicy(rules=tuple(rules), crossover=int(crossover),
                           pool_split=round(float(split), 6), draft_vocab=int(vocab),
                           source="tuner")

    def params_of(self, policy: TunedPolicy) -> dict[str, Any] | None:
        """The trial parameters that give `policy`, or None when it lies outside the space."""
        if tuple(r.max_batch for r in policy.rules) != self.ranges:
            return None
        params: dict[str, Any] = {}
        for i, rule in enumerate(policy.rules):
            if rule.technique not in self.techniques or (rule.depth and rule.depth not in self.depths):
                return None
            params[f"tech_{i}"] = rule.technique
            params[f"depth_{i}"] = rule.depth or self.depths[0]
        if policy.crossover not in self.crossovers:
            return None
        params["crossover"] = policy.crossover
        if self.max_pool_split > 0:
            if round(policy.pool_split, 6) not in self.pool_splits():
                return None
            params["pool_split"] = round(policy.pool_split, 6)
        elif policy.pool_split:
            return None
        if self.draft_vocabs:
            if policy.draft_vocab not in self.draft_vocabs:
                return None
            params["draft_vocab"] = policy.draft_vocab
        return params
