"""`crossover bench tuner`: the autotuned daemon against static policies on a shifting trace.

1. Load the engine once: Gemma 3 270M with speculation verified up to
   --max-batch (n-gram, and those heads-based proposers of --techniques, all
   by default, when a heads file exists), or with --fake a
   FakeEngine whose proposers' acceptance depends on the tenant (high for
   copy, low for prose) and which sleeps its FakeCost step time, so wall time
   follows the policy as on a real accelerator.
2. The trace: `bench.workloads.shifting_trace` (low-load copy-heavy at batch
   1-2, high-load mixed beyond what the engine serves at --max-batch, low-load
   prose at batch 1-2; with --mid-mixed a fourth phase of every tenant at
   moderate load, batches of about 4-8), --phase-seconds each, rates times --rate-scale,
   Poisson arrivals, each phase starting once the previous one's requests
   have finished (--no-drain: back to back, so a backlog carries over and
   mixes with the next phase's traffic); each request is sent by its kind's tenant
   ("copy-tenant", ...) with that tenant's API key, so the tuner sees
   per-tenant acceptance as in production. Chat and prose requests sample
   (temperature 0.8, a seed each; --temperatures), copy and code are greedy,
   as their clients would ask: sampled text repeats itself less, so n-gram
   drafts pay less there than on greedy output.
3. One run per policy, each on a fresh daemon started in this process
   (`make_app`, a new temporary SQLite telemetry database, the kind tenants,
   an admin token), sharing the engine: static policies are pinned over
   PUT /admin/policy/pin with the tuner off; the autotuned run has the tuner
   on with time-compressed settings (retune interval, fit window, validation
   window and baselines scaled to the phase length); a "single-rule" run
   (--runs ...,single-rule) is the same daemon with per-tenant rules off
   (TunerConfig.tenant_rules), what the autotuned run is worth to compare
   when it may also give tenants rules of their own. The trace is replayed
   open loop (a phase's max_concurrency holds later arrivals back). A thin
   wrapper around the engine keeps every step's StepStats and output tokens
   per request id; the client keeps each request's id (X-Request-Id) and
   every streamed chunk's time.
4. Autotuned run only, after the trace: the retune probe. Closed-loop
   traffic of the mixed phase at --probe-concurrency, scheduled retunes off,
   one retune to settle on that traffic, then --probe-retunes admin retunes
   (POST /admin/retune), each after a quiet window. An inter-token gap (time
   between two streamed chunks of one request) counts as "during" when it
   ends while a retune searches, as "without" when it overlaps no retune.
5. Summary (`bench.tuner_report`): per policy and phase, goodput =
   output tokens per second of engine step time, of the requests that
   arrived in the phase (each step's time split evenly over the requests it
   emitted tokens for), so a backlog served later still counts where it
   arrived; at low load the client's throughput is the offered load whatever
   the policy, engine time is what a policy saves. Also the clients' TTFT /
   TPOT / inter-token percentiles, and the ratios against their targets;
   JSON to --out, PNG next to it, progress on stderr.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.tuner_config import TUNED, TunerBenchConfig
from bench.tuner_replay import Arrival, Client, Stream, log, replay, retune_probe
from daemon.user_error import UserError
from engine.policy import BatchRule, TenantRule, TunedPolicy
from engine.types import StepStats


class RecordingEngine:
    """The engine as the daemon sees it (daemon.bridge.Engine): every step's stats and output
    tokens per request are kept (appended on the engine thread); the rest is the wrapped
    engine's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.tokenizer, self.model_name = engine.tokenizer, engine.model_name
        self.max_context = engine.max_context
        self.steps: list[tuple[StepStats, dict[str, int]]] = []
        self.add_request, self.abort, self.has_work = engine.add_request, engine.abort, engine.has_work
        self.warmup, self.status, self.capacity = engine.warmup, engine.status, engine.capacity
        self.set_policy, self.recover = engine.set_policy, engine.recover

    @property
    def policy(self) -> Any:
        return self._engine.policy

    def step(self) -> Any:
        out = self._engine.step()
        if out.stats is not None:
            tokens: dict[str, int] = {}
            for event in out.events:
                if event.token_ids:
                    tokens[event.request_id] = tokens.get(event.request_id, 0) + len(event.token_ids)
            self.steps.append((out.stats, tokens))
        return out


# ---- the bench ---------------------------------------------------------------------
def run_bench(cfg: TunerBenchConfig, out_path: str | None = None) -> dict[str, Any]:
    """Run every policy over the trace and return (and write) the JSON result."""
    from bench.tuner_report import combine_rounds, headline, summarize, write_result
    from bench.tuner_retunes import with_pooled_probes
    from daemon.progress import reporter
    from engine.runtime.compiles import freeze_heap
    from engine.runtime.progress import Steps

    engine = load_engine(cfg)
    phases, arrivals = build_trace(cfg, engine)
    policies = static_policies(cfg, engine)
    tuned = [name for name in TUNED if name in cfg.runs]
    log(f"{len(arrivals)} requests over {len(phases)} phases of {cfg.phase_s:g} s; policies: "
        + ", ".join(tuned + list(policies)))
    order = [(name, None) for name in tuned] + list(policies.items())
    rounds: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    with Steps(reporter(), "bench tuner: runs", len(order) * cfg.repeats) as bar:
        for r in range(cfg.repeats):
            # later rounds rotate the order; each round's autotuned run ends with the probe
            runs: dict[str, dict[str, Any]] = {}
            for name, policy in order[r % len(order):] + order[:r % len(order)]:
                if cfg.repeats > 1:
                    log(f"round {r + 1}/{cfg.repeats}: {name}")
                tag = f"-r{r + 1}" if cfg.repeats > 1 else ""
                runs[name] = asyncio.run(_run(cfg, engine, name, policy, phases, arrivals, tag))
                # the records kept for the report live to the end: out of the collector's full
                # walks, which would otherwise lengthen with every run and stall later runs' steps
                freeze_heap()
                bar.advance()
            if runs.get("autotuned", {}).get("probe") is not None:
                probes.append(runs["autotuned"]["probe"])
            rounds.append(summarize(cfg, engine, phases, arrivals, runs))
    result = combine_rounds(rounds)
    if len(rounds) > 1:
        result = with_pooled_probes(result, probes)
    for line in headline(result):
        log(line)
    if out_path:
        write_result(result, out_path)
        log(f"wrote {out_path} and {Path(out_path).with_suffix('.png')}")
    return result


def load_engine(cfg: TunerBenchConfig) -> Any:
    if cfg.fake:
        engine = fake_engine(cfg)
        engine.warmup(progress=False)
        return engine
    from engine.loader import MODEL_PROPOSERS
    from engine.loader import load_engine as load

    # Verification is compiled up to the largest batch, so a fixed policy speculates at every
    # batch size and the tuner's crossover ranges over all of them (`crossover serve` stops at
    # SPEC_MAX_BATCH). Only --techniques' proposers and those the static policies name are
    # loaded: the autotuned daemon chooses among them.
    wanted = set(cfg.techniques) | named_techniques(cfg)
    proposers = tuple(t for t in MODEL_PROPOSERS if not cfg.techniques or t in wanted)
    from daemon.progress import reporter

    progress = reporter()
    log("loading the model with speculation")
    engine = load(model=cfg.model, dtype=cfg.dtype, max_batch=cfg.max_batch, kv_budget_bytes=cfg.kv_budget,
                  max_context=cfg.max_context, speculation=True, heads=cfg.heads,
                  spec_max_batch=cfg.max_batch, model_proposers=proposers, progress=progress)
    log(f"proposers: {', '.join(sorted(engine.proposers)) or 'none'}; warming up")
    engine.warmup(progress=progress)
    from bench.engine import run_each_shape_once

    run_each_shape_once(engine, progress)
    return engine


def fake_engine(cfg: TunerBenchConfig) -> Any:
    """A FakeEngine that sleeps its FakeCost; n-gram pays on copy traffic at small batches."""
    from engine.fake import FakeCost, FakeEngine, FakeProposer

    class CostedFake(FakeEngine):
        def step(self) -> Any:
            start = time.perf_counter()
            out = super().step()
            if out.stats is not None:
                time.sleep(max(0.0, out.stats.step_ms / 1000.0 * cfg.fake_time_scale
                               - (time.perf_counter() - start)))
            return out

    proposers = {"ngram": FakeProposer("ngram", (0.9, 0.85, 0.8, 0.75)),
                 "mtp": FakeProposer("mtp", (0.6, 0.5, 0.4, 0.3))}
    acceptance = {"copy-tenant": 1.0, "code-tenant": 0.6, "chat-tenant": 0.3, "prose-tenant": 0.15}
    return CostedFake(max_batch=cfg.max_batch, max_context=max(cfg.max_context, 8192),
                      proposers=proposers, max_depth=4, tenant_acceptance=acceptance,
                      cost=FakeCost(base_ms=5.0, per_seq_ms=0.2, per_token_ms=0.6, per_draft_ms=0.05))


def build_trace(cfg: TunerBenchConfig, engine: Any) -> tuple[list[Any], list[Arrival]]:
    """The phases and every arrival that fits the engine's context, in time order."""
    from bench.loadgen import Job
    from bench.workloads import shifting_trace, trace

    phases = shifting_trace(cfg.phase_s, cfg.low_rate * cfg.rate_scale,
                            cfg.high_rate * cfg.rate_scale, cfg.low_max_concurrency,
                            cfg.mid_rate * cfg.rate_scale if cfg.mid_phase else None,
                            cfg.mid_max_concurrency)
    arrivals, dropped = [], 0
    temperatures = dict(cfg.temperatures)
    for timed in trace(phases, cfg.seed):
        p = timed.prompt
        max_tokens = min(p.max_tokens, cfg.max_tokens or p.max_tokens)
        if len(engine.tokenizer.encode(p.render(engine.tokenizer))) + max_tokens > engine.max_context:
            dropped += 1
            continue
        job = Job(len(arrivals), p, max_tokens, timed.at_s)
        body = {**job.body(engine.model_name), "ignore_eos": cfg.ignore_eos}
        temperature = temperatures.get(p.kind, 0.0)
        if temperature > 0:
            body.update(temperature=temperature, seed=cfg.seed * 100_003 + job.index)
        arrivals.append(Arrival(job.index, timed.at_s, timed.phase, timed.tenant, job.route(), body))
    if dropped:
        log(f"{dropped} prompts do not fit max_context {engine.max_context} and are left out")
    if not arrivals:
        raise UserError("the trace is empty: raise --phase-seconds or --rate-scale")
    return phases, arrivals


def static_policies(cfg: TunerBenchConfig, engine: Any) -> dict[str, TunedPolicy]:
    """name -> policy: "never", "fixed:<technique>@<depth>" for each, and "table"."""
    proposers = engine.capacity().proposers
    loaded = sorted(proposers)
    techniques = cfg.fixed_techniques or cfg.techniques or tuple(loaded)
    wanted = set(techniques) | named_techniques(cfg)
    missing = sorted(wanted - set(loaded))
    if missing:
        raise UserError(f"technique(s) {', '.join(missing)} not loaded (loaded: {', '.join(loaded)})")
    top = engine.max_batch
    out: dict[str, TunedPolicy] = {}
    if "never" in cfg.runs:
        out["never"] = TunedPolicy()
    if "fixed" in cfg.runs:
        for t in techniques:
            for d in (d for d in cfg.depths if d <= _deepest(engine, t)):
                out[f"fixed:{t}@{d}"] = TunedPolicy((BatchRule(top, t, d),), crossover=top,
                                                    **_memory(cfg, engine, t))
    if "table" in cfg.runs:
        t = cfg.table_technique
        rules = tuple(BatchRule(b, t, d) for b, d in cfg.table)
        rules += (BatchRule(max(top, rules[-1].max_batch + 1)),)
        out["table"] = TunedPolicy(rules, crossover=cfg.table[-1][0], **_memory(cfg, engine, t))
    if "tenants" in cfg.runs:
        out["tenants"] = tenant_policy(cfg, engine)
    return out


def named_techniques(cfg: TunerBenchConfig) -> set[str]:
    """The techniques the static policies name besides `techniques`: the fixed policies', the
    table's and the "tenants" run's (the engine loads them too)."""
    named = set(cfg.fixed_techniques) if "fixed" in cfg.runs else set()
    named |= {cfg.table_technique} if "table" in cfg.runs else set()
    if "tenants" in cfg.runs:
        named |= {t for _, t, _ in cfg.tenant_policy if t != "none"}
    return named


def _deepest(engine: Any, technique: str) -> int:
    """The deepest a static policy drafts with `technique`: no deeper than the proposer drafts
    (e.g. MTP: its heads) or the engine's verify compiled."""
    cap = engine.capacity()
    return min(cap.proposers[technique].max_depth, cap.max_depth)


def tenant_policy(cfg: TunerBenchConfig, engine: Any) -> TunedPolicy:
    """The "tenants" run's policy (TunerBenchConfig.tenant_policy) at every batch size the
    engine runs; each technique no deeper than it drafts or the engine verifies."""
    top = engine.max_batch

    def depth(t: str, d: int) -> int:
        return 0 if t == "none" else min(d, _deepest(engine, t))

    base = next((t, depth(t, d)) for n, t, d in cfg.tenant_policy if n == "*")
    rules = tuple(TenantRule(n, t, depth(t, d), max_batch=top) for n, t, d in cfg.tenant_policy
                  if n != "*")
    used = [t for _, t, _ in cfg.tenant_policy if t != "none"]
    memory = _memory(cfg, engine, used[0]) if used else {}
    return TunedPolicy((BatchRule(top, *base),), crossover=top, tenants=rules, **memory)


def _memory(cfg: TunerBenchConfig, engine: Any, technique: str) -> dict[str, Any]:
    """Pool split (none for n-gram) and, for MTP, its smallest compiled draft vocabulary
    (as `crossover bench crossover` uses)."""
    if technique == "ngram":
        return {"pool_split": 0.0}
    mtp = engine.capacity().proposers.get("mtp")
    vocabs = mtp.draft_vocabs if technique == "mtp" and mtp else ()
    return {"pool_split": cfg.pool_split, "draft_vocab": min((v for v in vocabs if v), default=0)}


# ---- one run: a fresh daemon, the trace, the probe ----------------------------------
async def _run(cfg: TunerBenchConfig, engine: Any, name: str, policy: TunedPolicy | None,
               phases: list[Any], arrivals: list[Arrival], tag: str = "") -> dict[str, Any]:
    """Serve the trace under `policy` (None: the tuner) on a fresh daemon; the raw record.
    `tag` ends the kept database's file name (a round of --repeats)."""
    import aiohttp
    from aiohttp import web

    from bench.loadgen import forget_prefixes
    from bench.serve_stats import CpuMeter
    from bench.tuner_retunes import read_history
    from daemon.app import make_app
    from daemon.database import open_database
    from daemon.state import ENGINE_THREAD
    from daemon.tuning import TUNER
    from telemetry.recorder import RecorderConfig, RetentionConfig

    # Every run replays the same prompts: a prefix cache kept from the run before would skip
    # most of this run's prefill (the first run, the autotuned one, would pay for all the others).
    forget_prefixes(engine)
    admin = secrets.token_hex(16)
    recording = RecordingEngine(engine)
    with tempfile.TemporaryDirectory(prefix="crossover-bench-tuner-") as tmp:
        recorder = RecorderConfig(flush_interval_s=min(1.0, cfg.phase_s / 30),
                                  retention=RetentionConfig())
        path = Path(tmp) / "telemetry.db"
        if cfg.keep_db:  # each run's database, for a look at what the tuner saw
            path = Path(cfg.keep_db) / f"{name.replace(':', '-').replace('@', '-')}{tag}.db"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
        database = open_database(f"sqlite:///{path}", recorder_config=recorder)
        # every request waits in the engine's queue, where the policy and the pool decide: the
        # daemon's default tenant cap (half of max_batch in flight, none queued) would refuse
        # a busy phase's backlog with 429s, fewer for a faster policy
        limits = {"max_concurrent": len(arrivals) + 1}
        keys = _tenants(database, sorted({a.tenant for a in arrivals}), limits)
        app = make_app(_settings(cfg, engine, policy is None, admin, len(arrivals),
                                 tenant_rules=name != "single-rule"), recording,
                       database=database, warmup=False)
        tuner = app[TUNER]
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            while not app[ENGINE_THREAD].ready:
                await asyncio.sleep(0.01)
            # a daemon's search process warms up while its engine compiles; here the engine
            # is warm already, so wait for it (bounded) as traffic would after a real start
            deadline = time.monotonic() + 120.0
            while not tuner.search_ready and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            base = f"http://127.0.0.1:{runner.addresses[0][1]}"
            timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=timeout) as http:
                client = Client(http, base, keys, admin)
                if policy is not None:
                    await client.admin("PUT", "/admin/policy/pin", policy.to_dict())
                warm = dataclasses.replace(arrivals[0], body={**arrivals[0].body, "max_tokens": 2})
                await client.stream(warm, Stream(-1, 0))
                meter, compiles, children = CpuMeter(), _compiles(engine), _children_cpu()
                wall = time.perf_counter()
                streams, bounds = await replay(client, phases, arrivals, name, cfg.drain)
                search_cpu = _children_cpu(children)
                share, steal = meter.share(), meter.steal()
                capacity = (time.perf_counter() - wall) * (os.cpu_count() or 1)
                contention = {  # the search process is this bench's own, not "other"
                    "other_processes_cpu_share":
                        None if share is None else round(max(0.0, share - search_cpu / capacity), 3),
                    "steal_share": steal,
                    "search_process_cpu_s": round(search_cpu, 2),
                    "compiles_during_trace": _compiles(engine) - compiles}
                if (contention["other_processes_cpu_share"] or 0.0) > 0.1:
                    log(f"{name}: other processes took {contention['other_processes_cpu_share']:.0%} "
                        f"of the CPU during the trace (the hypervisor's steal: {steal or 0:.0%} of the "
                        "CPU): its figures are not comparable")
                probe = (await retune_probe(client, cfg, tuner, arrivals)
                         if name == "autotuned" and cfg.probe_retunes else None)
                history = await asyncio.to_thread(read_history, database, bounds[0][0])
        finally:
            await runner.cleanup()
    return {"bounds": bounds, "steps": recording.steps, "streams": streams, **contention,
            "probe": probe, "history": history, "policy": None if policy is None else policy.to_dict()}


def _children_cpu(since: dict[int, float] | None = None) -> Any:
    """CPU seconds of this process's live children (the spawned search process), per pid;
    with `since`, the total used since then."""
    import multiprocessing

    now = {}
    for child in multiprocessing.active_children():
        try:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            now[child.pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            continue
    if since is None:
        return now
    return sum(t - since.get(pid, 0.0) for pid, t in now.items())


def _compiles(engine: Any) -> int:
    """XLA compilations so far (serving should add none; the fake has none)."""
    return int(engine.status().get("compile_count") or 0)


def _settings(cfg: TunerBenchConfig, engine: Any, tuned: bool, admin: str, requests: int,
              tenant_rules: bool = True) -> Any:
    from daemon.settings import Settings
    from tuner.config import TunerConfig

    tuner = TunerConfig(
        enabled=tuned, tenant_rules=tenant_rules, min_new_steps=cfg.min_new_steps, trials=cfg.trials,
        profile_steps=cfg.profile_steps, validation_min_steps=cfg.validation_min_steps,
        search_process=cfg.search_process, **cfg.tuner_times())
    return Settings(
        host="127.0.0.1", port=0, max_batch=engine.max_batch, max_context=engine.max_context,
        max_waiting=max(256, requests), open_mode=False, admin_token=admin, log_level="warning",
        tuner=tuner)


def _tenants(database: Any, names: list[str], limits: dict[str, Any] | None = None) -> dict[str, str]:
    """Create the trace's tenants (with `limits`, else the daemon's defaults); name -> API key."""
    from daemon.tenants.admin_ops import create_tenant
    from store.db import session_scope

    with session_scope(database.engine) as session:
        return {name: create_tenant(session, name, dict(limits or {}))[1] for name in names}
