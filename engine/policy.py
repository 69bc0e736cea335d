"""The runtime decode policy: an immutable value the engine swaps between steps.

A policy says, for each batch-size range, which technique drafts and how deep;
the crossover batch size above which speculation is off whatever the table
says; and the pool split, the share of the fixed KV pool that speculation may
hold instead of tenant pages. The tuner produces new versions; the engine
applies them atomically at the start of a step and stamps every StepStats
with the version that produced it.

A policy may also name tenants (`TenantRule`): in a speculating step, a row
whose request belongs to such a tenant drafts with the tenant's technique and
depth instead of the batch rule's (`choose_row`), so one step's call carries
rows of several depths, each verified at its own (engine/step/ragged_step.py).

A served policy may also carry an `Exploration`: a small share of decode
steps tries a neighbouring (technique, depth) cell, and a short startup
profile measures cells the telemetry lacks, so the tuner's model stays fed.
The policy stays a value; `StepChooser` (engine/step/chooser.py), owned by the engine and drawing
from the engine's seeded random stream, applies the exploration step by step, to the rows
no tenant rule covers. Such steps are stamped with the technique and depth they ran and
the policy's version.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.types import EngineCapacity

TECHNIQUES = ("none", "ngram", "mtp", "early_exit", "draft")
SOURCES = ("default", "tuner", "admin")
MAX_POOL_SPLIT = 0.5
MAX_DEPTH = 8
MAX_BATCH = 1 << 30
"""Largest batch-size bound a rule or the crossover may name ("every batch size")."""
MAX_RULES = 64
"""Most batch rules in one policy (the engine walks them every decode step)."""
MAX_DRAFT_VOCAB = 1 << 24
MAX_VERSION = (1 << 31) - 1
"""Versions fit a 32-bit integer column on every database."""
MAX_PROFILE_STEPS = 1 << 30
MAX_TENANT_NAME = 128
"""Longest tenant name (the tenants table's column)."""


class PolicyError(ValueError):
    """An invalid policy; `field` names the value to blame (e.g. "rules[1].depth")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def within(self, prefix: str) -> PolicyError:
        """The same error for a field nested under `prefix` (e.g. "rules[1]")."""
        return PolicyError(f"{prefix}.{self.field}" if self.field else prefix, f"{prefix}: {self}")


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi]; PolicyError for a bool, a float or anything else.

    >>> _int("depth", 3, 0, 8)
    3
    >>> _int("depth", 2.5, 0, 8)
    Traceback (most recent call last):
    ...
    engine.policy.PolicyError: depth=2.5 must be an integer
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PolicyError(name, f"{name}={value!r} must be an integer")
    if not lo <= value <= hi:
        raise PolicyError(name, f"{name}={value} must be in [{lo}, {hi}]")
    return int(value)


def _real(name: str, value: Any, lo: float, hi: float) -> float:
    """`value` as a finite float in [lo, hi] (an int is fine, a bool or NaN is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PolicyError(name, f"{name}={value!r} must be a number")
    # The range first: math.isfinite raises OverflowError on an int too large for a float.
    if not (lo <= value <= hi and math.isfinite(value)):
        raise PolicyError(name, f"{name}={value!r} must be a finite number in [{lo}, {hi}]")
    return float(value)


def _technique(name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in TECHNIQUES:
        raise PolicyError(name, f"{name}={value!r} is not one of {TECHNIQUES}")
    return value


def _keys(name: str, d: Any, cls: type) -> dict:
    """`d` if it is a JSON object whose keys are all fields of `cls`, else PolicyError."""
    if not isinstance(d, dict):
        kind = type(d).__name__
        raise PolicyError(name, f"{name or cls.__name__} must be a JSON object, got {kind}")
    unknown = sorted(str(k) for k in set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise PolicyError(f"{name}.{unknown[0]}" if name else unknown[0],
                          f"unknown policy field(s) {unknown} in {name or 'the policy'}")
    return d


def _rule(cls: type, d: Any, required: str, what: str) -> Any:
    """A `cls` rule from its JSON object `d`, which must name `required` (PolicyError otherwise)."""
    d = _keys("", d, cls)
    if required not in d:
        raise PolicyError(required, f"{what} needs {required}")
    return cls(**d)


def _set(obj: Any, **values: Any) -> None:
    """Store normalized field values on a frozen dataclass (from its __post_init__)."""
    for k, v in values.items():
        object.__setattr__(obj, k, v)


def _check_choice(rule: Any) -> None:
    """Normalize and check a rule's technique, depth and max_batch (from its __post_init__)."""
    _set(rule, technique=_technique("technique", rule.technique),
         max_batch=_int("max_batch", rule.max_batch, 1, MAX_BATCH),
         depth=_int("depth", rule.depth, 0, MAX_DEPTH))
    if (rule.technique == "none") != (rule.depth == 0):
        raise PolicyError("depth", f"technique={rule.technique!r} and depth={rule.depth} "
                          "disagree (depth 0 exactly when the technique is 'none')")


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
        _check_choice(self)

    @staticmethod
    def from_dict(d: Any) -> BatchRule:
        """A rule from its JSON object; PolicyError names the field to blame."""
        return _rule(BatchRule, d, "max_batch", "a batch rule")


@dataclass(frozen=True)
class TenantRule:
    """Technique and depth for one tenant's rows in steps of batch size up to max_batch.

    Applies only where the policy speculates at all (batch size <= crossover); above
    max_batch the tenant's rows follow the batch rules like every other row.
    """

    tenant: str
    """The tenant's name, as requests carry it."""
    technique: str = "none"
    """One of TECHNIQUES ("none": the tenant's rows do not draft)."""
    depth: int = 0
    """Draft tokens per row per step (0 with technique "none")."""
    max_batch: int = MAX_BATCH
    """Largest batch size at which the rule applies."""

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not 0 < len(self.tenant) <= MAX_TENANT_NAME:
            raise PolicyError("tenant", f"tenant={self.tenant!r} must be a name of 1 to "
                                        f"{MAX_TENANT_NAME} characters")
        _check_choice(self)

    @staticmethod
    def from_dict(d: Any) -> TenantRule:
        """A tenant rule from its JSON object; PolicyError names the field to blame."""
        return _rule(TenantRule, d, "tenant", "a tenant rule")


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
    catch_up: tuple[str, ...] = ()
    """Techniques of `techniques` whose first draft for a row fills a cache of their own from
    the row's whole context (the draft model): where the policy says none they are tried only
    at batch sizes it speculates at (up to its crossover): a step that fills such caches for a
    large batch prefills every row's context and costs several plain steps."""

    def __post_init__(self) -> None:
        techniques = tuple(_technique(f"techniques[{i}]", t)
                           for i, t in enumerate(_seq("techniques", self.techniques)))
        catch_up = tuple(_technique(f"catch_up[{i}]", t)
                         for i, t in enumerate(_seq("catch_up", self.catch_up)))
        if set(catch_up) - set(techniques):
            raise PolicyError("catch_up", f"catch_up={catch_up} must be among techniques={techniques}")
        depths = tuple(_int(f"depths[{i}]", d, 1, MAX_DEPTH)
                       for i, d in enumerate(_seq("depths", self.depths)))
        profile = tuple(_cell(f"profile[{i}]", c)
                        for i, c in enumerate(_seq("profile", self.profile)))
        _set(self, share=_real("share", self.share, 0.0, 1.0), techniques=techniques,
             depths=depths, profile=profile, catch_up=catch_up,
             profile_steps=_int("profile_steps", self.profile_steps, 0, MAX_PROFILE_STEPS))
        if "none" in techniques:
            raise PolicyError("techniques", f"techniques={techniques} may not include 'none'")
        if techniques and not depths:
            raise PolicyError("depths", f"techniques={techniques} need at least one depth to try")
        if list(depths) != sorted(set(depths)):
            raise PolicyError("depths", f"depths={depths} must be strictly ascending")

    def cells(self) -> set[tuple[str, int]]:
        """Every (technique, depth) this exploration may run."""
        return {(t, d) for t in self.techniques for d in self.depths} | set(self.profile)

    @staticmethod
    def from_dict(d: Any) -> Exploration:
        """An exploration from its JSON object (lists for tuples); PolicyError if invalid."""
        return Exploration(**_keys("", d, Exploration))


def _seq(name: str, value: Any) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise PolicyError(name, f"{name}={value!r} must be a list")
    if len(value) > MAX_RULES:
        raise PolicyError(name, f"{name} has {len(value)} entries (at most {MAX_RULES})")
    return tuple(value)


def _parsed(name: str, parse: Callable[[Any], Any], value: Any) -> Any:
    """parse(value), its PolicyError placed under `name` (e.g. "rules[1]")."""
    try:
        return parse(value)
    except PolicyError as exc:
        raise exc.within(name) from None


def _cell(name: str, value: Any) -> tuple[str, int]:
    """A (technique, depth) pair that speculates, e.g. ("ngram", 2)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise PolicyError(name, f"{name}={value!r} must be a [technique, depth] pair")
    technique = _technique(name, value[0])
    if technique == "none":
        raise PolicyError(name, f"{name}={list(value)} must speculate (not 'none')")
    return technique, _int(name, value[1], 1, MAX_DEPTH)


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
    tenants: tuple[TenantRule, ...] = ()
    """Per-tenant choices that override the batch rules for that tenant's rows (`choose_row`);
    at most one rule per tenant."""

    def __post_init__(self) -> None:
        rules = _seq("rules", self.rules)
        if not rules:
            raise PolicyError("rules", "a policy needs at least one batch rule")
        for i, r in enumerate(rules):
            if not isinstance(r, BatchRule):
                raise PolicyError(f"rules[{i}]", f"rules[{i}] must be a BatchRule, got {r!r}")
        bounds = [r.max_batch for r in rules]
        if bounds != sorted(set(bounds)):
            raise PolicyError("rules", f"rule max_batch values {bounds} must be strictly ascending")
        if not isinstance(self.source, str) or self.source not in SOURCES:
            raise PolicyError("source", f"source={self.source!r} is not one of {SOURCES}")
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) for k in self.extra):
            raise PolicyError("extra", "extra must be an object with string keys")
        if self.explore is not None and not isinstance(self.explore, Exploration):
            raise PolicyError("explore", f"explore must be an Exploration, got {self.explore!r}")
        tenants = _seq("tenants", self.tenants)
        for i, t in enumerate(tenants):
            if not isinstance(t, TenantRule):
                raise PolicyError(f"tenants[{i}]", f"tenants[{i}] must be a TenantRule, got {t!r}")
            if any(u.tenant == t.tenant for u in tenants[:i]):
                raise PolicyError(f"tenants[{i}].tenant", f"tenants[{i}]: tenant {t.tenant!r} "
                                                          "has more than one rule")
        _set(self, rules=rules, tenants=tenants, crossover=_int("crossover", self.crossover, 0, MAX_BATCH),
             pool_split=_real("pool_split", self.pool_split, 0.0, MAX_POOL_SPLIT),
             version=_int("version", self.version, 0, MAX_VERSION),
             draft_vocab=_int("draft_vocab", self.draft_vocab, 0, MAX_DRAFT_VOCAB))

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

    def choose_row(self, batch_size: int, tenant: str) -> tuple[str, int]:
        """(technique, depth) for one row of `tenant` in a decode batch of this size: its
        tenant rule where one covers this batch size, else `choose` (exploration aside).

        >>> p = TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=8,
        ...                 tenants=(TenantRule("code", "mtp", 4, max_batch=4),))
        >>> p.choose_row(2, "code"), p.choose_row(6, "code"), p.choose_row(2, "chat"), p.choose_row(9, "code")
        (('mtp', 4), ('ngram', 2), ('ngram', 2), ('none', 0))
        """
        if batch_size > self.crossover:
            return "none", 0
        rule = self.tenant_rule(batch_size, tenant)
        return (rule.technique, rule.depth) if rule is not None else self.choose(batch_size)

    def tenant_rule(self, batch_size: int, tenant: str) -> TenantRule | None:
        """The tenant rule that covers `tenant`'s rows at this batch size (crossover aside)."""
        for t in self.tenants:
            if t.tenant == tenant:
                return t if batch_size <= t.max_batch else None
        return None

    def _cells(self) -> set[tuple[str, int]]:
        rules = {(r.technique, r.depth) for r in self.rules} | {(t.technique, t.depth) for t in self.tenants}
        return rules | (self.explore.cells() if self.explore else set())

    @property
    def max_depth(self) -> int:
        """The deepest draft the engine may run under this policy, exploration and tenant
        rules included."""
        return max(d for _, d in self._cells())

    def techniques(self) -> set[str]:
        """The techniques the engine may run under this policy, exploration and tenant rules
        included."""
        return {t for t, _ in self._cells() if t != "none"}

    def to_dict(self) -> dict:
        """The policy as a JSON object (lists for tuples); fields still at their empty default
        (explore, tenants) are left out, so policies without them keep their stored body."""
        d = asdict(self)
        if self.explore is None:
            del d["explore"]
        if not self.tenants:
            del d["tenants"]
        else:
            d["tenants"] = [dict(t) for t in d["tenants"]]
        return d

    @staticmethod
    def from_dict(d: Any) -> TunedPolicy:
        """A policy from its JSON object (`to_dict`'s shape; a missing field takes its
        default). Every path that builds a policy from data comes here: PolicyError (a
        ValueError) names the field to blame, e.g. "rules[0].depth".

        >>> TunedPolicy.from_dict({"rules": [{"max_batch": 4, "technique": "ngram", "depth": 2},
        ...                                  {"max_batch": 64}], "crossover": 4}).choose(3)
        ('ngram', 2)
        >>> TunedPolicy.from_dict({"rules": [{"max_batch": 1.5}]})
        Traceback (most recent call last):
        ...
        engine.policy.PolicyError: rules[0]: max_batch=1.5 must be an integer
        """
        rest = dict(_keys("", d, TunedPolicy))
        for name, parse in (("rules", BatchRule.from_dict), ("tenants", TenantRule.from_dict)):
            if name in rest:
                rest[name] = tuple(_parsed(f"{name}[{i}]", parse, x)
                                   for i, x in enumerate(_seq(name, rest[name])))
        if rest.get("explore") is not None:
            try:
                rest["explore"] = Exploration.from_dict(rest["explore"])
            except PolicyError as exc:
                raise exc.within("explore") from None
        return TunedPolicy(**rest)


def check_servable(policy: Any, capacity: EngineCapacity) -> None:
    """PolicyError (a ValueError) unless an engine of this capacity can serve `policy`: it is
    a TunedPolicy whose every field passes the constructor's checks, every technique has a loaded
    proposer, no depth exceeds the compiled verify buckets, and an MTP draft vocabulary is
    one the heads compiled (where the proposer lists them, as the real one always does). EngineCore and
    FakeEngine both call it from `set_policy`, so what the fake accepts the real engine accepts."""
    if not isinstance(policy, TunedPolicy):
        raise PolicyError("policy", f"a policy must be a TunedPolicy, got {type(policy).__name__}")
    TunedPolicy.from_dict(policy.to_dict())  # one unpickled or built around __post_init__ too
    for i, t in enumerate(policy.tenants):  # named first: the batch rules' message would blame "rules"
        if t.technique != "none" and t.technique not in capacity.proposers:
            raise PolicyError(f"tenants[{i}].technique", f"tenants[{i}]: technique {t.technique!r} "
                              "has no loaded proposer")
        if t.depth > capacity.max_depth:
            raise PolicyError(f"tenants[{i}].depth", f"tenants[{i}]: depth {t.depth} exceeds the "
                              f"engine's max_depth {capacity.max_depth} (its largest verify depth)")
    missing = policy.techniques() - set(capacity.proposers)
    if missing:
        raise PolicyError("rules", f"policy uses techniques without a loaded proposer: "
                                   f"{sorted(missing)}")
    if policy.max_depth > capacity.max_depth:
        raise PolicyError("rules", f"policy depth {policy.max_depth} exceeds the engine's "
                                   f"max_depth {capacity.max_depth} (its largest verify depth)")
    vocabs = capacity.proposers["mtp"].draft_vocabs if "mtp" in capacity.proposers else ()
    if (policy.draft_vocab and "mtp" in policy.techniques() and vocabs
            and policy.draft_vocab not in vocabs):  # no list: the proposer takes any (a fake)
        raise PolicyError("draft_vocab", f"draft_vocab={policy.draft_vocab} is not one of the "
                                         f"MTP proposer's compiled vocabularies {vocabs}")


NEVER = TunedPolicy()


def speculates_up_to(policy: TunedPolicy) -> int:
    """The largest batch size at which `policy`'s rules speculate (0: none; MAX_BATCH: every).

    >>> speculates_up_to(TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=64))
    4
    >>> speculates_up_to(TunedPolicy((BatchRule(4), BatchRule(64, "mtp", 2)), crossover=32))
    32
    """
    top, low = 0, 0
    for i, r in enumerate(policy.rules):
        upper = MAX_BATCH if i == len(policy.rules) - 1 else r.max_batch
        if r.technique != "none" and low < policy.crossover:
            top = max(top, min(upper, policy.crossover))
        low = r.max_batch
    for t in policy.tenants:  # a tenant's rows may draft where the batch rules say none
        if t.technique != "none":
            top = max(top, min(t.max_batch, policy.crossover))
    return top
