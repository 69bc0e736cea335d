"""Continuous batching with chunked prefill, page-aware admission and preemption.

One step's plan, in order:
1. Decode: every running sequence with exactly one uncached token joins the
   decode batch (up to max_batch). Each needs pages for one more position;
   when the pool is full the most recently arrived running sequence is
   preempted (pages freed, recomputed later from its tokens) until it fits.
2. Prefill: partially prefilled sequences continue, then waiting requests are
   admitted strictly first-come-first-served while the batch has room, the
   per-step token budget lasts, and the pool has pages for the whole prompt
   (taken at admission, so prefill chunks never wait for pages).
   A chunk is at most `max_chunk` tokens. An admitted sequence starts after
   the longest prefix of its tokens the prefix cache holds (KVPool.lookup),
   unless its prompt is scored (SamplingParams.prompt_logprobs).
   With `mix_tokens_per_row` (ragged steps: one call carries the decode rows
   and the chunks, engine/step/ragged_step.py): while sequences decode, a long
   prompt (more than `mix_long` tokens to compute at admission: one that needs
   several chunks) is prefilled `mix_chunk` tokens a step, at most `mix_rows`
   of them at once, so the running streams keep their pace however long it
   is. The chunk is not grown to fill the call's token bucket: a real prompt
   token costs its full share of the forward wherever it rides, where a
   padding slot costs little. A short
   prompt still takes the step's budget (one stall of at most a chunk, and
   bursts of short requests keep their time to first token), as vLLM's
   long-prefill threshold does. With nobody decoding the whole budget is
   used.
Before both, the pool split yields (KVPool.yield_to) so the longest sequence
running or at the queue's head can finish alone: a split that grows while a
large request waits shrinks for it instead of blocking the queue behind it.
Each step first registers the blocks the last step computed in the prefix
cache; a sequence that leaves (finished, aborted, preempted) registers all of
its computed blocks before its pages are released, so they stay cached.
The scheduler never touches device arrays; it only moves page ids.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.execute.sequence import Sequence, Status
from engine.memory.kv import KVPool


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_batch: int = 64
    """Most sequences running at once."""
    token_budget: int = 512
    """Most new tokens (decode + prefill) processed in one step."""
    max_chunk: int = 512
    """Longest prefill chunk of one sequence in one step."""
    lookahead: int = 0
    """Extra positions a decode reserves pages for (speculation's verify slots)."""
    mix_tokens_per_row: int = 0
    """While sequences decode: prefill tokens a step may add per decode row (`mix_chunk`); 0 = no cap."""
    mix_rows: int = 1
    """While sequences decode: most long prompts' chunks one step carries, with mix_tokens_per_row."""
    mix_long: int = 0
    """With mix_tokens_per_row: a prompt with more tokens than this to compute at admission is
    long (capped while others decode); 0: every prompt is."""

    def __post_init__(self) -> None:
        if self.token_budget < self.max_batch:
            raise ValueError(
                f"token_budget={self.token_budget} must be at least max_batch={self.max_batch}"
            )


MIX_TOKENS_PER_ROW = 4
"""Prefill tokens per decode row a ragged step carries for a long prompt (EngineCore's
SchedulerConfig.mix_tokens_per_row): a chunk's tokens also attend to the prompt cached before them,
so a few per decode row already cost about one decode step."""
MIX_MAX_CHUNK = 128
"""Most prefill tokens a step that decodes carries for a long prompt: the chunk rides in the decode
rows' call, so its size bounds how much a long prompt's admission slows the running streams'
steps."""
MIX_MIN_CHUNK = 16
"""Fewest prefill tokens a step that decodes carries for a long prompt."""


def mix_chunk(decoders: int, per_row: int) -> int:
    """Prefill tokens a step with `decoders` decode rows carries for a long prompt: per_row *
    decoders, at least MIX_MIN_CHUNK and at most MIX_MAX_CHUNK; 0 when per_row is 0 (no cap).

    >>> mix_chunk(1, 4), mix_chunk(10, 4), mix_chunk(64, 4), mix_chunk(8, 0)
    (16, 40, 128, 0)
    """
    if not per_row:
        return 0
    return min(max(per_row * decoders, MIX_MIN_CHUNK), MIX_MAX_CHUNK)


@dataclass
class StepPlan:
    """What one step runs."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    preempted: int = 0
    prefix_hit_tokens: int = 0
    """Tokens the sequences admitted this step found in the prefix cache."""
    prefix_query_tokens: int = 0
    """Tokens of the sequences admitted this step, when the prefix cache is on."""

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Owns the waiting queue and the running set; plans each step."""

    def __init__(self, cfg: SchedulerConfig, pool: KVPool):
        self.cfg = cfg
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.pages, seq.tokens, seq.num_cached)
        seq.status = Status.FINISHED
        if not self.running and not self.waiting:
            self.pool.yield_to(0)  # idle: the split is whole again (schedule() recomputes it anyway)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for seq in self.running:
            self.pool.cache_blocks(seq.pages, seq.tokens, seq.num_cached)
        heads = self.running + ([self.waiting[0]] if self.waiting else [])
        self.pool.yield_to(max(map(self._final_length, heads), default=0))
        budget = self._plan_decode(plan)
        self._plan_prefill(plan, budget)
        return plan

    def settled_decode(self, seq: Sequence, num_cached: int) -> bool:
        """Whether `seq`'s decode once `num_cached` positions are cached needs nothing of the pool
        (KVPool.settled): `schedule` would then plan it on the pages and tables it has now."""
        return self.pool.settled(seq.pages, num_cached, num_cached + 1 + self.cfg.lookahead)

    def _plan_decode(self, plan: StepPlan) -> int:
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.remaining != 1:
                continue
            if len(plan.decode) >= self.cfg.max_batch:
                break
            need = seq.num_cached + 1 + self.cfg.lookahead
            while not self.pool.grow(seq.pages, need):
                victim = self._preempt_newest()
                plan.preempted += 1
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.pool.prepare(seq.pages, seq.num_cached, need)
                plan.decode.append(seq)
        return self.cfg.token_budget - len(plan.decode)

    def _plan_prefill(self, plan: StepPlan, budget: int) -> None:
        in_decode = set(map(id, plan.decode))
        mixing = bool(plan.decode and self.cfg.mix_tokens_per_row)  # long prompts: keep it near a decode step
        cap = mix_chunk(len(plan.decode), self.cfg.mix_tokens_per_row) if mixing else 0
        longs = 0

        def room(seq: Sequence) -> int:
            """Tokens `seq` may prefill now; 0 when another long prompt has this step's place."""
            nonlocal longs
            if not (mixing and seq.long_prefill):
                return budget
            longs += 1
            return min(budget, cap) if longs <= self.cfg.mix_rows else 0

        for seq in self.running:
            if budget <= 0:
                return
            if id(seq) in in_decode or seq.remaining <= 1 and seq.num_cached > 0:
                continue
            if n := room(seq):
                budget -= self._add_chunk(plan, seq, n)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_batch:
            seq = self.waiting[0]
            # Pages for the whole prompt (and the first decode) are taken at admission,
            # so a running prefill never stalls for want of pages.
            scored = seq.req.sampling.prompt_logprobs is not None  # every prompt position is computed
            seq.num_cached = 0 if scored else self.pool.lookup(seq.pages, seq.tokens, seq.req.tenant)
            seq.long_prefill = seq.remaining > self.cfg.mix_long
            n = room(seq)
            if not n or not self.pool.grow(seq.pages, len(seq.tokens) + 1 + self.cfg.lookahead):
                self.pool.release(seq.pages)  # the hit's pages are cached again
                seq.num_cached = 0
                return  # strict FCFS: nobody jumps the queue
            queried = len(seq.tokens) if self.pool.prefix is not None else 0
            self.pool.count_prefix(seq.num_cached, queried)
            plan.prefix_hit_tokens += seq.num_cached
            plan.prefix_query_tokens += queried
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self._insert_running(seq)
            budget -= self._add_chunk(plan, seq, n)

    def _final_length(self, seq: Sequence) -> int:
        """Tokens `seq` holds pages for when it reaches max_tokens (verify slots included)."""
        return seq.n_prompt + seq.req.sampling.max_tokens + self.cfg.lookahead

    def preempt_all(self) -> int:
        """Send every running sequence back to the queue (pages freed); how many."""
        n = len(self.running)
        while self.running:
            self._preempt_newest()
        return n

    def _add_chunk(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        n = min(seq.remaining, budget, self.cfg.max_chunk)
        if not self.pool.grow(seq.pages, seq.num_cached + n):  # pages were taken at admission
            raise RuntimeError(f"{seq.request_id}: prefill chunk without pages")
        self.pool.prepare(seq.pages, seq.num_cached, seq.num_cached + n)
        plan.prefill.append((seq, n))
        return n

    def _insert_running(self, seq: Sequence) -> None:
        """Keep `running` in arrival order (a preempted sequence returns to its place)."""
        i = len(self.running)
        while i > 0 and self.running[i - 1].req.arrival_time > seq.req.arrival_time:
            i -= 1
        self.running.insert(i, seq)

    def _preempt_newest(self) -> Sequence:
        """Free the most recently arrived running sequence; it waits at the queue's front."""
        victim = max(self.running, key=lambda s: s.req.arrival_time)
        self.running.remove(victim)
        self.pool.release(victim.pages, victim.tokens, victim.num_cached)
        victim.status = Status.WAITING
        victim.num_cached = 0
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        return victim
