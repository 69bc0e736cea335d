"""The engine's side of the serving policy: each decode step's (technique, depth) per row.

`TunedPolicy` (engine/policy.py) is a value; `StepChooser` applies it step by
step on the engine's thread: the rows of a tenant with a rule that covers the
batch size take the rule's choice, the others the batch rules' choice with the
policy's exploration (one decision per step, drawn from the engine's seeded
random stream). A technique whose shapes are still compiling, or a batch above
the engine's largest verified batch, decodes plainly.

The startup profile (engine.policy.Exploration.profile) measures each cell the
telemetry lacks on live traffic, at decode batches of up to PROFILE_MAX_BATCH rows;
`observe` retires a cell whose first steps
emitted tokens at under half the rate of the policy's own steps interleaved
with them (a draft that cannot pay on this traffic and hardware: the two rates
are measured side by side, so the test needs no machine constant), so the
profile does not spend its other turns on it. Its few steps are still recorded,
and exploration keeps visiting techniques where the policy says "none".

Where the policy says "none", `observe` also compares each exploration step
with the plain steps at its batch size: a technique that emitted under
`EXPLORE_WORSE` of their token rate skips its next turns at that batch bucket,
twice as many after each such miss in a row (up to `EXPLORE_MAX_SKIP`), and
one that kept up is tried every turn again. At a large batch a technique that
does not pay costs a whole step of every row, so trying each technique in turn
there would cost the busiest traffic the most. Acceptance does not depend on
batch size and a step's cost is predicted from the rows it runs (tuner.model),
so the fewer visits still keep the tuner's estimates fresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.policy import MAX_BATCH, NEVER, Exploration, TunedPolicy, speculates_up_to
from engine.types import pow2_bucket

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("crossover.engine")

PLAIN = ("none", 0)
PROFILE_OWN = ("policy", -1)
"""`observe`'s key for the profile's turns that follow the policy."""
PROFILE_MIN_STEPS = 4
"""Decode steps without prefill a profile cell and the policy's own choices each need before
the cell can be retired."""
PROFILE_RETIRE = 0.5
"""A profile cell whose steps emitted tokens at less than this share of the rate (tokens per
ms of step time) of the policy's own steps in the same profile is retired: it cannot pay on
this traffic, and each further step of it is the profile's costliest (see `observe`)."""
PROFILE_FIRST_STEPS = 2
PROFILE_FIRST_RETIRE = 0.25
"""A cell already this far below the policy's rate after PROFILE_FIRST_STEPS steps each is
retired then: a sequential test, so a cell that clearly cannot pay (early exit at depth 8
beside n-gram on copy text: ~0.2 of its rate) costs two steps, not four."""
PROFILE_MAX_BATCH = 4
"""Largest decode batch a profile turn runs at: a turn drafts and verifies every row of its
step at the cell's depth, so at batch 8 it costs about eight times what it learns at batch 1
(acceptance is per row; a step's cost follows from the rows it runs, tuner.model). A busier
engine keeps its profile turns for when the load dips."""
EXPLORE_WORSE = 0.8
"""An exploration step where the policy says "none" misses when it emitted tokens at less than
this share of the rate of plain steps at the same batch size (module doc)."""
EXPLORE_MAX_SKIP = 15
"""Most turns a technique skips at a batch bucket after misses in a row (1, 3, 7, 15)."""
PLAIN_EWMA = 0.2
"""Weight of the newest plain step in the running step time per batch size `observe` keeps."""


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
    >>> from engine.policy import BatchRule, TenantRule
    >>> chooser = StepChooser(np.random.default_rng(0))
    >>> rules = (BatchRule(4, "ngram", 2), BatchRule(64))
    >>> chooser.start(TunedPolicy(rules, crossover=4, explore=Exploration(
    ...     share=1.0, techniques=("ngram",), depths=(1, 2, 4))))
    >>> sorted({chooser.choose(2) for _ in range(50)}), chooser.choose(8)
    ([('ngram', 1), ('ngram', 4)], ('ngram', 1))
    >>> chooser.start(TunedPolicy(rules, crossover=4, tenants=(TenantRule("copy", "ngram", 8),)))
    >>> chooser.choose_rows(["copy", "chat", "copy"])
    [('ngram', 8), ('ngram', 2), ('ngram', 8)]
    >>> chooser.choose_rows(["copy"] * 5)
    [('none', 0), ('none', 0), ('none', 0), ('none', 0), ('none', 0)]
    """

    def __init__(self, rng: np.random.Generator, spec_max_batch: int = MAX_BATCH) -> None:
        self.policy: TunedPolicy = NEVER
        self._rng = rng
        self.spec_max_batch = spec_max_batch
        """The largest batch the engine verifies: above it every step decodes plainly, and a
        policy whose rules speculate above it is served clamped (`clamped`, logged)."""
        self.clamped: dict | None = None
        """{"policy_version", "speculates_up_to", "served_up_to"} while the policy is clamped."""
        self.ready: Callable[[str], bool] = lambda technique: True
        """Whether a technique's shapes are compiled (engine/warmup/warm.py); one that is not yet
        decodes plainly instead, so serving never compiles."""
        self._profile_left = 0
        self._profile_turn = 0
        self._technique_turn = 0
        self._last: tuple[str, int] | None = None  # the profile's last decision: a cell, or PROFILE_OWN
        self._tally: dict = {}  # cell (or PROFILE_OWN) -> [steps, tokens, ms] during the profile
        self.retired: list[tuple[str, int]] = []
        """Profile cells `observe` retired, in order (since the last `start`)."""
        self._explored: tuple[str, int] | None = None  # the last technique exploration's cell
        self._plain_ms: dict[int, float] = {}  # batch size -> running plain step time (ms)
        self._misses: dict[tuple[str, int], list[int]] = {}  # (technique, bucket) -> [misses, skips left]

    def start(self, policy: TunedPolicy) -> None:
        """Serve `policy` from the next decision on; its profile starts over."""
        self.policy = policy
        explore = policy.explore
        self._profile_left = explore.profile_steps if explore and explore.profile else 0
        self._profile_turn = 0
        self._last, self._tally, self.retired = None, {}, []
        self._explored, self._misses = None, {}
        top = speculates_up_to(policy)
        self.clamped = None
        if top > self.spec_max_batch:
            self.clamped = {"policy_version": policy.version, "speculates_up_to": top,
                            "served_up_to": self.spec_max_batch}
            log.warning("policy v%d speculates up to batch %d; this engine verifies batches up to %d "
                        "only: larger batches decode plainly", policy.version, top, self.spec_max_batch)

    def plain_only(self, batch_size: int) -> bool:
        """Whether every choice for a batch of `batch_size` rows is plain decoding, whatever the
        exploration's turn: the batch is above spec_max_batch or the policy runs no technique."""
        return batch_size > self.spec_max_batch or not self.policy.techniques()

    def cap_status(self) -> dict:
        """{"max_batch": spec_max_batch, "clamped": `clamped`} for the engine's status."""
        return {"max_batch": self.spec_max_batch, "clamped": self.clamped}

    def choose(self, batch_size: int, prefill: bool = False) -> tuple[str, int]:
        """(technique, depth) for this step's rows without a tenant rule: `_choose`, or plain
        decoding where the technique cannot run here (above spec_max_batch, or its shapes
        still compiling). One call per decode step (the profile counts them). A step that
        also prefills (`prefill`) takes the policy's choice and no exploration or profile
        turn: `observe` leaves such steps out, so a turn there would only stretch the step
        that gives a new request its first token."""
        if prefill:
            self._last = self._explored = None
            return self._runnable(batch_size, self.policy.choose(batch_size))
        return self._runnable(batch_size, self._choose(batch_size))

    def choose_rows(self, tenants: Sequence[str], prefill: bool = False) -> list[tuple[str, int]]:
        """(technique, depth) for each row of a decode batch, given its rows' tenants: a tenant
        rule's choice where one covers the batch size, else the step's `choose` (decided once,
        exploration included, whether or not any row uses it; `prefill` as there)."""
        n = len(tenants)
        shared = self.choose(n, prefill)
        if not self.policy.tenants or n > self.policy.crossover:
            return [shared] * n
        out = []
        for tenant in tenants:
            rule = self.policy.tenant_rule(n, tenant)
            out.append(shared if rule is None else self._runnable(n, (rule.technique, rule.depth)))
        return out

    def _runnable(self, batch_size: int, choice: tuple[str, int]) -> tuple[str, int]:
        technique = choice[0]
        if technique != "none" and (batch_size > self.spec_max_batch or not self.ready(technique)):
            return PLAIN
        return choice

    def _choose(self, batch_size: int) -> tuple[str, int]:
        chosen = self.policy.choose(batch_size)
        explore = self.policy.explore
        if explore is None or not explore.techniques:
            return chosen
        self._last = self._explored = None
        if self._profile_left > 0 and batch_size <= PROFILE_MAX_BATCH:
            self._profile_left -= 1
            if self._profile_left % 2 == 0:
                cells = [c for c in explore.profile if c not in self.retired]
                if cells:
                    self._profile_turn += 1
                    self._last = cells[(self._profile_turn - 1) % len(cells)]
                    return self._last
                self._profile_left = 0  # every cell retired: the profile is over
            else:
                self._last = PROFILE_OWN
                return chosen
        if explore.share and self._rng.random() < explore.share:
            return self._neighbour(explore, chosen, batch_size)
        return chosen

    def observe(self, technique: str, depth: int, tokens: int, ms: float, prefill_tokens: int = 0,
                batch: int = 0) -> None:
        """What the last decode step did (its step-level technique and depth, tokens emitted,
        step time): during the profile, tallied for the cell that step was decided for (the
        policy's own choices apart), and a cell retired once both have `PROFILE_MIN_STEPS`
        steps and the cell's token rate is under `PROFILE_RETIRE` of the policy's (or both
        `PROFILE_FIRST_STEPS` and under `PROFILE_FIRST_RETIRE`). A step that
        also prefilled, or that did not run what was decided (plain fallback), is left out.

        >>> import numpy as np
        >>> from engine.policy import BatchRule
        >>> chooser = StepChooser(np.random.default_rng(0))
        >>> chooser.start(TunedPolicy((BatchRule(4, "ngram", 4), BatchRule(64)), crossover=4,
        ...     explore=Exploration(share=0.0, techniques=("ngram", "early_exit"), depths=(1, 2, 4, 8),
        ...                         profile=(("ngram", 8), ("early_exit", 8)), profile_steps=40)))
        >>> for _ in range(24):  # the policy's ngram@4 emits 4 tokens in 50 ms, early exit 2 in 140
        ...     t, d = chooser.choose(1)
        ...     chooser.observe(t, d, {"ngram": 4, "early_exit": 2}[t],
        ...                     {"ngram": 50.0, "early_exit": 140.0}[t])
        >>> chooser.retired, chooser.choose(1), chooser.choose(1), chooser.choose(1), chooser.choose(1)
        ([('early_exit', 8)], ('ngram', 4), ('ngram', 8), ('ngram', 4), ('ngram', 8))

        `batch` (the step's batch size) lets it judge technique exploration (`_judge`).
        """
        last, self._last = self._last, None
        explored, self._explored = self._explored, None
        if prefill_tokens or ms <= 0:
            return
        if batch:
            self._judge(explored, technique, depth, tokens, ms, batch)
        if last is None:
            return
        if last != PROFILE_OWN and (technique, depth) != last:
            return
        tally = self._tally.setdefault(last, [0, 0, 0.0])
        tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + tokens, tally[2] + ms
        own = self._tally.get(PROFILE_OWN)
        if own is None or own[0] < PROFILE_FIRST_STEPS:
            return
        for cell, (n, emitted, spent) in self._tally.items():
            bar = PROFILE_RETIRE if min(n, own[0]) >= PROFILE_MIN_STEPS else PROFILE_FIRST_RETIRE
            if (cell != PROFILE_OWN and cell not in self.retired and n >= PROFILE_FIRST_STEPS
                    and emitted / spent < bar * own[1] / own[2]):
                self.retired.append(cell)
                log.info("profile: %s@%d retired after %d steps (%.1f tokens/s; the policy's own "
                         "steps %.1f)", cell[0], cell[1], n, 1e3 * emitted / spent, 1e3 * own[1] / own[2])

    def _judge(self, explored: tuple[str, int] | None, technique: str, depth: int, tokens: int,
               ms: float, batch: int) -> None:
        """Keep the running plain step time at `batch`; count a technique exploration step
        (`explored`, if it ran as decided) a miss or a hit against it (module doc).

        >>> import numpy as np
        >>> from engine.policy import BatchRule
        >>> chooser = StepChooser(np.random.default_rng(0))
        >>> chooser.start(TunedPolicy((BatchRule(64),), crossover=0, explore=Exploration(
        ...     share=1.0, techniques=("early_exit",), depths=(1, 2))))
        >>> def turns(n): return [chooser.choose(30)[0] for _ in range(n)]
        >>> chooser.observe("none", 0, 30, 190.0, batch=30)  # plain at batch 30: 0.158 tokens/ms
        >>> turns(1); chooser.observe("early_exit", 1, 38, 500.0, batch=30)  # 0.076: a miss
        ['early_exit']
        >>> turns(2); chooser.observe("early_exit", 1, 38, 500.0, batch=30)  # one turn skipped, a miss
        ['none', 'early_exit']
        >>> turns(4); chooser.observe("early_exit", 1, 40, 200.0, batch=30)  # three skipped, a hit
        ['none', 'none', 'none', 'early_exit']
        >>> turns(2)
        ['early_exit', 'early_exit']
        """
        if technique == "none" and not depth:
            old = self._plain_ms.get(batch)
            self._plain_ms[batch] = ms if old is None else old + PLAIN_EWMA * (ms - old)
            return
        if explored is None or explored != (technique, depth) or batch not in self._plain_ms:
            return
        state = self._misses.setdefault((technique, pow2_bucket(batch)), [0, 0])
        if tokens / ms < EXPLORE_WORSE * batch / self._plain_ms[batch]:
            state[0] += 1
            state[1] = min(2 ** state[0] - 1, EXPLORE_MAX_SKIP)
        else:
            state[0] = state[1] = 0

    def _skips(self, technique: str, batch: int) -> bool:
        """Whether `technique`'s exploration turn at `batch` is skipped (counting it down)."""
        state = self._misses.get((technique, pow2_bucket(batch)))
        if not state or state[1] <= 0:
            return False
        state[1] -= 1
        return True

    def _neighbour(self, explore: Exploration, chosen: tuple[str, int],
                   batch_size: int) -> tuple[str, int]:
        technique, depth = chosen
        if technique == "none" or not depth:
            tried = [t for t in explore.techniques
                     if t not in explore.catch_up or batch_size <= self.policy.crossover]
            if not tried:
                return chosen
            self._technique_turn += 1
            turn = tried[(self._technique_turn - 1) % len(tried)]
            if self._skips(turn, batch_size):
                return chosen
            self._explored = (turn, explore.depths[0])
            return self._explored
        options = ([d for d in explore.depths if d < depth][-1:]
                   + [d for d in explore.depths if d > depth][:1])
        if not options:
            return chosen
        return technique, options[int(self._rng.integers(len(options)))]
