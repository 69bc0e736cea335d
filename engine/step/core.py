"""EngineCore: schedule → execute → update, one synchronous step at a time.

1. `add_request` / `abort` / `set_policy` / `reset_prefix_cache` (any thread)
   put commands in an inbox.
2. `step()` (the engine thread) drains the inbox, asks the Scheduler for a
   plan (decode batch + prefill chunks) and runs it (engine/step/ragged_step.py:
   one forward for every row), appending the sampled tokens to their
   sequences.
3. Stop rules run on the host (sequence.append_tokens); finished or aborted
   sequences free their pages at once.
4. The step returns TokenEvents, RequestResults and one StepStats.

Faults: an exception in one sequence's own work (admission, its sampling
inputs, its proposer, detokenization and stop rules) ends that sequence alone
with finish_reason "error" and frees its pages; the step goes on for the rest.
An exception no sequence owns (the forward call) propagates out of `step()`;
the caller then calls `recover()`, which ends every request with "error" and
leaves the engine ready to step again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from engine.config import ModelConfig
from engine.execute.ragged_calls import top_in
from engine.execute.runner import ModelRunner, RunnerConfig
from engine.execute.sequence import Detokenizer, Sequence, append_tokens, request_key
from engine.grammar import GrammarVocab, Matcher
from engine.memory import budget
from engine.memory.kv import KVPool, KVState
from engine.model.gemma import Params
from engine.policy import TunedPolicy, check_servable
from engine.runtime.compiles import compile_count, serving_compiles
from engine.runtime.progress import Reporter
from engine.speculation.proposers import NgramProposer, Proposer
from engine.step.chooser import StepChooser
from engine.step.faults import unadmitted
from engine.step.ragged_step import SpecResult, run_ragged_step
from engine.step.scheduler import MIX_TOKENS_PER_ROW, Scheduler, SchedulerConfig, StepPlan
from engine.types import (
    EngineCapacity,
    ParamError,
    ProposerCapacity,
    Request,
    RequestResult,
    StepOutput,
    StepStats,
    TokenEvent,
)
from engine.warmup.first_runs import FirstRuns
from engine.warmup.warm import SpecWarmup, warm_engine

log = logging.getLogger("crossover.engine")


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs that are not the model's."""

    runner: RunnerConfig = RunnerConfig()  # noqa: RUF009
    token_budget: int = 512
    """Most new tokens processed per step (decode + prefill)."""
    background_warmup: bool = False
    """warmup() returns once plain decoding is compiled; speculation compiles on a thread
    (engine/warmup/warm.py)."""
    prefix_cache: bool = True
    """Share the KV pages of prompt prefixes between requests (engine/memory/prefix_cache.py)."""
    decode_ahead: bool = True
    """Dispatch a plain decode step's next call before reading its tokens (engine/step/ahead.py)."""


class EngineCore:
    """The engine one daemon thread drives."""

    def __init__(self, cfg: ModelConfig, params: Params, tokenizer, ecfg: EngineConfig = EngineConfig(),
                 model_name: str | None = None, seed: int = 0):
        rc = ecfg.runner
        self.cfg, self.tokenizer, self.ecfg = cfg, tokenizer, ecfg
        self.model_name = model_name or cfg.name
        self.max_context = rc.max_context
        self.max_batch = rc.max_batch
        self.runner = ModelRunner(cfg, params, rc)
        self.pool = KVPool(rc.global_pages, rc.local_pages, rc.page_size, rc.ring_pages,
                           cfg.sliding_window if ecfg.prefix_cache else None)
        self.scheduler = Scheduler(
            SchedulerConfig(max_batch=rc.max_batch, token_budget=max(ecfg.token_budget, rc.max_batch),
                            max_chunk=rc.max_chunk, lookahead=max(rc.verify_tokens, default=1) - 1,
                            # A step carries a long prompt's chunks in the decode rows' call,
                            # capped so the streams keep their pace.
                            mix_tokens_per_row=MIX_TOKENS_PER_ROW,
                            mix_long=rc.max_chunk),
            self.pool,
        )
        self.stop_ids = frozenset(getattr(tokenizer, "stop_ids", (cfg.eos_id,)))
        self._chooser = StepChooser(np.random.default_rng(seed), rc.spec_max_batch)  # exploration's rng
        self.proposers: dict[str, Proposer] = {}
        self._keep_hidden = False
        self.spec_warmup, self.warmed_up = SpecWarmup(), False
        self.first_runs: FirstRuns | None = None  # shapes not yet executed once (engine/warmup/first_runs.py)
        self.add_proposer(NgramProposer())
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._grammar: GrammarVocab | None = None
        self._grammar_lock = threading.Lock()
        self._matchers: dict[str, Matcher] = {}  # constrained requests' grammars, until admitted
        self._seqs: dict[str, Sequence] = {}
        self._step_id = 0
        self._lost: list[RequestResult] = []  # results of the step that raised (see recover)
        self._ahead = None  # the next step's call, dispatched already (engine/step/ahead.py)
        self.warmed_up = False
        self.budget_bytes = 0  # speculation + KV pool as engine/loader.py planned them (0: not planned there)
        self.weights_form: str | None = None  # the weights as served, set by engine/loader.py ("gguf", ...)

    def add_proposer(self, proposer: Proposer) -> None:
        """Load a proposer under its technique name (before warmup and serving)."""
        if self.warmed_up:
            raise RuntimeError("add proposers before warmup: serving must not compile")
        proposer.bind(self)
        self.proposers[proposer.name] = proposer
        self._keep_hidden = any(p.wants_hidden for p in self.proposers.values())

    # -- commands (thread-safe) -------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; raises ValueError (engine.types.ParamError naming the field where one
        is to blame) when it can never run, so a bad request never reaches a step."""
        # the HTTP parser's rules too; an id the detokenizer cannot decode would fail in a step
        vocab = min(self.cfg.vocab_size, getattr(self.tokenizer, "vocab_size", self.cfg.vocab_size))
        req.validate(vocab, self.max_context)
        n = len(req.prompt_ids)
        if not self.pool.fits_alone(n + req.sampling.max_tokens + self.scheduler.cfg.lookahead):
            raise ParamError(
                "max_tokens", f"prompt ({n} tokens) + max_tokens ({req.sampling.max_tokens}) needs more "
                f"KV pages than the whole pool holds", "context_length_exceeded")
        c = req.sampling.constraint
        if c is not None:
            if not hasattr(self.tokenizer, "token_bytes"):
                raise ParamError(c.param, f"{c.param}: this engine's tokenizer gives constrained decoding "
                                 "no token bytes", "unsupported_parameter")
            self._matchers[req.request_id] = self.grammar().matcher(c)
        self._inbox.put(("add", req))

    def grammar(self) -> GrammarVocab:
        """The vocabulary constrained decoding matches against, built once (warmup starts it in
        the background)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarVocab(self.tokenizer, self.cfg.vocab_size)
            return self._grammar

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def reset_prefix_cache(self) -> Future:
        """Empty the prefix cache of every block no running sequence holds, between two steps
        (the next step's inbox, on the engine thread); a Future of what went: {"enabled",
        "dropped_blocks", "freed_pages"} (engine.memory.kv.KVPool.drop_cached)."""
        done: Future = Future()
        self._inbox.put(("reset_prefix", done))
        return done

    def set_policy(self, policy: TunedPolicy) -> None:
        """Swap the decode policy; it takes effect at the start of the next step. ValueError
        when it uses a technique, depth or draft vocabulary this engine did not load or compile."""
        check_servable(policy, self.capacity())  # engine.policy.PolicyError, a ValueError
        self._inbox.put(("policy", policy))

    @property
    def policy(self) -> TunedPolicy:
        """The policy serving now (a new one takes effect at the next step)."""
        return self._chooser.policy

    def capacity(self) -> EngineCapacity:
        """The pool, the depth and batch limits and the loaded proposers (for the daemon and tuner)."""
        rc, pool = self.runner.rc, self.pool
        total = pool.total + pool.reserved
        return EngineCapacity(
            total_pages=total, usable_pages=pool.total, page_size=pool.page_size,
            page_bytes=int(self.runner.kv.nbytes() // total) if total else 0,
            max_depth=max(rc.verify_tokens, default=1) - 1,
            max_batch=rc.max_batch, spec_max_batch=rc.spec_max_batch,
            proposers={n: ProposerCapacity(p.resident_bytes(), p.per_sequence_bytes(1), p.max_depth,
                                           tuple(getattr(p, "vocab_sizes", ())))  # MTP heads only
                       for n, p in self.proposers.items()},
            backend=jax.default_backend(),
        )

    # -- the loop ------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> StepOutput:
        events: list[TokenEvent] = []
        finished: list[RequestResult] = []
        try:
            return self._step(events, finished)
        except BaseException:
            self._lost = finished  # requests this failed step ended: recover() reports them
            self._ahead = None
            raise

    def _step(self, events: list[TokenEvent], finished: list[RequestResult]) -> StepOutput:
        t0 = time.perf_counter()
        wall = time.time()
        self._drain_inbox(events, finished)
        plan = self.scheduler.schedule()
        if plan.empty:
            if self.scheduler.running:  # nothing runnable yet pages held: start over from an empty pool
                log.warning("scheduler stalled with %d running; preempting them",
                            self.scheduler.preempt_all())
            return StepOutput(events, None, finished)
        for seq, _ in plan.prefill:  # the first step that runs a sequence ends its queue time
            seq.scheduled_time = seq.scheduled_time or wall
        spec = run_ragged_step(self, plan, events, finished)
        self._step_id += 1
        stats = self._stats(plan, wall, (time.perf_counter() - t0) * 1e3, spec)
        if stats is not None:  # the profile and exploration learn what their steps paid (step/chooser.py)
            self._chooser.observe(stats.technique, stats.depth, stats.decode_tokens, stats.step_ms,
                                  stats.prefill_tokens, stats.batch_size)
        return StepOutput(events, stats, finished)

    def _pending(self) -> Iterator[tuple[str, Any]]:
        """The inbox's messages (kind, argument), each taken once, until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self, events: list[TokenEvent], finished: list[RequestResult]) -> None:
        if self._inbox.empty():  # most steps: no generator, no queue.Empty raised
            return
        for kind, arg in self._pending():
            if kind == "add":
                self._admit(arg, events, finished)
            elif kind == "policy":
                self._chooser.start(arg)
                self.pool.set_split(arg.pool_split)
                for p in self.proposers.values():
                    p.configure(arg)
            elif kind == "reset_prefix":
                if not arg.set_running_or_notify_cancel():  # its caller cancelled it: no reset
                    continue
                try:
                    arg.set_result(self.pool.drop_cached())
                except BaseException as exc:  # the waiter hears of it; the step fails (recover)
                    arg.set_exception(exc)
                    raise
            elif (seq := self._seqs.get(arg)) is not None:
                events.append(TokenEvent(seq.request_id, (), seq.text[seq.emitted:], None, True, "abort"))
                finished.append(self._finish(seq, "abort"))

    def _admit(self, req: Request, events, finished) -> None:
        """Queue `req` for the scheduler; a fault of its own fails it alone."""
        if req.request_id in self._seqs:  # the live one keeps its id and its stream
            log.error("duplicate request id %r dropped", req.request_id)
            self._matchers.pop(req.request_id, None)
            finished.append(unadmitted(req, "error"))
            return
        try:
            prompt = list(req.prompt_ids)
            seq = Sequence(req, prompt, len(prompt), request_key(req.sampling.seed),
                           Detokenizer(self.tokenizer.decode, prompt[-4:]),
                           matcher=self._matchers.pop(req.request_id, None))
        except Exception:
            log.exception("request %s failed at admission", req.request_id)
            events.append(TokenEvent(req.request_id, (), "", None, True, "error"))
            finished.append(unadmitted(req, "error"))
            return
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _finish(self, seq: Sequence, reason: str) -> RequestResult:
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]
        for p in self.proposers.values():
            try:
                p.release(seq)
            except Exception:  # its pages in the proposer's own pool stay lost; ours are back
                log.exception("proposer %s failed to release %s", p.name, seq.request_id)
        return seq.result(reason)

    def _fail(self, seq: Sequence, what: str, events, finished) -> None:
        """End `seq` alone after a fault in its own `what` (engine/step/faults.py; logged with the
        exception being handled): finish_reason "error", pages freed, the step goes on."""
        log.exception("request %s failed in %s", seq.request_id, what)
        events.append(TokenEvent(seq.request_id, (), "", None, True, "error"))
        finished.append(self._finish(seq, "error"))

    def _failer(self, events, finished):
        """`fail(item, what)` for engine/step/faults.py: an item is a sequence or (sequence, drafts)."""
        return lambda item, what: self._fail(item[0] if isinstance(item, tuple) else item, what, events,
                                             finished)

    def recover(self) -> list[RequestResult]:
        """After `step()` raised a fault no sequence owns: end every request, queued or admitted,
        with finish_reason "error" and free its pages; policies and prefix-cache resets still
        queued stay queued. If the fault left the KV arrays deleted (donated to a call that
        failed), they are made anew.
        Returns the requests' results, for telemetry; no events (the caller fails the streams).
        Requests the failed step had already ended count too: their events never left it."""
        results = [r if r.finish_reason == "abort" else replace(r, finish_reason="error") for r in self._lost]
        self._lost, keep = [], []
        for kind, arg in self._pending():
            if kind == "add":
                self._matchers.pop(arg.request_id, None)
                results.append(unadmitted(arg, "error"))
            elif kind in ("policy", "reset_prefix"):
                keep.append((kind, arg))
        for item in keep:
            self._inbox.put(item)
        results += [self._finish(seq, "error") for seq in list(self._seqs.values())]
        self.pool.reset()
        kv, rc = self.runner.kv, self.runner.rc
        if any(a.is_deleted() for a in (kv.global_k, kv.global_v, kv.local_k, kv.local_v)):
            log.warning("KV arrays lost in the fault; allocating them again")
            kv = KVState.create(self.cfg, rc.global_pages, rc.local_pages, rc.page_size, rc.kv_dtype)
            if self.runner.mesh is not None:  # laid out as warmup compiled it: no recompile
                from engine.model.sharding import shard_kv

                kv = shard_kv(self.cfg, kv, self.runner.mesh)
            self.runner.kv = kv
        return results

    def _stops(self, sp) -> frozenset[int]:
        """Token ids that end this request's output."""
        base = frozenset() if sp.ignore_eos else self.stop_ids
        return base | frozenset(sp.stop_token_ids) if sp.stop_token_ids else base

    def _emit(self, seq: Sequence, toks, lps, events, finished, slots: slice, kept=None) -> None:
        """Append `seq`'s new tokens (its output slots `slots` of the latest ragged call) and
        queue its event. `kept(n)`, when given, hears how many tokens the request kept (0 after a
        fault) before the sequence may finish, whose RequestResult reads what it counts."""
        sp = seq.req.sampling
        try:
            tops = None
            if sp.top_logprobs:
                tops = top_in(self.runner, slots)
            ev = append_tokens(seq, toks, lps if sp.logprobs else None, self._stops(sp), self.max_context,
                               tops)
            if seq.prompt_lps is not None:  # a scored prompt, sent with its first token
                ev, seq.prompt_lps = replace(ev, prompt_logprobs=tuple(seq.prompt_lps)), None
        except Exception:
            if kept is not None:
                kept(0)
            self._fail(seq, "its detokenization or stop rules", events, finished)
            return
        if kept is not None:
            kept(len(ev.token_ids))
        events.append(ev)
        if ev.finished:
            finished.append(self._finish(seq, ev.finish_reason))

    def _stats(self, plan: StepPlan, wall: float, step_ms: float, spec: SpecResult) -> StepStats:
        seqs = plan.decode + [s for s, _ in plan.prefill]
        return StepStats(
            step_id=self._step_id, time=wall, batch_size=len(seqs),
            prefill_tokens=sum(n for _, n in plan.prefill), decode_tokens=spec.delivered,
            technique=spec.technique, depth=spec.depth, proposed=spec.proposed, accepted=spec.accepted,
            accepted_per_pos=tuple(spec.per_pos), propose_ms=spec.propose_ms,
            verify_ms=spec.verify_ms if spec.depth else step_ms, step_ms=step_ms,
            kv_pages_used=self.pool.used, kv_pages_free=self.pool.free,
            queue_len=len(self.scheduler.waiting), policy_version=self.policy.version,
            preempted=plan.preempted, tenants=tuple(sorted({s.req.tenant for s in seqs})),
            sampled_rows=sum(1 for s in seqs if s.req.sampling.temperature > 0), plain_rows=spec.plain_rows,
            prefix_hit_tokens=plan.prefix_hit_tokens, prefix_query_tokens=plan.prefix_query_tokens,
            row_classes=spec.row_classes(plan.decode), grammar_ms=spec.grammar_ms,
            constrained_rows=spec.constrained_rows, cut_tokens=spec.cut,
        )

    # -- lifecycle and introspection ---------------------------------------
    def warmup(self, progress: Reporter = True) -> None:
        """Compile every shape, speculation's on a thread with background_warmup (engine/warmup/warm.py)."""
        self.spec_warmup = warm_engine(self, progress, self.ecfg.background_warmup)
        self.first_runs = FirstRuns(self)
        self.warmed_up = True
        if hasattr(self.tokenizer, "token_bytes"):  # the first constrained request finds it built
            threading.Thread(target=self.grammar, name="grammar-vocab", daemon=True).start()

    def idle(self) -> bool:
        """Use a moment with no work: run one compiled shape that has not run yet, so its costly
        first execution is not a serving step's (engine/warmup/first_runs.py); whether one ran.
        Call it on the thread that steps, only while `has_work()` is False. None runs while
        speculation's shapes compile in the background: a first run's forward takes both cores
        from that lower-priority thread, and every technique would be ready seconds later."""
        if self.first_runs is None or self.spec_warmup.running:
            return False
        return self.first_runs.run_one()

    def close(self) -> None:
        """Stop a background warmup, waiting for the compile under way."""
        self.spec_warmup.stop()

    def compiles_since_warmup(self) -> int | None:
        w = self.runner.warm_compiles
        return None if w is None else serving_compiles() - w

    def status(self) -> dict:
        return {
            "model": self.model_name,
            "kv_pages_used": self.pool.used, "kv_pages_free": self.pool.free,
            "kv_pages_total": self.pool.total, "kv_pages_reserved": self.pool.reserved,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "compile_count": compile_count(), "compiles_since_warmup": self.compiles_since_warmup(),
            "policy_version": self.policy.version, "warmed_up": self.warmed_up,
            "kv_pages_yielded": self.pool.yielded, "prefix_cache": self.pool.prefix_status(),
            "techniques": self.spec_warmup.status(), "speculation": self._chooser.cap_status(),
            **budget.status(self),  # proposers' resident bytes and the memory budget's split
        }


