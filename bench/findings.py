"""`crossover bench findings`: measure what `crossover report` needs into one database, then report.

1. Migrate the telemetry database `--db` to head (it may be new). The runs are data
   (bench/findings_plan.py `plan`); with `--dry-run` print them and their estimated time, and stop.
2. Engines (`Engines`), loaded when a run first needs one: "main" (Q1, Q2) is Gemma 3 270M with every
   proposer and the budget `kv_budget`; each Q3 engine loads one proposer alone ("q3-none": none at all)
   with the budget `q3_kv_budget`, so plain decoding holds speculation's resident bytes as KV pages. With
   `--quick` each is engine/fake.py's FakeEngine, its pool smaller by the proposers' resident bytes.
3. Every run drives `EngineCore.step()` on this thread and hands each StepStats and finished
   RequestResult to a `telemetry.recorder.Recorder` (the daemon's path into `xo_steps` and
   `xo_requests`) under the run's instance (bench/report/runs.py names them by phase, context and
   round). Each run's policy gets its own version, saved to `xo_policies` (source "admin"), and its
   request ids start `v{version}-`, so every step and request names the run behind it. A Q3 run first
   empties the prefix cache, so no run reuses another's prompts.
4. Prompts: Q1, each kind's first `q1_prompts` of bench/crossover.py's draw (greedy, then sampled with a
   seed per request); Q2 and Q3, prompts that fill their context (`context_prompts`: a kind's prompts
   concatenated), kinds round-robin, a batch of b taking the first b.
5. Flush, write a JSON of what ran (runs, wall times, engines, machine, the estimate) next to the report,
   and build the report (bench.report) with the command, the machine and `note` in its header.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.crossover import prompt_ids, verify_tokens_for
from bench.findings_config import RESIDENT_TECHNIQUES, FindingsConfig
from bench.findings_plan import MAIN, PlannedRun, estimate_s, plan
from bench.report.runs import POOL_BASE, Q2_BASE, TENANT_BASE
from bench.workloads import tenant_for
from engine.policy import BatchRule, TunedPolicy
from engine.types import Request, SamplingParams

TENANT_INSTANCE, INSTANCE, POOL_INSTANCE = TENANT_BASE, Q2_BASE, POOL_BASE
"""Base instance names of Q1, Q2 and Q3 (bench/report/runs.py adds sampling, context and round)."""
FAKE_PAGE_BYTES = 64 << 10
"""Bytes of one fake KV page: a fake engine's pool loses its proposers' resident bytes in these."""


@dataclass
class Run:
    """One batch of requests under one policy, as `findings.json` lists it."""

    phase: str
    instance: str
    engine: str
    version: int
    technique: str
    depth: int
    pool_split: float
    requests: int
    tenants: list[str]
    round: int = 0
    context: int = 0
    sampling: str = "greedy"
    prefix_reset: bool = False
    wall_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    step_ms: float = 0.0
    peak_batch: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    tenant_pages: list[int] = field(default_factory=list)
    """Smallest and largest kv_pages_used + kv_pages_free seen."""


class Engines:
    """The engines of a findings run by name, each loaded when first asked for."""

    def __init__(self, cfg: FindingsConfig, log: Any) -> None:
        self.cfg, self.log = cfg, log
        self.loaded: dict[str, Any] = {}
        self.facts: dict[str, dict[str, Any]] = {}

    def get(self, name: str) -> Any:
        if name not in self.loaded:
            for other in [n for n in self.loaded if n == MAIN and name != MAIN]:
                self.drop(other)  # Q3 follows Q1 and Q2: the main engine's memory goes first
            self.loaded[name] = load(self.cfg, self.log, name)
            self.facts[name] = _engine_facts(self.loaded[name])
        return self.loaded[name]

    def drop(self, name: str) -> None:
        import gc

        self.loaded.pop(name, None)
        gc.collect()


class Driver:
    """Runs batches on the engines, recording every step into the database under an instance."""

    def __init__(self, engines: Engines, db: str, log: Any) -> None:
        self.engines, self.db, self.log = engines, db, log
        self.runs: list[Run] = []
        self.version = _last_version(db)
        """Policy versions continue after the database's highest, so a later run appends."""
        self._recorders: dict[str, Any] = {}

    def recorder(self, instance: str) -> Any:
        from telemetry.recorder import Recorder

        if instance not in self._recorders:
            self._recorders[instance] = Recorder(self.db, instance=instance, max_buffer=1_000_000).start()
        return self._recorders[instance]

    def policy(self, engine: Any, instance: str, technique: str, depth: int, split: float) -> TunedPolicy:
        """A new version speculating at every batch size (technique "none": never), saved."""
        from store.db import make_engine, session_scope
        from store.history import save_policy

        self.version += 1
        top = engine.max_batch
        policy = (TunedPolicy(pool_split=split, version=self.version, source="admin")
                  if technique == "none" else
                  TunedPolicy(rules=(BatchRule(top, technique, depth),), crossover=top, pool_split=split,
                              version=self.version, source="admin"))
        db = make_engine(self.db)
        try:
            with session_scope(db) as session:
                save_policy(session, self.version, policy.to_dict(), "admin", instance=instance)
        finally:
            db.dispose()
        return policy

    def run(self, p: PlannedRun, prompts: list[tuple[str, list[int]]],
            temperature: float = 0.0) -> Run | None:
        """Submit every (tenant, ids) at once under a fresh policy; step until all finish. None when
        the run's engine did not load its technique."""
        engine = self.engines.get(p.engine)
        if p.technique != "none" and p.technique not in engine.proposers:
            return None
        depth = 0 if p.technique == "none" else min(p.depth, engine.proposers[p.technique].max_depth)
        if p.reset_prefix:
            _empty_prefix_cache(engine)
        policy = self.policy(engine, p.instance, p.technique, depth, p.split)
        rec = self.recorder(p.instance)
        engine.set_policy(policy)
        run = Run(p.phase, p.instance, p.engine, policy.version, p.technique, depth, p.split, len(prompts),
                  sorted({t for t, _ in prompts}), p.round, p.context, p.sampling, p.reset_prefix)
        started = time.perf_counter()
        for i, (tenant, ids) in enumerate(prompts):
            rid = f"v{policy.version}-{i}"
            sp = (SamplingParams(max_tokens=p.new_tokens, ignore_eos=True) if p.sampling == "greedy" else
                  SamplingParams(max_tokens=p.new_tokens, ignore_eos=True, temperature=temperature,
                                 seed=zlib.crc32(f"{tenant}-{i}".encode())))
            engine.add_request(Request(rid, list(ids), sp, tenant=tenant))
        pages: list[int] = []
        while engine.has_work():
            out = engine.step()
            for result in out.finished:
                rec.record_request(result)
            st = out.stats
            if st is None:
                continue
            rec.record_step(st)
            run.steps += 1
            run.tokens += st.decode_tokens
            run.step_ms += st.step_ms
            run.peak_batch = max(run.peak_batch, st.batch_size)
            run.prefix_hit_tokens += st.prefix_hit_tokens
            run.prefix_query_tokens += st.prefix_query_tokens
            pages.append(st.kv_pages_used + st.kv_pages_free)
        run.wall_s = time.perf_counter() - started
        run.tenant_pages = [min(pages), max(pages)] if pages else []
        self.runs.append(run)
        rate = run.tokens / (run.step_ms / 1e3) if run.step_ms else 0.0
        self.log(f"  {p.phase} {p.instance} v{run.version} {p.technique}@{depth} split {p.split:g}: "
                 f"{len(prompts)} requests, {run.steps} steps, {rate:.1f} tok/s of step time, peak batch "
                 f"{run.peak_batch}, {run.wall_s:.1f} s")
        return run

    def close(self) -> None:
        for rec in self._recorders.values():
            rec.close(timeout=120)
        self._recorders.clear()


def _empty_prefix_cache(engine: Any) -> None:
    """Empty the prefix cache of an idle engine (its reset runs at the next step)."""
    done = engine.reset_prefix_cache()
    while not done.done():
        engine.step()


def _last_version(db: str) -> int:
    """The highest policy version any instance of `db` holds (0: none)."""
    from sqlalchemy import func, select

    from store.db import make_engine, session_scope
    from store.models import Policy

    engine = make_engine(db)
    try:
        with session_scope(engine) as session:
            return int(session.scalar(select(func.max(Policy.version))) or 0)
    finally:
        engine.dispose()


def _proposers_of(cfg: FindingsConfig, name: str) -> tuple[str, ...]:
    """Model proposers engine `name` loads: main, every one asked for; q3-T, T alone (none for q3-none)."""
    if name == MAIN:
        return tuple(cfg.techniques)
    tech = name.removeprefix("q3-")
    return (tech,) if tech in RESIDENT_TECHNIQUES and tech in cfg.techniques else ()


def load(cfg: FindingsConfig, log: Any, name: str = MAIN) -> Any:
    """Engine `name` (see `Engines`): the real model, or the fake with `quick`."""
    if cfg.quick:
        return fake_engine(cfg, name)
    from daemon.progress import reporter
    from engine.loader import MODEL_PROPOSERS, load_engine
    from engine.model.gemma import ATTEND_BLOCK

    progress = reporter()
    wanted = tuple(t for t in MODEL_PROPOSERS if t in _proposers_of(cfg, name))
    if name == MAIN:
        depths, longest, budget = (*cfg.depths, cfg.depth), max(cfg.prompt_tokens + cfg.q1_new_tokens,
                                                                 *cfg.contexts), cfg.kv_budget
    else:
        depths, longest, budget = (cfg.depth,), cfg.q3_context, cfg.q3_kv_budget
    verify = verify_tokens_for(depths)
    # A multiple of the attention block, not a power of two: the pool is sized for the rows that fit at
    # max context, so 8192 for a 4096-token grid would halve the rows (and the ring pages) it holds.
    context = -(-(longest + verify[-1] + 2) // ATTEND_BLOCK) * ATTEND_BLOCK
    speculation = name == MAIN or bool(wanted)  # the plain Q3 engine compiles no verify shapes
    log(f"loading engine {name} ({cfg.model or 'Gemma 3 270M'}, proposers: {', '.join(wanted) or 'none'}): "
        f"budget {budget / 2**20:.0f} MiB, context {context}, max batch {cfg.max_batch}")
    engine = load_engine(model=cfg.model, dtype=cfg.dtype, kv_budget_bytes=budget, max_batch=cfg.max_batch,
                         max_context=context, token_budget=2048, speculation=speculation, heads=cfg.heads,
                         verify_tokens=verify, spec_max_batch=cfg.max_batch, model_proposers=wanted,
                         progress=progress)
    log(f"engine {name}: proposers {', '.join(sorted(engine.proposers)) or 'none'}; warming up (compiles "
        "are cached on disk)")
    engine.warmup(progress=progress)
    from bench.engine import run_each_shape_once

    run_each_shape_once(engine, progress)
    return engine


def fake_engine(cfg: FindingsConfig, name: str = MAIN) -> Any:
    """engine/fake.py's engine with the proposers of `name`, acceptance scaled per tenant, simulated step
    times; its pool is smaller by the proposers' resident bytes (FAKE_PAGE_BYTES a page)."""
    from engine.fake import FakeCost, FakeEngine, FakeProposer

    every = {"ngram": FakeProposer("ngram", (0.8, 0.7, 0.6, 0.5)),
             "mtp": FakeProposer("mtp", (0.6, 0.4, 0.3), resident=8 * FAKE_PAGE_BYTES),
             "early_exit": FakeProposer("early_exit", (0.5, 0.4, 0.3)),
             "draft": FakeProposer("draft", (0.55, 0.45, 0.35), resident=4 * FAKE_PAGE_BYTES)}
    wanted = _proposers_of(cfg, name)
    proposers = {n: p for n, p in every.items() if n in wanted or (n == "ngram" and name != "q3-none")}
    resident = sum(p.resident for p in proposers.values()) // FAKE_PAGE_BYTES
    pages = (4096 if name == MAIN else 40) - resident  # a Q3 pool holds fewer requests than max_batch
    scale = {"copy-tenant": 1.0, "code-tenant": 0.7, "chat-tenant": 0.5, "prose-tenant": 0.4}
    engine = FakeEngine(max_batch=cfg.max_batch, max_context=8192, num_pages=pages, proposers=proposers,
                        max_depth=4, tenant_acceptance=scale, cost=FakeCost(base_ms=5.0, per_token_ms=0.4),
                        model_name="fake-reverse")
    engine.warmup(progress=False)
    return engine


def kind_prompts(engine: Any, kinds: tuple[str, ...], n: int, limit: int,
                 seed: int) -> dict[str, list[list[int]]]:
    """Each kind's first n prompts of bench/crossover.py's seeded draw (at most `limit` tokens)."""
    return {k: prompt_ids(engine.tokenizer, k, n, limit, seed)[0] for k in kinds}


def context_prompts(engine: Any, kinds: tuple[str, ...], n: int, tokens: int,
                    seed: int) -> list[tuple[str, list[int]]]:
    """n (tenant, ids) of exactly `tokens` tokens, kinds round-robin: request j of a kind is that kind's
    prompts from the (7 j)-th on, concatenated (BOS only first) and cut to BOS + its last tokens - 1, so
    no two requests share a prefix."""
    per_kind = -(-n // len(kinds))
    by_kind = kind_prompts(engine, kinds, 64, tokens, seed)
    long = {}
    for k, pool in by_kind.items():
        rows = []
        for j in range(per_kind):
            ids, i = list(pool[(7 * j) % len(pool)]), 1
            while len(ids) < tokens:
                ids += pool[(7 * j + i) % len(pool)][1:]
                i += 1
            rows.append(ids[:1] + ids[len(ids) - tokens + 1:])
        long[k] = rows
    return interleave(long, n)


def interleave(by_kind: dict[str, list[list[int]]], n: int) -> list[tuple[str, list[int]]]:
    """n (tenant, ids), kinds round-robin: copy 0, code 0, chat 0, prose 0, copy 1, ...

    >>> interleave({"copy": [[1], [2]], "chat": [[3], [4]]}, 3)
    [('copy-tenant', [1]), ('chat-tenant', [3]), ('copy-tenant', [2])]
    """
    kinds = list(by_kind)
    return [(tenant_for(kinds[i % len(kinds)]), by_kind[kinds[i % len(kinds)]][i // len(kinds)])
            for i in range(n)]


def run_findings(cfg: FindingsConfig) -> Path | None:
    """Every phase, then the report; returns the report's README path (None for a dry run)."""
    from daemon.progress import say
    from store.migrate import ensure_schema

    def log(msg: str) -> None:
        say(f"bench findings: {msg}")

    t0 = time.time()
    runs = plan(cfg, tuple(cfg.techniques))
    estimate = estimate_s(runs, cfg)
    log(f"{len(runs)} runs ({', '.join(f'{k} {sum(r.phase == k for r in runs)}' for k in cfg.phases)}); "
        f"estimated {sum(estimate.values()) / 60:.0f} min on the 2-core CPU without loading and compiling ("
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in estimate.items()) + ")")
    if cfg.dry_run:
        return None
    ensure_schema(cfg.db)
    engines = Engines(cfg, log)
    drv = Driver(engines, cfg.db, log)
    appended = drv.version > 0  # the database already holds runs (of an earlier `--phases` command)
    phases: dict[str, float] = {}
    prompts = Prompts(cfg, engines)
    try:
        for i, p in enumerate(runs):
            t = time.time()
            if i == 0 or runs[i - 1].phase != p.phase:
                log(f"{p.phase}: {sum(r.phase == p.phase for r in runs)} runs")
            if drv.run(p, prompts.of(p), cfg.q1_temperature) is None:
                log(f"  {p.phase} {p.technique}: not loaded on engine {p.engine}, left out")
            phases[p.phase] = phases.get(p.phase, 0.0) + time.time() - t
    finally:
        drv.close()
    t = time.time()
    readme = _report(cfg, engines, drv, phases, t0, appended, estimate)
    phases["report"] = time.time() - t
    log(f"wrote {readme} in {time.time() - t0:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in phases.items())})")
    return readme


class Prompts:
    """The prompts of each planned run, drawn once per (phase, context) and shared by its runs."""

    def __init__(self, cfg: FindingsConfig, engines: Engines) -> None:
        self.cfg, self.engines = cfg, engines
        self._drawn: dict[tuple, list[tuple[str, list[int]]]] = {}

    def of(self, p: PlannedRun) -> list[tuple[str, list[int]]]:
        cfg, tok = self.cfg, self.engines.get(p.engine)
        key = (p.phase, p.context, p.kinds if p.phase == "q1" and len(p.kinds) == 1 else ())
        if key not in self._drawn:
            if p.phase == "q1":
                by_kind = kind_prompts(tok, cfg.kinds, cfg.q1_prompts, cfg.prompt_tokens, cfg.seed)
                self._drawn[key] = interleave({k: by_kind[k] for k in p.kinds}, cfg.q1_prompts * len(p.kinds))
            else:
                room = p.new_tokens + (max(cfg.depths) if p.phase == "q2" else cfg.depth) + 2
                top = max(r.batch for r in plan(cfg, tuple(cfg.techniques)) if r.phase == p.phase
                          and r.context == p.context)
                seed = cfg.seed + (1 if p.phase == "q2" else 2)
                self._drawn[key] = context_prompts(tok, p.kinds, top, p.context - room, seed)
        return self._drawn[key][:p.batch]


def _engine_facts(engine: Any) -> dict[str, Any]:
    cap = engine.capacity()
    return {"model": engine.model_name, "max_batch": cap.max_batch, "max_context": engine.max_context,
            "total_pages": cap.total_pages, "page_size": cap.page_size, "page_bytes": cap.page_bytes,
            "proposers": {n: {"resident_bytes": p.resident_bytes, "max_depth": p.max_depth}
                          for n, p in cap.proposers.items()},
            "dtype": getattr(getattr(getattr(engine, "runner", None), "rc", None), "dtype", "fake")}


def engine_line(name: str, e: dict[str, Any], budget: int) -> str:
    """One engine of the run in a sentence (from `_engine_facts`)."""
    resident = sum(p["resident_bytes"] for p in e["proposers"].values())
    heads = ", ".join(f"{n} {p['resident_bytes'] / 2**20:.1f} MiB" for n, p in sorted(e["proposers"].items())
                      if p["resident_bytes"])
    return (f"{name}: {e['model']} ({e['dtype']}), max batch {e['max_batch']}, context {e['max_context']}, "
            f"memory budget {budget / 2**20:.0f} MiB of which speculation's resident bytes "
            f"{resident / 2**20:.1f} MiB ({heads or 'none'}), KV pool {e['total_pages']} pages of "
            f"{e['page_size']} tokens")


def _earlier(path: Path, db: str, appended: bool) -> list[dict[str, Any]]:
    """The commands (with their runs) an existing findings.json records for the same database, when
    this command `appended` to it (`phases`); [] otherwise."""
    if not appended or not path.is_file():
        return []
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    if old.get("db") != db:
        return []
    return [*old.get("earlier", []), {k: old.get(k) for k in ("command", "started", "seconds", "runs")}]


def _report(cfg: FindingsConfig, engines: Engines, drv: Driver, phases: dict[str, float], t0: float,
            appended: bool, estimate: dict[str, float]) -> Path:
    from bench.report.build import ReportRequest, build_report, machine_facts
    from bench.report.planned import PlanInputs
    from engine.config import PRESETS

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = {"db": cfg.db, "command": cfg.command, "note": cfg.note,
             "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
             "seconds": {k: round(v, 1) for k, v in phases.items()},
             "estimated_seconds": {k: round(v, 1) for k, v in estimate.items()}, "machine": machine_facts(),
             "engines": engines.facts, "config": {k: v for k, v in asdict(cfg).items() if k != "db"},
             "runs": [asdict(r) for r in drv.runs]}
    path = out / "findings.json"
    earlier = _earlier(path, cfg.db, appended)
    if earlier:
        facts["earlier"] = earlier
    path.write_text(json.dumps(facts, indent=1) + "\n", encoding="utf-8")
    model = next((e["model"] for e in engines.facts.values()), "gemma3-270m")
    plan = PlanInputs(model=model if cfg.model is not None and model in PRESETS else "gemma3-270m")
    minutes = (time.time() - t0) / 60
    lines = "; ".join(engine_line(n, e, cfg.kv_budget if n == MAIN else cfg.q3_kv_budget)
                      for n, e in engines.facts.items())
    note = ((cfg.note + " " if cfg.note else "") + f"The measurement took {minutes:.1f} minutes "
            f"(findings.json: per phase). Engines: {lines}. A pool split withholds its share of a pool's "
            "pages from tenants for the run.")
    source = "; then ".join([e["command"] for e in earlier if e.get("command")] + [cfg.command or "?"])
    req = ReportRequest(db=cfg.db, out=out, plan=plan, source_command=source, pool_instance=POOL_INSTANCE,
                        tenant_instance=TENANT_INSTANCE,
                        early_exit=tuple(Path(p) for p in cfg.early_exit), note=note,
                        facts="findings.json")
    return build_report(req)
