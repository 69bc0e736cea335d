"""Host-side state of one request while the engine works on it."""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.memory.kv import SeqPages
from engine.types import Request, RequestResult, TokenEvent


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def request_key(seed: int | None) -> np.ndarray:
    """Raw PRNG key data [2] uint32 for a request: from its seed, else random.

    Any 64-bit seed works: a negative one is read as its two's complement
    (`seed % 2**64`), since SeedSequence takes only non-negative integers.

    >>> bool((request_key(-1) == request_key(2**64 - 1)).all())
    True
    """
    if seed is None:
        return np.frombuffer(os.urandom(8), np.uint32).copy()
    return np.random.SeedSequence(seed % (1 << 64)).generate_state(2, np.uint32)


HOLD_TOKENS = 8
"""Most ids the Detokenizer holds back waiting for text: a UTF-8 character spans at most 4
byte-fallback ids, so a longer run of U+FFFD or shrinking text is emitted as it renders."""


class Detokenizer:
    """Incremental text from growing token ids, holding back incomplete UTF-8.

    Decodes a short window of ids (from `prefix` on) and emits what the newest
    ids added to it, so a leading-space piece renders as it would in context.
    Ids that render nothing move the window on like any other, and it holds back
    at most HOLD_TOKENS ids, so each push decodes a bounded window: a long run of
    invisible or invalid ids costs linear time, not quadratic.
    """

    def __init__(self, decode, context: list[int] = ()):
        self._decode = decode
        self.ids: list[int] = list(context)  # the prompt's tail, so the first piece keeps its space
        self._prefix = 0
        self._read = len(self.ids)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        held = len(self.ids) - self._read
        if (now.endswith("\ufffd") or len(now) < len(before)) and held < HOLD_TOKENS:
            return ""  # an incomplete UTF-8 sequence (byte fallback) may complete with the next id
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete UTF-8 tail renders as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]


@dataclass
class Sequence:
    """One request: its tokens so far, its pages, its output bookkeeping."""

    req: Request
    tokens: list[int]
    n_prompt: int
    key: np.ndarray
    detok: Detokenizer
    pages: SeqPages = field(default_factory=lambda: SeqPages([], []))
    status: Status = Status.WAITING
    num_cached: int = 0
    text: str = ""
    """Output text decoded so far (before any stop-string cut)."""
    emitted: int = 0
    """Characters of `text` already sent out."""
    first_token_time: float | None = None
    scheduled_time: float | None = None
    """When a step first ran this sequence (set by EngineCore.step)."""
    preemptions: int = 0
    long_prefill: bool = False
    """Admitted with more uncached tokens than SchedulerConfig.mix_long: its chunks are capped
    while other sequences decode (engine/step/scheduler.py `mix_chunk`)."""
    proposed: int = 0
    accepted: int = 0
    hidden: np.ndarray | None = None
    """[d] final hidden state at the newest cached position (kept only for MTP heads)."""
    matcher: Any = None
    """The grammar a constrained request's output follows (engine.grammar.Matcher), else None."""
    prompt_lps: list | None = None
    """A scored prompt's (SamplingParams.prompt_logprobs) PromptLogprob per prompt token, filled
    as its chunks run (engine/step/ragged_step.py); sent on its first event."""
    samp_rows: dict = field(default_factory=dict, repr=False)
    """SamplingArrays host buffers of this request's settings by output slot count, filled once
    and only read after (engine/step/ragged_step.py `_sampling`): settings and key never change."""

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def remaining(self) -> int:
        """Tokens not yet in the KV cache."""
        return len(self.tokens) - self.num_cached

    def result(self, reason: str) -> RequestResult:
        return RequestResult(
            request_id=self.request_id, tenant=self.req.tenant, prompt_tokens=self.n_prompt,
            output_tokens=self.num_output, arrival_time=self.req.arrival_time,
            first_token_time=self.first_token_time, finish_time=time.time(), finish_reason=reason,
            proposed_tokens=self.proposed, accepted_tokens=self.accepted, preemptions=self.preemptions,
            scheduled_time=self.scheduled_time,
        )


def append_tokens(seq: Sequence, new: list[int], logprobs: list[float] | None,
                  stop_ids: frozenset[int], max_context: int,
                  tops: list[list[tuple[int, float]]] | None = None) -> TokenEvent:
    """Append sampled tokens, apply stop rules, and return the event to emit.

    Stops, in order per token: a stop id (the id is reported, its text is not),
    the end of a constrained request's grammar, max_tokens, the context limit, then stop
    strings on the decoded text (the text is cut before the match). The tokens after the one
    that stops are dropped, as one token per step would never have made them: with speculation
    (several tokens at once) the output is still plain decoding's. Text that could still become
    a stop string is held back until it cannot. `tops`: each token's most likely alternatives,
    best first.
    """
    sp = seq.req.sampling
    if seq.first_token_time is None:
        seq.first_token_time = time.time()
    kept: list[int] = []
    reason = None
    per_token = bool(sp.stop) and len(new) > 1  # a stop string may end the output inside `new`
    for t in new:
        kept.append(t)
        seq.tokens.append(t)
        done = seq.matcher is not None and seq.matcher.advance(t)
        if t in stop_ids or done:
            reason = "stop"
        elif seq.num_output >= sp.max_tokens or len(seq.tokens) >= max_context:
            reason = "length"
        if per_token:
            reason = _push(seq, [t], stop_ids, reason)
        if reason:
            break
    if not per_token:
        reason = _push(seq, kept, stop_ids, reason)
    hold = 0 if reason else max((len(s) - 1 for s in sp.stop), default=0)
    end = max(seq.emitted, len(seq.text) - hold)
    delta, seq.emitted = seq.text[seq.emitted : end], end
    lps = tuple(logprobs[: len(kept)]) if logprobs is not None else None
    top = None if tops is None else tuple(tuple(t[: sp.top_logprobs]) for t in tops[: len(kept)])
    return TokenEvent(seq.request_id, tuple(kept), delta, lps, reason is not None, reason, top)


def _push(seq: Sequence, ids: list[int], stop_ids: frozenset[int], reason: str | None) -> str | None:
    """Decode `ids` onto `seq.text` (stop ids render nothing; a `reason` to end flushes what the
    Detokenizer held) and cut the text before the first stop string: the reason, "stop" then."""
    seq.text += seq.detok.push([t for t in ids if t not in stop_ids])
    if reason:
        seq.text += seq.detok.flush()
    cut = _find_stop(seq.text, seq.req.sampling.stop, seq.emitted)
    if cut is not None:
        seq.text, reason = seq.text[:cut], "stop"
    return reason


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Earliest index of any stop string that ends after `emitted` chars."""
    best = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
