"""A fake `EngineCore` whose output you can check by hand (STYLE 8).

Same surface as the real engine (tokenizer, model_name, max_context,
add_request, abort, step, has_work, status, warmup), no JAX, no weights.

Tokenizer: byte level. Ids 0..15 are specials (PAD=0, EOS=1, BOS=2,
END_OF_TURN=3); byte b is id b + 16. The chat template is plain text:
one "role: content\\n" line per message, then "assistant: ".

    >>> tok = FakeTokenizer()
    >>> tok.encode("hi")
    [2, 120, 121]
    >>> tok.apply_chat_template([{"role": "user", "content": "hi"}])
    'user: hi\\nassistant: '

Generation rule: the output is the prompt's text reversed character by
character (BOS and other specials skipped), then EOS, one token per step per
running request. So prompt "abc" gives tokens "c", "b", "a", EOS: text "cba",
4 completion tokens (EOS counts, its text is empty), finish_reason "stop";
with max_tokens=2 the text is "cb" and finish_reason "length". With
ignore_eos the reversed text repeats instead of ending. Stop strings cut the
text before the match and hold back text that might start one. The
log-probability of output position i is `fake_logprob(i)`.

Memory: each admitted request reserves ceil((prompt + max_tokens) / page_size)
pages and returns them when it finishes, so leak tests can assert
`pages_used == 0` afterwards. At most `max_batch` requests run; the rest wait
in FIFO order.
"""

from __future__ import annotations

import codecs
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.types import Request, RequestResult, StepOutput, StepStats, TokenEvent

PAD_ID, EOS_ID, BOS_ID, END_OF_TURN_ID = 0, 1, 2, 3
BYTE_OFFSET = 16
VOCAB_SIZE = BYTE_OFFSET + 256
CHAT_ROLES = ("system", "user", "assistant")


def fake_logprob(position: int) -> float:
    """Log-probability the fake reports for output position `position`.

    >>> [fake_logprob(i) for i in range(5)]
    [0.0, -0.25, -0.5, -0.75, 0.0]
    """
    return (position % 4) * -0.25 + 0.0


class FakeTokenizer:
    """Byte-level tokenizer with the real tokenizer's methods."""

    vocab_size = VOCAB_SIZE
    eos_id = EOS_ID
    bos_id = BOS_ID
    stop_ids: tuple[int, ...] = (EOS_ID, END_OF_TURN_ID)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        lines = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {CHAT_ROLES}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string")
            lines.append(f"{role}: {content}\n")
        return "".join(lines) + ("assistant: " if add_generation_prompt else "")


@dataclass
class _Sequence:
    """One admitted request and its progress."""

    request: Request
    script: list[int]
    """Tokens to emit, in order (reversed prompt text then EOS)."""
    pages: int
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    produced: int = 0
    text: str = ""
    """All decoded output text so far."""
    emitted: int = 0
    """Characters of `text` already sent in events."""
    first_token_time: float | None = None

    def next_token(self) -> int:
        token = self.script[self.produced % len(self.script)]
        self.produced += 1
        return token


class FakeEngine:
    """Deterministic stand-in for `engine.core.EngineCore` (see module doc)."""

    def __init__(
        self,
        *,
        max_batch: int = 32,
        max_context: int = 4096,
        page_size: int = 16,
        num_pages: int = 4096,
        step_delay_s: float = 0.0,
        warmup_delay_s: float = 0.0,
        model_name: str = "fake-reverse",
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = model_name
        self.max_context = max_context
        self.max_batch = max_batch
        self.page_size = page_size
        self.num_pages = num_pages
        self.step_delay_s = step_delay_s
        self.warmup_delay_s = warmup_delay_s
        self.pages_used = 0
        self.warmed_up = False
        self.step_count = 0
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._abort_inbox: list[str] = []
        self._live: set[str] = set()
        self._waiting: deque[Request] = deque()
        self._running: dict[str, _Sequence] = {}

    # ---- thread-safe entry points -------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue `req`; raise ValueError when it can never run."""
        self._check(req)
        with self._lock:
            if req.request_id in self._live:
                raise ValueError(f"duplicate request_id {req.request_id!r}")
            self._live.add(req.request_id)
            self._inbox.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._abort_inbox.append(request_id)

    def has_work(self) -> bool:
        with self._lock:
            inbox = bool(self._inbox or self._abort_inbox)
        return inbox or bool(self._waiting or self._running)

    def status(self) -> dict[str, Any]:
        return {
            "kv_pages_used": self.pages_used,
            "kv_pages_free": self.num_pages - self.pages_used,
            "kv_pages_total": self.num_pages,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "compile_count": 0,
            "policy_version": 0,
        }

    def warmup(self, progress: bool = True) -> None:
        if progress:
            print("fake engine: warming up", file=sys.stderr, flush=True)
        time.sleep(self.warmup_delay_s)
        self.warmed_up = True

    # ---- the step (engine thread only) --------------------------------
    def step(self) -> StepOutput:
        start = time.time()
        events: list[TokenEvent] = []
        finished: list[RequestResult] = []
        self._take_inbox(events, finished)
        prefill = self._admit()
        if not self._running:
            return StepOutput(events=events, stats=None, finished=finished)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        batch = list(self._running.values())
        for seq in batch:
            event = self._advance(seq)
            events.append(event)
            if event.finished:
                finished.append(self._finish(seq, event.finish_reason or "stop"))
        self.step_count += 1
        stats = self._stats(start, batch, prefill, decode_tokens=len(batch))
        return StepOutput(events=events, stats=stats, finished=finished)

    def _check(self, req: Request) -> None:
        ids, sp = req.prompt_ids, req.sampling
        if not ids:
            raise ValueError("prompt is empty")
        if any((not isinstance(i, int)) or not (0 <= i < VOCAB_SIZE) for i in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {VOCAB_SIZE})")
        sp.validate()
        if len(ids) + sp.max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) "
                f"exceeds max_context ({self.max_context})"
            )
        if self._pages_for(req) > self.num_pages:
            raise ValueError(f"request needs more than the {self.num_pages} KV pages there are")

    def _pages_for(self, req: Request) -> int:
        return -(-(len(req.prompt_ids) + req.sampling.max_tokens) // self.page_size)

    def _take_inbox(self, events: list[TokenEvent], finished: list[RequestResult]) -> None:
        with self._lock:
            new, aborts = self._inbox, self._abort_inbox
            self._inbox, self._abort_inbox = [], []
        self._waiting.extend(new)
        for request_id in aborts:
            self._abort_one(request_id, events, finished)

    def _abort_one(
        self, request_id: str, events: list[TokenEvent], finished: list[RequestResult]
    ) -> None:
        event = TokenEvent(request_id, (), "", finished=True, finish_reason="abort")
        if request_id in self._running:
            events.append(event)
            finished.append(self._finish(self._running[request_id], "abort"))
            return
        for req in self._waiting:
            if req.request_id == request_id:
                self._waiting.remove(req)
                events.append(event)
                finished.append(self._result(req, None, 0, "abort"))
                self._forget(request_id)
                return

    def _admit(self) -> int:
        prefill = 0
        while self._waiting and len(self._running) < self.max_batch:
            req = self._waiting[0]
            pages = self._pages_for(req)
            if self.pages_used + pages > self.num_pages:
                break
            self._waiting.popleft()
            self.pages_used += pages
            self._running[req.request_id] = _Sequence(req, self._script(req), pages)
            prefill += len(req.prompt_ids)
        return prefill

    def _script(self, req: Request) -> list[int]:
        text = self.tokenizer.decode(req.prompt_ids)[::-1]
        tail = [] if req.sampling.ignore_eos else [EOS_ID]
        return self.tokenizer.encode(text, add_bos=False) + tail or [EOS_ID]

    def _advance(self, seq: _Sequence) -> TokenEvent:
        """Emit one token of `seq`; apply stop ids, max_tokens and stop strings."""
        sp = seq.request.sampling
        position = seq.produced
        token = seq.next_token()
        seq.first_token_time = seq.first_token_time or time.time()
        stop_ids = set(sp.stop_token_ids) | set(self.tokenizer.stop_ids)
        if sp.ignore_eos:
            stop_ids.discard(EOS_ID)
        reason: str | None = None
        if token in stop_ids:
            reason = "stop"
        elif token >= BYTE_OFFSET:
            seq.text += seq.decoder.decode(bytes([token - BYTE_OFFSET]))
        if reason is None and seq.produced >= sp.max_tokens:
            reason = "length"
        if reason is not None:
            seq.text += seq.decoder.decode(b"", final=True)
        text, hit = self._release_text(seq, sp.stop, final=reason is not None)
        if hit:
            reason = "stop"
        logprobs = (fake_logprob(position),) if sp.logprobs else None
        return TokenEvent(
            seq.request.request_id, (token,), text, logprobs, reason is not None, reason
        )

    @staticmethod
    def _release_text(seq: _Sequence, stops: tuple[str, ...], final: bool) -> tuple[str, bool]:
        """New text safe to send, and whether a stop string matched.

        Text that could be the start of a stop string is held back until the
        next token decides it (or the sequence ends).
        """
        hits = [i for i in (seq.text.find(s, seq.emitted) for s in stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, seq.emitted = seq.text[seq.emitted : cut], cut
            return out, True
        hold = 0 if final or not stops else max(len(s) for s in stops) - 1
        end = max(seq.emitted, len(seq.text) - hold)
        out, seq.emitted = seq.text[seq.emitted : end], end
        return out, False

    def _finish(self, seq: _Sequence, reason: str) -> RequestResult:
        del self._running[seq.request.request_id]
        self.pages_used -= seq.pages
        self._forget(seq.request.request_id)
        return self._result(seq.request, seq.first_token_time, seq.produced, reason)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)

    @staticmethod
    def _result(
        req: Request, first_token_time: float | None, produced: int, reason: str
    ) -> RequestResult:
        return RequestResult(
            request_id=req.request_id,
            tenant=req.tenant,
            prompt_tokens=len(req.prompt_ids),
            output_tokens=produced,
            arrival_time=req.arrival_time,
            first_token_time=first_token_time,
            finish_time=time.time(),
            finish_reason=reason,
        )

    def _stats(
        self, start: float, batch: list[_Sequence], prefill: int, decode_tokens: int
    ) -> StepStats:
        return StepStats(
            step_id=self.step_count,
            time=start,
            batch_size=len(batch),
            prefill_tokens=prefill,
            decode_tokens=decode_tokens,
            technique="none",
            depth=0,
            proposed=0,
            accepted=0,
            accepted_per_pos=(),
            propose_ms=0.0,
            verify_ms=0.0,
            step_ms=(time.time() - start) * 1000.0,
            kv_pages_used=self.pages_used,
            kv_pages_free=self.num_pages - self.pages_used,
            queue_len=len(self._waiting),
            policy_version=0,
            tenants=tuple(sorted({s.request.tenant for s in batch})),
        )
