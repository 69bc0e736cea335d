"""`crossover bench tuner --trace memory-bound,light`: fixed pool splits against the tuner's.

1. The engine is loaded once: Gemma 3 270M with only the split technique's proposer
   (the draft model by default; n-gram is always there) and a KV pool of --kv-budget bytes,
   small enough that long contexts fill it on this machine; or with --fake a FakeEngine
   whose split is real (`split_fake`): tenants admit into total - floor(total * split)
   pages, and the draft proposer drafts only for the sequences whose reserved pages fit in
   the lent ones (in batch order), as the draft model's lent pool does; acceptance is drawn
   per prompt and position, the same in every run.
2. Per trace (bench.workloads.memory; arrivals a second: --high-rate for memory-bound,
   --low-rate for light, times --rate-scale), one run per fixed split (--splits): the technique at
   --split-depth for every batch size with that split, pinned on a fresh daemon
   (bench.tuner's run: a new SQLite telemetry database each, kept for step 3).
3. The tuner's decision: the performance model fitted on the telemetry of those runs (their
   steps and finished requests, as a retune reads its window; the runs are its exploration),
   the traffic observed from them, and the search's exact path (tuner.split.solve_splits)
   over "none" and the technique on the tuner's split grid. The decision sees step times,
   acceptance, batch sizes, queues and pages, never a run's measured goodput.
4. The chosen policy is pinned and run the same way.
5. Per trace: the chosen policy and split, the model's prediction for each split, each run's
   goodput (output tokens per second of engine step time, as bench tuner), throughput over
   the wall clock, TTFT, mean batch, queue and drafting share, and the ratio of the tuned
   run to the best fixed split (target 0.97). JSON to --out, progress on stderr.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.policy import BatchRule, TunedPolicy

TARGET = 0.97
"""Each trace's tuned run against its best fixed split."""
FAKE_PAGE_BYTES = 64 << 10
"""--fake: bytes of --kv-budget per page of the fake's pool."""


def run_split_bench(cfg: Any, out_path: str | None = None) -> dict[str, Any]:
    """Every trace of cfg.traces: fixed splits, the tuner's decision, its run; the JSON result."""
    keep = cfg.keep_db or tempfile.mkdtemp(prefix="crossover-bench-split-")
    try:
        return _bench(dataclasses.replace(cfg, keep_db=keep, techniques=(cfg.split_technique,),
                                          runs=("fixed",)), out_path)
    finally:
        if not cfg.keep_db:  # the telemetry databases were only for the tuner's decision
            shutil.rmtree(keep, ignore_errors=True)


def _bench(cfg: Any, out_path: str | None) -> dict[str, Any]:
    from bench.tuner import load_engine
    from bench.tuner_replay import log as _log

    engine = split_fake(cfg) if cfg.fake else load_engine(cfg)
    if cfg.fake:
        engine.warmup(progress=False)
    if cfg.split_technique not in engine.capacity().proposers:
        from daemon.user_error import UserError

        raise UserError(f"technique {cfg.split_technique} is not loaded "
                        f"(loaded: {', '.join(sorted(engine.capacity().proposers))})")
    traces = {name: _trace(cfg, engine, name) for name in cfg.traces}
    result = {"bench": "tuner-split", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "engine": _engine_info(engine), "config": _config(cfg), "traces": traces,
              "target": TARGET}
    for line in headline(result):
        _log(line)
    if out_path:
        import json

        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        _log(f"wrote {out_path}")
    return result


def fixed_policy(cfg: Any, engine: Any, split: float) -> TunedPolicy:
    """The split technique at --split-depth (no deeper than it drafts) at every batch size."""
    cap = engine.capacity()
    depth = min(cfg.split_depth, cap.max_depth, cap.proposers[cfg.split_technique].max_depth)
    top = engine.max_batch
    return TunedPolicy((BatchRule(top, cfg.split_technique, depth),), crossover=top, pool_split=split)


def _trace(cfg: Any, engine: Any, name: str) -> dict[str, Any]:
    from bench.tuner import _run
    from bench.tuner_replay import log as _log
    from bench.tuner_report import median_run
    from bench.workloads.memory import split_trace

    rate = (cfg.high_rate if name == "memory-bound" else cfg.low_rate) * cfg.rate_scale
    trace = split_trace(name, cfg.phase_s, rate)
    phases, arrivals = build_arrivals(cfg, engine, trace)
    _log(f"trace {name}: {len(arrivals)} requests in {cfg.phase_s:g} s; fixed splits "
         + ", ".join(f"{s:g}" for s in cfg.splits))
    rounds: list[dict[str, dict[str, Any]]] = []
    chosen, decision = None, None
    for r in range(cfg.split_repeats):  # each round: every fixed split, then the tuned policy
        tag = f"-r{r + 1}" if cfg.split_repeats > 1 else ""
        runs, dbs = {}, []
        for split in cfg.splits:
            label = f"{name}-split-{split:g}{tag}"
            record = asyncio.run(_run(cfg, engine, label, fixed_policy(cfg, engine, split), phases, arrivals))
            runs[f"{split:g}"] = measure(record)
            dbs.append(Path(cfg.keep_db) / f"{label}.db")
            _log(f"{label}: goodput {runs[f'{split:g}']['goodput']:.1f} tok/s")
        if chosen is None:  # the decision reads the first round's telemetry only
            decision = decide(cfg, engine, dbs)
            chosen = TunedPolicy.from_dict(decision["policy"])
        label = f"{name}-tuned{tag}"
        runs["tuned"] = measure(asyncio.run(_run(cfg, engine, label, chosen, phases, arrivals)))
        _log(f"{label}: split {chosen.pool_split:g}, goodput {runs['tuned']['goodput']:.1f} tok/s")
        rounds.append(runs)
    runs = {k: median_run([rd[k] for rd in rounds]) for k in rounds[0]}
    tuned = runs.pop("tuned")
    best = max(runs, key=lambda k: runs[k]["goodput"])
    ratio = tuned["goodput"] / runs[best]["goodput"] if runs[best]["goodput"] > 0 else None
    label = f"{name}-tuned" + (f" (median of {len(rounds)} rounds)" if len(rounds) > 1 else "")
    _log(f"{label}: split {chosen.pool_split:g}, goodput {tuned['goodput']:.1f} tok/s, "
         f"{ratio:.3f}x the best fixed split ({best})" if ratio else f"{label}: no goodput")
    bests = [max(run["goodput"] for k, run in rd.items() if k != "tuned") for rd in rounds]
    per_round = [round(rd["tuned"]["goodput"] / b, 4) if b > 0 else None for rd, b in zip(rounds, bests)]
    return {"requests": len(arrivals), "max_tokens": trace.max_tokens, "fixed": runs,
            "tuned": tuned, "decision": decision, "rounds": rounds if len(rounds) > 1 else None,
            "ratio_per_round": per_round, "chosen_split": chosen.pool_split,
            "best_fixed_split": float(best), "ratio": None if ratio is None else round(ratio, 4),
            "met": ratio is not None and ratio >= TARGET}


def build_arrivals(cfg: Any, engine: Any, trace: Any) -> tuple[list[Any], list[Any]]:
    """The trace's phases and its arrivals that fit the context (bench.tuner_replay.Arrival)."""
    from bench.loadgen import Job
    from bench.tuner_replay import Arrival
    from bench.workloads import trace as timed

    arrivals = []
    for t in timed(trace.phases, cfg.seed):
        p = t.prompt
        if len(engine.tokenizer.encode(p.render(engine.tokenizer))) + trace.max_tokens > engine.max_context:
            continue
        job = Job(len(arrivals), p, trace.max_tokens, t.at_s)
        body = {**job.body(engine.model_name), "ignore_eos": trace.ignore_eos}
        arrivals.append(Arrival(job.index, t.at_s, t.phase, t.tenant, job.route(), body))
    if not arrivals:
        from daemon.user_error import UserError

        raise UserError(f"trace {trace.name} is empty: raise --phase-seconds or --rate-scale")
    return list(trace.phases), arrivals


def measure(record: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: engine goodput over the trace's steps, wall throughput, TTFT, mean
    batch, queue and drafting share, and the steps' drafting technique."""
    start, end = record["bounds"][0][0], record["bounds"][-1][1]
    steps = [s for s, _ in record["steps"] if s.time >= start]
    tokens = sum(sum(t.values()) for s, t in record["steps"] if s.time >= start)
    engine_s = sum(s.step_ms for s in steps) / 1000.0
    streams = [s for s in record["streams"] if s.error is None and s.chunks]
    ttft = [s.chunks[0] - s.sent for s in streams]
    decode = [s for s in steps if s.batch_size]
    drafting = sum(s.speculating for s in decode if s.depth)
    return {
        "goodput": round(tokens / engine_s, 3) if engine_s > 0 else 0.0,
        "engine_tokens": tokens, "engine_s": round(engine_s, 3), "steps": len(steps),
        "wall_tok_s": round(sum(s.output_tokens for s in streams) / (end - start), 3) if end > start else 0.0,
        "errors": sum(s.error is not None for s in record["streams"]),
        "error_examples": sorted({s.error for s in record["streams"] if s.error})[:3],
        "ttft_s": {"p50": _q(ttft, 0.5), "p95": _q(ttft, 0.95)},
        "mean_batch": round(float(np.mean([s.batch_size for s in decode])), 2) if decode else 0.0,
        "mean_queue": round(float(np.mean([s.queue_len for s in steps])), 2) if steps else 0.0,
        "drafting_share": round(drafting / sum(s.batch_size for s in decode), 3) if decode else 0.0,
        "preempted": sum(s.preempted for s in steps), "policy": record["policy"],
    }


def _q(values: list[float], q: float) -> float | None:
    return round(float(np.quantile(values, q)), 4) if values else None


def decide(cfg: Any, engine: Any, dbs: list[Path]) -> dict[str, Any]:
    """The tuner's policy from the fixed runs' telemetry (module doc, 3), with its predictions."""
    from store.db import make_engine, session_scope
    from tuner.config import TunerConfig
    from tuner.data import read_requests, read_steps
    from tuner.model import PerfModel
    from tuner.objective import Capacity, evaluate
    from tuner.space import SearchSpace
    from tuner.split import solve_splits
    from tuner.traffic import observe

    steps, requests = [], []
    for path in dbs:
        db = make_engine(f"sqlite:///{path}")
        try:
            with session_scope(db) as session:
                steps += read_steps(session, 0.0, instance=None)
                requests += read_requests(session, 0.0, instance=None)
        finally:
            db.dispose()
    capacity = _capacity(Capacity.from_engine(engine.capacity()), cfg.split_technique)
    if not capacity.pools:  # EngineCapacity does not list its pools yet: read the engine's own
        capacity = dataclasses.replace(capacity, pools=engine_pools(engine))
    model = PerfModel.fit(steps, requests)
    tuner = TunerConfig()
    traffic = observe(steps, requests, tuner.concurrency_quantile)
    space = SearchSpace.build(dataclasses.replace(tuner, max_depth=max(1, capacity.max_depth)), capacity)
    policy = solve_splits(space, model, traffic, capacity)
    if policy is None:  # nothing fits: the default policy serves
        policy = TunedPolicy()
    predicted = {f"{s:g}": evaluate(fixed_policy(cfg, engine, s), model, traffic, capacity).to_dict()
                 for s in cfg.splits}
    return {"policy": policy.to_dict(), "predicted": evaluate(policy, model, traffic, capacity).to_dict(),
            "predicted_fixed": predicted, "traffic": traffic.summary(), "model": model.summary(),
            "steps": len(steps), "requests": len(requests), "pools": list(capacity.pools),
            "lent_kv": dict(capacity.lent_kv), "total_pages": capacity.total_pages}


def engine_pools(engine: Any) -> tuple[tuple[int, int], ...]:
    """(usable pages, ring cap per sequence) of the real engine's global and local pools, read
    from its KVPool and runner config; () for an engine without them (the fake: one pool).
    A stopgap until EngineCapacity reports `pools` (tuner.objective.Capacity.from_engine reads
    that field when it exists)."""
    pool, rc = getattr(engine, "pool", None), getattr(getattr(engine, "runner", None), "rc", None)
    try:
        return ((pool.global_alloc.num_pages - 1, 0), (pool.local_alloc.num_pages - 1, rc.ring_pages))
    except AttributeError:
        return ()


def _capacity(capacity: Any, technique: str) -> Any:
    """`capacity` with only `technique`'s proposer: the tuner chooses among what the fixed runs
    compare (plain decoding and the technique)."""
    keep = {technique}
    return dataclasses.replace(
        capacity, proposers={n: v for n, v in capacity.proposers.items() if n in keep},
        proposer_depths={n: v for n, v in capacity.proposer_depths.items() if n in keep},
        lent_kv={n: v for n, v in capacity.lent_kv.items() if n in keep})


def headline(result: dict[str, Any]) -> list[str]:
    """One line per trace for stderr."""
    lines = []
    for name, t in result["traces"].items():
        fixed = ", ".join(f"{s}: {r['goodput']:.1f}" for s, r in t["fixed"].items())
        lines.append(f"{name}: tuner split {t['chosen_split']:g} -> {t['tuned']['goodput']:.1f} tok/s, "
                     f"{t['ratio']}x the best fixed split {t['best_fixed_split']:g} (fixed {fixed})")
    if {"memory-bound", "light"} <= set(result["traces"]):
        mb, lt = result["traces"]["memory-bound"], result["traces"]["light"]
        lines.append(f"memory-bound split {mb['chosen_split']:g} "
                     f"{'<' if mb['chosen_split'] < lt['chosen_split'] else 'NOT <'} light split "
                     f"{lt['chosen_split']:g}")
    return lines


def _engine_info(engine: Any) -> dict[str, Any]:
    cap = engine.capacity()
    return {"engine": type(engine).__name__, "model": engine.model_name, "max_batch": engine.max_batch,
            "max_context": engine.max_context, "total_pages": cap.total_pages, "page_size": cap.page_size,
            "page_bytes": cap.page_bytes, "proposers": sorted(cap.proposers)}


def _config(cfg: Any) -> dict[str, Any]:
    keys = ("traces", "splits", "split_technique", "split_depth", "split_repeats", "kv_budget", "phase_s",
            "rate_scale", "low_rate", "high_rate",
            "seed", "max_batch", "max_context", "fake", "fake_time_scale")
    return {k: getattr(cfg, k) for k in keys}


# ---- the fake engine with a real split -------------------------------------------------
def split_fake(cfg: Any) -> Any:
    """A FakeEngine (module doc, 1) sleeping a memory-bound FakeCost (a step costs 10 ms and
    little per row, so batching pays and a binding pool costs throughput); the draft proposer
    accepts 0.6 then 0.4."""
    from engine.fake import FakeCost, FakeEngine, FakeProposer, _Sequence

    pages = (cfg.kv_budget or 512 * FAKE_PAGE_BYTES) // FAKE_PAGE_BYTES

    class SplitFake(FakeEngine):
        held: tuple[int, int, int] = (-1, 0, 0)  # (step, lent pages taken, rows held)

        def tenant_pages(self) -> int:
            return self.num_pages - math.floor(self.num_pages * self.policy.pool_split)

        def _admit(self) -> int:
            prefill, limit = 0, self.tenant_pages()
            while self._waiting and len(self._running) < self.max_batch:
                req = self._waiting[0]
                need = self._pages_for(req)
                if self.pages_used + need > (limit if self._running else self.num_pages):
                    break  # the split yields to a lone sequence, as the engine's pool does
                self._waiting.popleft()
                self.pages_used += need
                self._running[req.request_id] = _Sequence(req, self._script(req), need)
                prefill += len(req.prompt_ids) - self.prefixes.admit(req.prompt_ids, req.tenant)
            return prefill

        def _speculate(self, seq: Any, proposer: Any, depth: int) -> int:
            if proposer is None:
                return 0
            step, taken, rows = self.held if self.held[0] == self.step_count else (self.step_count, 0, 0)
            if taken + seq.pages > math.floor(self.num_pages * self.policy.pool_split):
                self.held = (step, taken, rows)
                return 0  # the lent pages cannot hold it: it decodes plainly
            self.held = (step, taken + seq.pages, rows + 1)
            # drafts accepted by the prompt and position, not the run's request id: every run
            # of a trace draws the same acceptance, so runs differ by their split alone
            prompt = hashlib.blake2b(bytes(str(seq.request.prompt_ids), "utf-8"), digest_size=8).hexdigest()
            return proposer.accepts(f"{prompt}:{seq.produced}", depth)  # counted as the base engine counts

        def step(self) -> Any:
            start = time.perf_counter()
            out = super().step()
            if out.stats is not None:
                s = out.stats
                rows = self.held[2] if self.held[0] == self.step_count - 1 else 0
                out.stats = dataclasses.replace(
                    s, proposed=s.depth * rows, kv_pages_free=max(0, self.tenant_pages() - self.pages_used))
                time.sleep(max(0.0, s.step_ms / 1000.0 * cfg.fake_time_scale - (time.perf_counter() - start)))
            return out

    return SplitFake(max_batch=cfg.max_batch, max_context=max(cfg.max_context, 8192), num_pages=pages,
                     proposers={cfg.split_technique: FakeProposer(cfg.split_technique, (0.6, 0.4))},
                     max_depth=4, cost=FakeCost(base_ms=10.0, per_seq_ms=0.1, per_token_ms=0.05,
                                                per_draft_ms=0.05))
