"""Draft proposers for speculative decoding.

A proposer looks at running sequences and suggests up to `depth` next tokens
for each; the target model then verifies them all in one forward
(engine/step/core.py). Proposals are deterministic (a point mass), which is what
lets engine/execute/sampling.verify accept a draft exactly when it is the target's own
draw at that position: lossless, and accepted with probability p(draft).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from engine.execute.sequence import Sequence


class Proposer(ABC):
    """Suggests draft tokens; knows the memory it costs."""

    name: str = "?"

    @abstractmethod
    def propose(self, seqs: list[Sequence], depth: int) -> list[list[int]]:
        """Up to `depth` draft tokens per sequence (may be empty: no guess)."""

    wants_hidden: bool = False
    """Whether the core must keep each sequence's newest final hidden state (MTP heads)."""
    max_depth: int = 8
    """Most draft tokens this proposer can make per step."""

    def bind(self, core) -> None:
        """Called once when the engine core loads this proposer (model proposers take its runner)."""

    def configure(self, policy) -> None:
        """Called when a new policy takes effect (draft vocabulary, pool split)."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: free what the proposer holds for it."""

    def warmup(self, progress: bool = True) -> None:
        """Compile every shape `propose` may use."""

    def resident_bytes(self) -> int:
        """Accelerator memory held whatever the load (weights, tables)."""
        return 0

    def per_sequence_bytes(self, depth: int) -> int:
        """Accelerator memory each speculating sequence adds (draft KV, buffers)."""
        return 0


@dataclass(frozen=True)
class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n
    tokens (n from max_n down to min_n) in its prompt and output, and propose
    the tokens that followed it.

    Example: tokens [5, 6, 7, 9, 5, 6] with n=2 finds [5, 6] at 0 and proposes
    [7, 9, 5, ...] up to depth.
    """

    min_n: int = 1
    """Shortest suffix to match."""
    max_n: int = 4
    """Longest suffix to match (tried first)."""
    window: int = 4096
    """Only the most recent `window` tokens are searched."""
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n ({self.min_n}) <= max_n ({self.max_n})")

    def propose(self, seqs: list[Sequence], depth: int) -> list[list[int]]:
        return [self.lookup(s.tokens[-self.window :], depth) for s in seqs]

    def lookup(self, tokens: list[int], depth: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = arr[L - n :]
            # candidate starts i with i + n < L (the match must be followed by something)
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                i = int(hits[-1])
                return arr[i + n : i + n + depth].tolist()
        return []
