"""Speculation stand-ins of the fake engine (engine/fake.py): proposers and a cost model.

`FakeProposer.accepts` decides by a hash how many drafts a row accepts, so
acceptance is known exactly; `FakeCost` prices a step as a linear model of
its batch size and the token rows it verifies (each row 1 + its drafts, as
the engine's ragged steps run them), so goodput per policy is known exactly too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class FakeProposer:
    """A proposer stand-in: acceptance per draft position and the memory it claims."""

    name: str
    acceptance: tuple[float, ...] = (0.8, 0.7, 0.6, 0.5)
    """P(accept position i | positions before accepted); the last value repeats."""
    resident: int = 0
    """Accelerator bytes it claims to hold whatever the load (capacity() reports them)."""
    per_draft: int = 0
    """Bytes it claims per speculating sequence per draft token."""
    max_depth: int = 8
    """Most drafts it makes per step (e.g. MTP heads); the engine's own max_depth also limits."""
    draft_vocabs: tuple[int, ...] = ()
    """Draft vocabularies it claims to have compiled."""

    def accepts(self, key: str, depth: int, scale: float = 1.0) -> int:
        """Leading drafts accepted: position i passes when hash(key, i) < acceptance[i] * scale.

        >>> FakeProposer("x", (1.0,)).accepts("r:0", 3), FakeProposer("x", (0.0,)).accepts("r:0", 3)
        (3, 0)
        """
        for i in range(depth):
            rate = min(1.0, self.acceptance[min(i, len(self.acceptance) - 1)] * scale)
            digest = hashlib.blake2b(f"{key}:{i}".encode(), digest_size=8).digest()
            if int.from_bytes(digest, "little") / 2**64 >= rate:
                return i
        return depth


@dataclass(frozen=True)
class FakeCost:
    """Simulated step time, reported instead of the measured one.

    step_ms = base_ms + per_seq_ms * B + per_token_ms * R + per_sampled_ms * S * R / B + propose_ms
    with R = B + drafts the token rows the rows run (each row 1 + its own drafts, as in the
    engine's ragged steps), S the rows that sample (temperature > 0), propose_ms =
    per_draft_ms * drafts and drafts = B * depth unless given: in a step whose rows draft at
    several depths, the draft tokens of all rows (a sampled row counts at the mean R / B).

    >>> [round(ms, 3) for ms in FakeCost().times(4, 2) + FakeCost().times(4, 2, drafts=3)]
    [7.4, 0.4, 6.65, 0.15]
    """

    base_ms: float = 5.0
    per_seq_ms: float = 0.2
    per_token_ms: float = 0.1
    per_draft_ms: float = 0.05
    per_sampled_ms: float = 0.0

    def times(self, batch: int, depth: int, sampled: int = 0,
              drafts: int | None = None) -> tuple[float, float]:
        """(step_ms, propose_ms) for a decode batch of `batch` rows drafting `drafts` tokens
        together (default: each `depth`)."""
        drafts = batch * depth if drafts is None else drafts
        propose, rows = self.per_draft_ms * drafts, batch + drafts
        step = self.base_ms + self.per_seq_ms * batch + self.per_token_ms * rows
        return step + self.per_sampled_ms * sampled * rows / max(batch, 1) + propose, propose
