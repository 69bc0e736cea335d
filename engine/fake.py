"""A fake `EngineCore` whose output you can check by hand (for fast daemon and tuner tests).

Same surface as the real engine (the `Engine` protocol of daemon/bridge.py:
requests, steps, status, warmup, policy, capacity), no JAX, no weights.

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
ignore_eos the reversed text repeats instead of ending; a stop token before
min_tokens is replaced by the script's first other token. Stop strings cut the
text before the match and hold back text that might start one. The
log-probability of output position i is `fake_logprob(i)` (its top_logprobs: that token only);
a scored prompt's token i (SamplingParams.prompt_logprobs) has `fake_logprob(i)` likewise.

Memory: each admitted request reserves ceil((prompt + max_tokens) / page_size)
pages and returns them when it finishes, so leak tests can assert
`pages_used == 0` afterwards. At most `max_batch` requests run; the rest wait
in FIFO order. Prefix-cache hits are counted as a real engine's (SeenPrefixes); none saves pages.
`reset_prefix_cache` forgets the blocks of all but the running requests' prompts at the next step.

Speculation (for tuner tests): `set_policy(policy)` takes effect at the next
step, as in `EngineCore`, whose `StepChooser` applies the policy's
exploration with a random stream seeded once and picks each row's technique
and depth (a tenant rule's, else the batch's). A row that drafts has its drafts
accepted by `FakeProposer.accepts` (a deterministic hash against the
proposer's per-position acceptance, scaled per tenant) and emits 1 + accepted
tokens of its script in that step, up to its request's end (the stats count only
those, as the real engine's); `row_classes` group the rows as the real engine's.
With a `FakeCost` (engine/speculation/fake_speculation.py), step_ms / propose_ms
are computed from it instead of measured, so goodput per policy is known exactly.
"""

from __future__ import annotations

import codecs
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.memory.prefix_cache import SeenPrefixes
from engine.policy import TunedPolicy, check_servable
from engine.runtime.progress import Reporter, note
from engine.speculation.fake_speculation import FakeCost, FakeProposer
from engine.step.chooser import StepChooser
from engine.types import EngineCapacity, ParamError, ProposerCapacity, Request, RequestResult, StepOutput
from engine.types import RowClass, StepStats, TokenEvent

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

    def piece(self, token_id: int) -> str:
        """One id's text, a control id's name too."""
        names = {PAD_ID: "<pad>", EOS_ID: "<eos>", BOS_ID: "<bos>", END_OF_TURN_ID: "<end_of_turn>"}
        return names.get(token_id) or self.decode([token_id])

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        lines = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {CHAT_ROLES}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string")  # noqa: TRY004
            lines.append(f"{role}: {content}\n")
        return "".join(lines) + ("assistant: " if add_generation_prompt else "")


@dataclass
class _Sequence:
    """One admitted request and its progress."""

    request: Request
    script: list[int]
    """Tokens to emit, in order (reversed prompt text then EOS)."""
    pages: int
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder(
        "utf-8")(errors="replace"))
    produced: int = 0
    text: str = ""
    """All decoded output text so far."""
    emitted: int = 0
    """Characters of `text` already sent in events."""
    first_token_time: float | None = None
    scheduled_time: float = field(default_factory=time.time)  # admitted; the same step runs it
    proposed: int = 0
    accepted: int = 0

    def next_token(self) -> int:
        token = self.script[self.produced % len(self.script)]
        self.produced += 1
        return token


class FakeEngine:
    """Deterministic stand-in for `engine.step.core.EngineCore` (see module doc)."""

    def __init__(self, *, max_batch: int = 32, max_context: int = 4096, page_size: int = 16,
                 num_pages: int = 4096, step_delay_s: float = 0.0, warmup_delay_s: float = 0.0,
                 model_name: str = "fake-reverse", proposers: dict[str, FakeProposer] | None = None,
                 max_depth: int = 4, cost: FakeCost | None = None,
                 tenant_acceptance: dict[str, float] | None = None, seed: int = 0) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name, self.max_context, self.max_batch = model_name, max_context, max_batch
        self.page_size, self.num_pages, self.prefixes = page_size, num_pages, SeenPrefixes(page_size)
        self.step_delay_s, self.warmup_delay_s = step_delay_s, warmup_delay_s
        self.pages_used = self.step_count = 0
        self.warmed_up = False
        self._lock = threading.Lock()
        self._inbox: list[Request] = []  # _inbox, _abort_inbox and _live: guarded by _lock
        self._abort_inbox: list[str] = []
        self._resets: list[Future] = []  # prefix-cache resets for the next step
        self._live: set[str] = set()  # request ids admitted and not finished
        self._waiting: deque[Request] = deque()
        self._running: dict[str, _Sequence] = {}
        self.proposers = dict(proposers or {})  # none by default: the fake never speculates
        self.max_depth = max_depth  # deepest speculation "compiled" (set_policy refuses deeper)
        self.cost = cost
        self.tenant_acceptance = dict(tenant_acceptance or {})  # tenant -> factor (default 1)
        self._chooser = StepChooser(np.random.default_rng(seed))  # serving policy; exploration's rng
        self._next_policy: TunedPolicy | None = None
        self.request_fault: Any = None  # fault injection: f(request_id) runs in each sequence's own work

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

    def reset_prefix_cache(self) -> Future:
        """As `EngineCore.reset_prefix_cache`: at the next step, a Future of what went."""
        done: Future = Future()
        with self._lock:
            self._resets.append(done)
        return done

    def set_policy(self, policy: TunedPolicy) -> None:
        """Swap the decode policy at the next step; ValueError as `EngineCore.set_policy`."""
        check_servable(policy, self.capacity())  # the same checks as EngineCore's
        with self._lock:
            self._next_policy = policy

    @property
    def policy(self) -> TunedPolicy:
        return self._chooser.policy

    def capacity(self) -> EngineCapacity:
        """The fake's pool and proposers: every depth up to max_depth, as the real engine's."""
        return EngineCapacity(
            self.num_pages, self.num_pages, self.page_size, 0, self.max_depth, self.max_batch,
            self.max_batch, {n: ProposerCapacity(p.resident, p.per_draft, p.max_depth, p.draft_vocabs)
                             for n, p in self.proposers.items()})

    def has_work(self) -> bool:
        with self._lock:
            inbox = bool(self._inbox or self._abort_inbox or self._resets)
        return inbox or bool(self._waiting or self._running)

    def status(self) -> dict[str, Any]:
        return {"kv_pages_used": self.pages_used, "kv_pages_free": self.num_pages - self.pages_used,
                "kv_pages_total": self.num_pages, "running": len(self._running),
                "waiting": len(self._waiting), "compile_count": 0,
                "techniques": dict.fromkeys(self.proposers, "ready"), "policy_version": self.policy.version,
                "prefix_cache": self.prefixes.status()}

    def warmup(self, progress: Reporter = True) -> None:
        note(progress, "fake engine: warming up")
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
        choices = [c if c[1] and c[0] in self.proposers else ("none", 0)
                   for c in self._chooser.choose_rows([s.request.tenant for s in batch])]
        per_pos = [0] * max(d for _, d in choices)  # the verify depth: the deepest row's
        classes: dict[tuple[str, str, int], list] = {}  # as engine/step/ragged_step.py's SpecResult.classes
        emitted = cut = 0
        for seq, (technique, depth) in zip(batch, choices):
            cls = classes.setdefault((seq.request.tenant, technique, depth), [0, 0, 0, [0] * depth])
            try:
                self.request_fault and self.request_fault(seq.request.request_id)
                accepted = self._speculate(seq, self.proposers.get(technique), depth)
                event = self._advance(seq, 1 + accepted)
                delivered = min(accepted, len(event.token_ids) - 1)  # as EngineCore: what the request kept
                cut += 1 + accepted - len(event.token_ids)
                self._count(seq, cls, depth, delivered)
            except Exception:  # this sequence's own fault fails it alone, as in EngineCore
                events.append(TokenEvent(seq.request.request_id, (), "", None, True, "error"))
                finished.append(self._finish(seq, "error"))
                continue
            events.append(event)
            emitted += len(event.token_ids)
            if event.finished:
                finished.append(self._finish(seq, event.finish_reason or "stop"))
        self.step_count += 1
        for cls in classes.values():
            for i, n in enumerate(cls[3]):
                per_pos[i] += n
        row_classes = tuple(RowClass(t, tech, d, *c[:3], tuple(c[3]))
                            for (t, tech, d), c in sorted(classes.items()) if c[0])
        stats = self._stats(start, batch, prefill, emitted, per_pos, row_classes, cut)
        self._chooser.observe(stats.technique, stats.depth, stats.decode_tokens, stats.step_ms,
                              stats.prefill_tokens, stats.batch_size)  # as EngineCore
        return StepOutput(events=events, stats=stats, finished=finished)

    def recover(self) -> list[RequestResult]:
        """After a step raised: end every queued or running request with "error", pages freed."""
        with self._lock:
            queued, self._inbox, self._abort_inbox = [*self._inbox, *self._waiting], [], []
            self._live.difference_update(r.request_id for r in queued)
        self._waiting.clear()
        return ([self._finish(seq, "error") for seq in list(self._running.values())]
                + [self._result(r, None, 0, "error") for r in queued])

    def _speculate(self, seq: _Sequence, proposer: FakeProposer | None, depth: int) -> int:
        """Drafts of `seq` accepted this step (0 without a proposer)."""
        if proposer is None:
            return 0
        scale = self.tenant_acceptance.get(seq.request.tenant, 1.0)
        return proposer.accepts(f"{seq.request.request_id}:{seq.produced}", depth, scale)

    @staticmethod
    def _count(seq: _Sequence, cls: list, proposed: int, delivered: int) -> None:
        """One row in its class [rows, proposed, accepted, per_pos] and its sequence: `proposed`
        drafts, `delivered` of them accepted (those its request kept, as EngineCore counts)."""
        cls[:3] = cls[0] + 1, cls[1] + proposed, cls[2] + delivered
        for i in range(delivered):
            cls[3][i] += 1
        seq.proposed += proposed
        seq.accepted += delivered

    def _check(self, req: Request) -> None:
        req.validate(VOCAB_SIZE, self.max_context)  # EngineCore.add_request's rules
        if req.sampling.constraint is not None:  # its tokens are made up: no grammar could hold them
            c = req.sampling.constraint
            raise ParamError(c.param, f"{c.param}: the fake engine serves no constrained decoding",
                             "unsupported_parameter")
        if self._pages_for(req) > self.num_pages:
            raise ValueError(f"request needs more than the {self.num_pages} KV pages there are")

    def _pages_for(self, req: Request) -> int:
        return -(-(len(req.prompt_ids) + req.sampling.max_tokens) // self.page_size)

    def _take_inbox(self, events: list[TokenEvent], finished: list[RequestResult]) -> None:
        with self._lock:
            new, aborts, resets = self._inbox, self._abort_inbox, self._resets
            self._inbox, self._abort_inbox, self._resets = [], [], []
            if self._next_policy is not None:
                self._chooser.start(self._next_policy)
            self._next_policy = None
        self._waiting.extend(new)
        for request_id in aborts:
            self._abort_one(request_id, events, finished)
        held = [(s.request.prompt_ids, s.request.tenant) for s in self._running.values()]
        for done in (d for d in resets if d.set_running_or_notify_cancel()):  # unless cancelled
            done.set_result({"enabled": True, "dropped_blocks": self.prefixes.drop(held), "freed_pages": 0})

    def _abort_one(self, request_id: str, events: list[TokenEvent],
                   finished: list[RequestResult]) -> None:
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
            prefill += len(req.prompt_ids) - self.prefixes.admit(req.prompt_ids, req.tenant)  # as if cached
        return prefill

    def _script(self, req: Request) -> list[int]:
        text = self.tokenizer.decode(req.prompt_ids)[::-1]
        tail = [] if req.sampling.ignore_eos else [EOS_ID]
        return self.tokenizer.encode(text, add_bos=False) + tail or [EOS_ID]

    def _advance(self, seq: _Sequence, n: int = 1) -> TokenEvent:
        """Emit up to `n` tokens of `seq`; apply stop ids, max_tokens and stop strings."""
        sp = seq.request.sampling
        stop_ids = set(sp.stop_token_ids) | set(self.tokenizer.stop_ids)
        if sp.ignore_eos:
            stop_ids.discard(EOS_ID)
        seq.first_token_time = seq.first_token_time or time.time()
        tokens: list[int] = []
        logprobs: list[float] = []
        reason: str | None = None
        while reason is None and len(tokens) < n:
            logprobs.append(fake_logprob(seq.produced))
            token = seq.next_token()
            if token in stop_ids and seq.produced <= sp.min_tokens:  # too early to stop
                token = next((t for t in seq.script if t not in stop_ids), BYTE_OFFSET)
            tokens.append(token)
            if token in stop_ids:
                reason = "stop"
            elif token >= BYTE_OFFSET:
                seq.text += seq.decoder.decode(bytes([token - BYTE_OFFSET]))
            if reason is None and seq.produced >= sp.max_tokens:
                reason = "length"
            if reason is None and any(seq.text.find(s, seq.emitted) >= 0 for s in sp.stop):
                reason = "stop"
        if reason is not None:
            seq.text += seq.decoder.decode(b"", final=True)
        text, hit = self._release_text(seq, sp.stop, final=reason is not None)
        if hit:
            reason = "stop"
        tops = tuple(((t, lp),) for t, lp in zip(tokens, logprobs)) if sp.top_logprobs else None  # one
        prompt = None
        if sp.prompt_logprobs is not None and seq.produced == len(tokens):  # the first event
            ids = seq.request.prompt_ids
            prompt = (None, *((fake_logprob(i), ((t, fake_logprob(i)),)[: sp.prompt_logprobs])
                              for i, t in enumerate(ids) if i))
        return TokenEvent(seq.request.request_id, tuple(tokens), text,
                          tuple(logprobs) if sp.logprobs else None, reason is not None, reason, tops, prompt)

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
        return self._result(seq.request, seq.first_token_time, seq.produced, reason,
                            seq.proposed, seq.accepted, seq.scheduled_time)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)

    @staticmethod
    def _result(req: Request, first_token_time: float | None, produced: int, reason: str,
                proposed: int = 0, accepted: int = 0, scheduled_time: float | None = None) -> RequestResult:
        return RequestResult(req.request_id, req.tenant, len(req.prompt_ids), produced,
                             req.arrival_time, first_token_time, time.time(), reason,
                             proposed_tokens=proposed, accepted_tokens=accepted,
                             scheduled_time=scheduled_time)

    def _stats(self, start: float, batch: list[_Sequence], prefill: int, decode_tokens: int,
               per_pos: list[int], row_classes: tuple[RowClass, ...], cut: int = 0) -> StepStats:
        depth, sampled = len(per_pos), sum(1 for s in batch if s.request.sampling.temperature > 0)
        drafting: dict[str, int] = {}  # technique -> rows that drafted with it
        for c in row_classes:
            if c.depth:
                drafting[c.technique] = drafting.get(c.technique, 0) + c.rows
        technique = max(sorted(drafting), key=drafting.__getitem__) if drafting else "none"
        proposed = sum(c.proposed for c in row_classes)
        if self.cost is not None:
            step_ms, propose_ms = self.cost.times(len(batch), depth, sampled, proposed)
        else:
            step_ms, propose_ms = (time.time() - start) * 1000.0, 0.0
        return StepStats(
            step_id=self.step_count, time=start, batch_size=len(batch), prefill_tokens=prefill,
            decode_tokens=decode_tokens, technique=technique, depth=depth,
            proposed=proposed, accepted=sum(per_pos), accepted_per_pos=tuple(per_pos),
            propose_ms=propose_ms, verify_ms=step_ms - propose_ms if depth else 0.0,
            step_ms=step_ms, kv_pages_used=self.pages_used,
            kv_pages_free=self.num_pages - self.pages_used, queue_len=len(self._waiting),
            policy_version=self.policy.version, sampled_rows=sampled, **self.prefixes.take(),
            tenants=tuple(sorted({s.request.tenant for s in batch})), row_classes=row_classes,
            cut_tokens=cut,
        )
