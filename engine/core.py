"""EngineCore: schedule → execute → update, one synchronous step at a time.

1. `add_request` / `abort` (any thread) put commands in an inbox.
2. `step()` (the engine thread) drains the inbox, asks the Scheduler for a
   plan (decode batch + prefill chunks), builds bucket-padded arrays for the
   ModelRunner, runs the decode call and each prefill chunk, and appends the
   sampled tokens to their sequences.
3. Stop rules run on the host (sequence.append_tokens); finished or aborted
   sequences free their pages at once.
4. The step returns TokenEvents, RequestResults and one StepStats.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np

from engine.config import ModelConfig
from engine.kv import KVPool
from engine.model import Params
from engine.policy import StepChooser, TunedPolicy
from engine.progress import Reporter, note
from engine.proposers import NgramProposer, Proposer
from engine.runner import ModelRunner, RunnerConfig, compile_count, map_limit, memory_mappings
from engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from engine.sequence import Detokenizer, Sequence, append_tokens, request_key
from engine.types import (
    EngineCapacity,
    ProposerCapacity,
    Request,
    RequestResult,
    StepOutput,
    StepStats,
    TokenEvent,
)


@dataclass
class SpecResult:
    """What speculation did in one step (defaults: plain decode)."""

    technique: str = "none"
    depth: int = 0
    propose_ms: float = 0.0
    verify_ms: float = 0.0
    per_pos: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs that are not the model's."""

    runner: RunnerConfig = RunnerConfig()
    token_budget: int = 512
    """Most new tokens processed per step (decode + prefill)."""


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
        self.pool = KVPool(rc.global_pages, rc.local_pages, rc.page_size, rc.ring_pages)
        self.scheduler = Scheduler(
            SchedulerConfig(max_batch=rc.max_batch, token_budget=max(ecfg.token_budget, rc.max_batch),
                            max_chunk=rc.max_chunk, lookahead=max(rc.verify_tokens, default=1) - 1),
            self.pool,
        )
        self.stop_ids = frozenset(getattr(tokenizer, "stop_ids", (cfg.eos_id,)))
        self._chooser = StepChooser(np.random.default_rng(seed))  # serving policy; exploration's rng
        self.proposers: dict[str, Proposer] = {}
        self._keep_hidden = False
        self.warmed_up = False
        self.add_proposer(NgramProposer())
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, Sequence] = {}
        self._step_id = 0
        self.warmed_up = False

    def add_proposer(self, proposer: Proposer) -> None:
        """Load a proposer under its technique name (before warmup and serving)."""
        if self.warmed_up:
            raise RuntimeError("add proposers before warmup: serving must not compile")
        proposer.bind(self)
        self.proposers[proposer.name] = proposer
        self._keep_hidden = any(p.wants_hidden for p in self.proposers.values())

    # -- commands (thread-safe) -------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; raises ValueError when it can never run."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        if n + req.sampling.max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds the context "
                f"length {self.max_context}"
            )
        if not self.pool.fits_alone(n + req.sampling.max_tokens + self.scheduler.cfg.lookahead):
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({req.sampling.max_tokens}) needs more KV pages "
                f"than the whole pool holds"
            )
        bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        req.sampling.validate()
        self._inbox.put(("add", req))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def set_policy(self, policy: TunedPolicy) -> None:
        """Swap the decode policy; it takes effect at the start of the next step. ValueError
        when it uses a technique, depth or draft vocabulary this engine did not load or compile."""
        cap = self.capacity()
        missing = policy.techniques() - set(cap.proposers)
        if missing:
            raise ValueError(f"policy uses techniques without a loaded proposer: {sorted(missing)}")
        vocabs = cap.proposers["mtp"].draft_vocabs if "mtp" in cap.proposers else ()
        if policy.draft_vocab and "mtp" in policy.techniques() and policy.draft_vocab not in vocabs:
            raise ValueError(f"draft_vocab={policy.draft_vocab} is not one of the MTP proposer's compiled "
                             f"draft vocabularies {vocabs}")
        if policy.max_depth > cap.max_depth:
            raise ValueError(f"policy depth {policy.max_depth} exceeds the compiled verify buckets "
                             f"{self.runner.rc.verify_tokens}")
        self._inbox.put(("policy", policy))

    @property
    def policy(self) -> TunedPolicy:
        """The policy serving now (a new one takes effect at the next step)."""
        return self._chooser.policy

    def capacity(self) -> EngineCapacity:
        """The pool, the compiled shapes and the loaded proposers (for the daemon and tuner)."""
        rc, pool = self.runner.rc, self.pool
        total = pool.total + pool.reserved
        return EngineCapacity(
            total_pages=total, usable_pages=pool.total, page_size=pool.page_size,
            page_bytes=int(self.runner.kv.nbytes() // total) if total else 0,
            max_depth=max(rc.verify_tokens, default=1) - 1,
            verify_depths=tuple(sorted(q - 1 for q in rc.verify_tokens if q > 1)),
            max_batch=rc.max_batch, spec_max_batch=rc.spec_max_batch,
            batch_buckets=tuple(rc.batch_buckets),
            proposers={n: ProposerCapacity(p.resident_bytes(), p.per_sequence_bytes(1), p.max_depth,
                                           tuple(getattr(p, "vocab_sizes", ())))  # MTP heads only
                       for n, p in self.proposers.items()},
        )

    # -- the loop ------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> StepOutput:
        t0 = time.perf_counter()
        wall = time.time()
        events, finished = self._drain_inbox()
        plan = self.scheduler.schedule()
        if plan.empty:
            if self.scheduler.running:  # a bug, but hanging silently would be worse
                raise RuntimeError("scheduler stalled: running sequences but nothing to run")
            return StepOutput(events, None, finished)
        spec = self._run_decode(plan, events, finished)
        for seq, n in plan.prefill:
            self._run_prefill(seq, n, events, finished)
        self._step_id += 1
        stats = self._stats(plan, wall, (time.perf_counter() - t0) * 1e3, spec)
        return StepOutput(events, stats, finished)

    def _drain_inbox(self) -> tuple[list[TokenEvent], list[RequestResult]]:
        events: list[TokenEvent] = []
        finished: list[RequestResult] = []
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return events, finished
            if kind == "add":
                self._admit(arg)
            elif kind == "policy":
                self._chooser.start(arg)
                self.pool.set_split(arg.pool_split)
                for p in self.proposers.values():
                    p.configure(arg)
            elif (seq := self._seqs.get(arg)) is not None:
                events.append(TokenEvent(seq.request_id, (), seq.text[seq.emitted:], None, True, "abort"))
                finished.append(self._finish(seq, "abort"))

    def _admit(self, req: Request) -> None:
        if req.request_id in self._seqs:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        prompt = list(req.prompt_ids)
        seq = Sequence(req, prompt, len(prompt), request_key(req.sampling.seed),
                       Detokenizer(self.tokenizer.decode, prompt[-4:]))
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _finish(self, seq: Sequence, reason: str) -> RequestResult:
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]
        for p in self.proposers.values():
            p.release(seq)
        return seq.result(reason)

    def _fill_row(self, c, row: int, seq: Sequence, n: int) -> None:
        c.tokens[row, :n] = seq.tokens[seq.num_cached : seq.num_cached + n]
        c.start[row], c.n_new[row] = seq.num_cached, n
        self.pool.fill_tables(seq.pages, c.global_table[row], c.local_table[row])
        c.logit_idx[row, 0] = n - 1
        c.counter[row, 0] = seq.num_cached + n
        sp = seq.req.sampling
        c.samp["temperature"][row] = sp.temperature
        c.samp["top_k"][row] = sp.top_k
        c.samp["top_p"][row] = sp.top_p
        c.samp["key"][row] = seq.key
        c.samp["want_logprobs"][row] = sp.logprobs

    def _run_decode(self, plan: StepPlan, events, finished) -> SpecResult:
        seqs = plan.decode
        if not seqs:
            return SpecResult()
        technique, depth = self._chooser.choose(len(seqs))
        if technique != "none" and len(seqs) <= self.runner.rc.spec_max_batch:
            depth = min(depth, self.proposers[technique].max_depth)  # e.g. 4 MTP heads
            t0 = time.perf_counter()
            drafts = self.proposers[technique].propose(seqs, depth)
            propose_ms = (time.perf_counter() - t0) * 1e3
            if any(drafts):
                return self._run_speculative(seqs, drafts, technique, depth, propose_ms, events, finished)
        ctx = max(s.num_cached + 1 for s in seqs)
        c = self.runner.new_call(len(seqs), 1, ctx)
        for i, s in enumerate(seqs):
            self._fill_row(c, i, s, 1)
        tok, lp = self.runner.run(c)
        hidden = self._hidden()
        for i, s in enumerate(seqs):
            s.num_cached += 1
            if hidden is not None:
                s.hidden = hidden[i, 0]
            self._emit(s, [int(tok[i, 0])], [float(lp[i, 0])], events, finished)
        return SpecResult()

    def _run_speculative(self, seqs, drafts, technique, depth, propose_ms, events, finished) -> SpecResult:
        """Verify [last token, drafts...] per row in one forward; keep the accepted prefix + one."""
        t0 = time.perf_counter()
        ctx = max(s.num_cached + 1 + depth for s in seqs)
        c = self.runner.new_verify_call(len(seqs), depth, ctx)
        cand = np.full(c.tokens.shape, -1, np.int32)
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            self._fill_row(c, i, s, 1)
            n = 1 + len(d)
            c.tokens[i, 1:n] = d
            c.n_new[i] = n
            cand[i, : n - 1] = d
            c.counter[i] = s.num_cached + 1 + np.arange(c.counter.shape[1])
        tok, acc, lp = self.runner.run_verify(c, cand)
        hidden = self._hidden()
        res = SpecResult(technique, depth, propose_ms, (time.perf_counter() - t0) * 1e3, [0] * depth)
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            a = 0
            while a < len(d) and acc[i, a]:
                a += 1
            for j in range(a):
                res.per_pos[j] += 1
            res.proposed += len(d)
            res.accepted += a
            s.proposed += len(d)
            s.accepted += a
            s.num_cached += 1 + a  # the fed token and the accepted drafts are now valid cache
            if hidden is not None:
                s.hidden = hidden[i, a]
            self._emit(s, list(d[:a]) + [int(tok[i, a])], [float(x) for x in lp[i, : a + 1]], events, finished)
        return res

    def _run_prefill(self, seq: Sequence, n: int, events, finished) -> None:
        c = self.runner.new_call(1, n, seq.num_cached + n)
        self._fill_row(c, 0, seq, n)
        tok, lp = self.runner.run(c)
        seq.num_cached += n
        if seq.remaining == 0:  # the chunk reached the newest token: its logits give the next one
            hidden = self._hidden()
            seq.hidden = None if hidden is None else hidden[0, 0]
            self._emit(seq, [int(tok[0, 0])], [float(lp[0, 0])], events, finished)

    def _hidden(self) -> np.ndarray | None:
        """The latest call's final hidden states [B, Tl, d] as numpy, when a proposer needs them."""
        return np.asarray(self.runner.last_hidden, np.float32) if self._keep_hidden else None

    def _emit(self, seq: Sequence, toks, lps, events, finished) -> None:
        sp = seq.req.sampling
        stops = (frozenset() if sp.ignore_eos else self.stop_ids) | frozenset(sp.stop_token_ids)
        ev = append_tokens(seq, toks, lps if sp.logprobs else None, stops, self.max_context)
        events.append(ev)
        if ev.finished:
            finished.append(self._finish(seq, ev.finish_reason))

    def _stats(self, plan: StepPlan, wall: float, step_ms: float, spec: "SpecResult") -> StepStats:
        seqs = plan.decode + [s for s, _ in plan.prefill]
        return StepStats(
            step_id=self._step_id, time=wall, batch_size=len(seqs),
            prefill_tokens=sum(n for _, n in plan.prefill), decode_tokens=len(plan.decode) + spec.accepted,
            technique=spec.technique, depth=spec.depth, proposed=spec.proposed, accepted=spec.accepted,
            accepted_per_pos=tuple(spec.per_pos), propose_ms=spec.propose_ms,
            verify_ms=spec.verify_ms if spec.depth else step_ms, step_ms=step_ms,
            kv_pages_used=self.pool.used, kv_pages_free=self.pool.free,
            queue_len=len(self.scheduler.waiting), policy_version=self.policy.version,
            preempted=plan.preempted, tenants=tuple(sorted({s.req.tenant for s in seqs})),
        )

    # -- lifecycle and introspection ---------------------------------------
    def warmup(self, progress: Reporter = True) -> None:
        """Compile every shape of the runner and the proposers; `progress`: engine/progress.py."""
        self.runner.warmup(progress)
        for p in self.proposers.values():
            p.warmup(progress)
        self.runner.warm_compiles = compile_count()
        self.warmed_up = True
        if progress:
            limit, used = map_limit(), memory_mappings()
            if limit and used:
                note(progress, f"warmup: done, {compile_count()} executables compiled or loaded; {used} of "
                               f"this process's {limit} memory mappings in use")

    def compiles_since_warmup(self) -> int | None:
        w = self.runner.warm_compiles
        return None if w is None else compile_count() - w

    def status(self) -> dict:
        return {
            "model": self.model_name,
            "kv_pages_used": self.pool.used, "kv_pages_free": self.pool.free,
            "kv_pages_total": self.pool.total, "kv_pages_reserved": self.pool.reserved,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "compile_count": compile_count(), "compiles_since_warmup": self.compiles_since_warmup(),
            "policy_version": self.policy.version, "warmed_up": self.warmed_up,
            "proposers": {n: {"resident_bytes": p.resident_bytes(), "max_depth": p.max_depth}
                          for n, p in self.proposers.items()},
        }

