"""`crossover bench findings`: measure what `crossover report` needs into one database, then report.

1. Migrate the telemetry database `--db` to head (it may be new) and load one engine: Gemma 3
   270M with every proposer and the KV budget `--kv-budget` (or, with `fake`, engine/fake.py's
   FakeEngine with simulated step times, for tests). Warm it up.
2. Every run drives `EngineCore.step()` on this thread and hands each StepStats and finished
   RequestResult to a `telemetry.recorder.Recorder` (the daemon's path into `xo_steps` and
   `xo_requests`). Each run's policy gets its own version and is saved to `xo_policies`
   (store.history.save_policy, source "admin"), so every step names the policy behind it.
3. Q1, tenants alone and mixed (instance TENANT_INSTANCE): per workload kind, its first `q1_prompts`
   prompts alone as one batch; then all kinds' same prompts in one mixed batch; each under
   plain decoding and every technique at `depth`.
4. Q2, the crossover (instance INSTANCE): batches of 1..max, tenants mixed round-robin over the
   kinds (below one request per kind, one batch per group of kinds, so every batch size sees every
   kind), the prompts of bench/crossover.py's draw; at each batch size plain decoding, every
   technique, plain again (interleaved, so drift on a shared machine hits both sides).
5. Q3, the pool split (instance POOL_INSTANCE): a queue of `q3_requests` long requests (the
   kinds with the longest prompts), more than the pool holds at once, under plain decoding and each technique
   with no split, then the draft model at each of `splits`. Whatever the engine does with a split (pages
   withheld from tenants, the draft model's KV) shows in the steps' `kv_pages_used + kv_pages_free`.
6. Flush, write a JSON of what ran (runs, wall times, machine) next to the report, and build the
   report (bench.report) with the command, the machine and `note` in its header.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.crossover import prompt_ids, verify_tokens_for
from bench.findings_config import FindingsConfig
from bench.workloads import tenant_for
from engine.policy import BatchRule, TunedPolicy
from engine.types import Request, SamplingParams

TENANT_INSTANCE = "findings-tenants"
"""Instance name of the Q1 rows (tenants alone and mixed, the same prompts)."""
INSTANCE = "findings"
"""Instance name of the Q2 rows."""
POOL_INSTANCE = "findings-pool"
"""Instance name of the Q3 rows (the report keeps them out of Q1 and Q2)."""


@dataclass
class Run:
    """One batch of requests under one policy, as `findings.json` lists it."""

    phase: str
    instance: str
    version: int
    technique: str
    depth: int
    pool_split: float
    requests: int
    tenants: list[str]
    wall_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    step_ms: float = 0.0
    peak_batch: int = 0
    tenant_pages: list[int] = field(default_factory=list)
    """Smallest and largest kv_pages_used + kv_pages_free seen."""


class Driver:
    """Runs batches on one engine, recording every step into the database under an instance."""

    def __init__(self, engine: Any, db: str, log: Any) -> None:
        self.engine, self.db, self.log = engine, db, log
        self.runs: list[Run] = []
        self.version = _last_version(db)
        """Policy versions continue after the database's highest, so a later run appends."""
        self._recorders: dict[str, Any] = {}

    def recorder(self, instance: str) -> Any:
        from telemetry.recorder import Recorder

        if instance not in self._recorders:
            self._recorders[instance] = Recorder(self.db, instance=instance, max_buffer=1_000_000).start()
        return self._recorders[instance]

    def policy(self, instance: str, technique: str, depth: int, split: float) -> TunedPolicy:
        """A new version speculating at every batch size (technique "none": never), saved."""
        from store.db import make_engine, session_scope
        from store.history import save_policy

        self.version += 1
        top = self.engine.max_batch
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

    def run(self, phase: str, instance: str, technique: str, depth: int, split: float,
            prompts: list[tuple[str, list[int]]], max_tokens: int) -> Run:
        """Submit every (tenant, ids) at once under a fresh policy; step until all finish."""
        depth = 0 if technique == "none" else min(depth, self.engine.proposers[technique].max_depth)
        policy = self.policy(instance, technique, depth, split)
        rec = self.recorder(instance)
        self.engine.set_policy(policy)
        run = Run(phase, instance, policy.version, technique, depth, split, len(prompts),
                  sorted({t for t, _ in prompts}))
        started = time.perf_counter()
        for i, (tenant, ids) in enumerate(prompts):
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            self.engine.add_request(Request(f"v{policy.version}-{i}", list(ids), sp, tenant=tenant))
        pages: list[int] = []
        while self.engine.has_work():
            out = self.engine.step()
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
            pages.append(st.kv_pages_used + st.kv_pages_free)
        run.wall_s = time.perf_counter() - started
        run.tenant_pages = [min(pages), max(pages)] if pages else []
        self.runs.append(run)
        rate = run.tokens / (run.step_ms / 1e3) if run.step_ms else 0.0
        self.log(f"  {phase} v{run.version} {technique}@{depth} split {split:g}: {len(prompts)} requests, "
                 f"{run.steps} steps, {rate:.1f} tok/s of step time, peak batch {run.peak_batch}, "
                 f"{run.wall_s:.1f} s")
        return run

    def close(self) -> None:
        for rec in self._recorders.values():
            rec.close(timeout=120)
        self._recorders.clear()


def _last_version(db: str) -> int:
    """The highest policy version any findings instance of `db` holds (0: none)."""
    from store.db import make_engine, session_scope
    from store.history import max_policy_version

    engine = make_engine(db)
    try:
        with session_scope(engine) as session:
            return max((max_policy_version(session, instance=i) or 0)
                       for i in (TENANT_INSTANCE, INSTANCE, POOL_INSTANCE))
    finally:
        engine.dispose()


def load(cfg: FindingsConfig, log: Any) -> Any:
    """The engine of the run: the real model with every proposer, or the fake."""
    if cfg.quick:
        return fake_engine(cfg)
    from daemon.progress import reporter
    from engine.loader import load_engine

    progress = reporter()
    longest = max(cfg.prompt_tokens + cfg.new_tokens, cfg.q3_prompt_tokens + cfg.q3_new_tokens)
    verify = verify_tokens_for((cfg.depth,))
    context = 1 << (longest + verify[-1] + 2 - 1).bit_length()
    log(f"loading {cfg.model or 'Gemma 3 270M'}: KV budget {cfg.kv_budget / 2**20:.0f} MiB, context "
        f"{context}, max batch {cfg.max_batch}")
    from engine.loader import MODEL_PROPOSERS

    wanted = tuple(t for t in MODEL_PROPOSERS if t in cfg.techniques)  # only these load (and cost memory)
    engine = load_engine(model=cfg.model, dtype=cfg.dtype, kv_budget_bytes=cfg.kv_budget,
                         max_batch=cfg.max_batch,
                         max_context=context, token_budget=2048, speculation=True, heads=cfg.heads,
                         verify_tokens=verify, spec_max_batch=cfg.max_batch, model_proposers=wanted,
                         progress=progress)
    log(f"proposers: {', '.join(sorted(engine.proposers))}; warming up (compiles are cached on disk)")
    engine.warmup(progress=progress)
    from bench.engine import run_each_shape_once

    run_each_shape_once(engine, progress)
    return engine


def fake_engine(cfg: FindingsConfig) -> Any:
    """engine/fake.py's engine with every technique, acceptance scaled per tenant, simulated step times."""
    from engine.fake import FakeCost, FakeEngine, FakeProposer

    proposers = {"ngram": FakeProposer("ngram", (0.8, 0.7, 0.6, 0.5)),
                 "mtp": FakeProposer("mtp", (0.6, 0.4, 0.3)),
                 "early_exit": FakeProposer("early_exit", (0.5, 0.4, 0.3)),
                 "draft": FakeProposer("draft", (0.55, 0.45, 0.35), resident=1 << 20)}
    scale = {"copy-tenant": 1.0, "code-tenant": 0.7, "chat-tenant": 0.5, "prose-tenant": 0.4}
    engine = FakeEngine(max_batch=cfg.max_batch, max_context=1024, num_pages=256, proposers=proposers,
                        max_depth=4, tenant_acceptance=scale, cost=FakeCost(base_ms=5.0, per_token_ms=0.4))
    engine.warmup(progress=False)
    return engine


def kind_prompts(engine: Any, kinds: tuple[str, ...], n: int, limit: int,
                 seed: int) -> dict[str, list[list[int]]]:
    """Each kind's first n prompts of bench/crossover.py's seeded draw (at most `limit` tokens)."""
    return {k: prompt_ids(engine.tokenizer, k, n, limit, seed)[0] for k in kinds}


def interleave(by_kind: dict[str, list[list[int]]], n: int) -> list[tuple[str, list[int]]]:
    """n (tenant, ids), kinds round-robin: copy 0, code 0, chat 0, prose 0, copy 1, ...

    >>> interleave({"copy": [[1], [2]], "chat": [[3], [4]]}, 3)
    [('copy-tenant', [1]), ('chat-tenant', [3]), ('copy-tenant', [2])]
    """
    kinds = list(by_kind)
    return [(tenant_for(kinds[i % len(kinds)]), by_kind[kinds[i % len(kinds)]][i // len(kinds)])
            for i in range(n)]


def run_findings(cfg: FindingsConfig) -> Path:
    """Every phase, then the report; returns the report's README path."""
    from daemon.progress import say
    from store.migrate import ensure_schema

    def log(msg: str) -> None:
        say(f"bench findings: {msg}")

    t0 = time.time()
    ensure_schema(cfg.db)
    engine = load(cfg, log)
    techs = tuple(t for t in cfg.techniques if t in engine.proposers)
    missing = [t for t in cfg.techniques if t not in techs]
    if missing:
        log(f"not loaded, left out: {', '.join(missing)} (the model-based proposers need a heads file)")
    drv = Driver(engine, cfg.db, log)
    appended = drv.version > 0  # the database already holds runs (of an earlier `--phases` command)
    phases: dict[str, float] = {"load": time.time() - t0}
    try:
        for name in cfg.phases:
            fn = PHASES[name]
            t = time.time()
            fn(cfg, engine, drv, techs, log)
            phases[name] = time.time() - t
    finally:
        drv.close()
    t = time.time()
    readme = _report(cfg, engine, drv, phases, t0, appended)
    phases["report"] = time.time() - t
    log(f"wrote {readme} in {time.time() - t0:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in phases.items())})")
    return readme


PHASES = {"q1": lambda *a: _q1(*a), "q2": lambda *a: _q2(*a), "q3": lambda *a: _q3(*a)}
"""Phase name -> its function (looked up when called)."""


def _split_for(cfg: FindingsConfig, technique: str) -> float:
    return cfg.draft_split if technique == "draft" else 0.0


def _q1(cfg: FindingsConfig, engine: Any, drv: Driver, techs: tuple[str, ...], log: Any) -> None:
    by_kind = kind_prompts(engine, cfg.kinds, cfg.q1_prompts, cfg.prompt_tokens, cfg.seed)
    groups = [(f"{k} alone", [(tenant_for(k), ids) for ids in by_kind[k]]) for k in cfg.kinds]
    groups.append(("mixed", interleave(by_kind, cfg.q1_prompts * len(cfg.kinds))))
    log(f"Q1: {len(groups)} batches (each kind alone, then all mixed) x {1 + len(techs)} policies")
    for i, (label, prompts) in enumerate(groups):
        log(f"Q1 [{i + 1}/{len(groups)}] {label}, batch {len(prompts)}")
        for tech in ("none", *techs):
            drv.run("q1", TENANT_INSTANCE, tech, cfg.depth, _split_for(cfg, tech), prompts, cfg.new_tokens)


def _q2(cfg: FindingsConfig, engine: Any, drv: Driver, techs: tuple[str, ...], log: Any) -> None:
    top = max(cfg.batches)
    per_kind = -(-top // len(cfg.kinds))
    by_kind = kind_prompts(engine, cfg.kinds, per_kind, cfg.prompt_tokens, cfg.seed + 1)
    log(f"Q2: batch sizes {list(cfg.batches)}, tenants mixed round-robin, plain / each technique / plain")
    kinds = list(by_kind)
    for i, b in enumerate(sorted(cfg.batches)):
        # below one request per kind, several batches rotate the kinds so each batch size sees every kind
        sets = [interleave({k: by_kind[k] for k in kinds[j:] + kinds[:j]}, b)
                for j in range(0, len(kinds), b)] if b < len(kinds) else [interleave(by_kind, b)]
        log(f"Q2 [{i + 1}/{len(cfg.batches)}] batch {b}"
            + (f", {len(sets)} batches" if len(sets) > 1 else ""))
        for tech in ("none", *techs, "none"):
            for prompts in sets:
                drv.run("q2", INSTANCE, tech, cfg.depth, _split_for(cfg, tech), prompts, cfg.new_tokens)


def _q3(cfg: FindingsConfig, engine: Any, drv: Driver, techs: tuple[str, ...], log: Any) -> None:
    per_kind = -(-cfg.q3_requests // len(cfg.q3_kinds))
    by_kind = kind_prompts(engine, cfg.q3_kinds, per_kind, cfg.q3_prompt_tokens, cfg.seed + 2)
    prompts = interleave(by_kind, cfg.q3_requests)
    plan = [("none", 0.0)] + [(t, 0.0) for t in techs if t != "draft"]
    # the draft model keeps its KV in the lent pages; without it the splits still withhold pages
    # from tenants, under the first technique loaded, which leaves them idle
    lender = "draft" if "draft" in techs else techs[0] if techs else "none"
    plan += [(lender, s) for s in cfg.splits]
    log(f"Q3: {cfg.q3_requests} requests of up to {cfg.q3_prompt_tokens} + {cfg.q3_new_tokens} tokens queued "
        f"at once, {len(plan)} runs ({lender} at splits {list(cfg.splits)})")
    for i, (tech, split) in enumerate(plan):
        log(f"Q3 [{i + 1}/{len(plan)}] {tech} split {split:g}")
        drv.run("q3", POOL_INSTANCE, tech, cfg.depth, split, prompts, cfg.q3_new_tokens)


def _engine_facts(engine: Any) -> dict[str, Any]:
    cap = engine.capacity()
    return {"model": engine.model_name, "max_batch": cap.max_batch, "max_context": engine.max_context,
            "total_pages": cap.total_pages, "page_size": cap.page_size, "page_bytes": cap.page_bytes,
            "proposers": {n: {"resident_bytes": p.resident_bytes, "max_depth": p.max_depth}
                          for n, p in cap.proposers.items()},
            "dtype": getattr(getattr(getattr(engine, "runner", None), "rc", None), "dtype", "fake")}


def engine_line(e: dict[str, Any], budget: int) -> str:
    """The engine every run shared, in a sentence (from `_engine_facts`)."""
    resident = sum(p["resident_bytes"] for p in e["proposers"].values())
    heads = ", ".join(f"{n} {p['resident_bytes'] / 2**20:.1f} MiB" for n, p in sorted(e["proposers"].items())
                      if p["resident_bytes"])
    return (f"{e['model']} ({e['dtype']}), max batch {e['max_batch']}, context {e['max_context']}; one "
            f"memory budget of {budget / 2**20:.0f} MiB, of which speculation's resident bytes "
            f"({resident / 2**20:.1f} MiB: {heads or 'none'}) stay loaded for every run, plain decoding's "
            f"included, and the KV pool has {e['total_pages']} pages of {e['page_size']} tokens; a pool "
            "split withholds its share of those pages from tenants for the run.")


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


def _report(cfg: FindingsConfig, engine: Any, drv: Driver, phases: dict[str, float], t0: float,
            appended: bool = False) -> Path:
    from bench.report.build import ReportRequest, build_report, machine_facts
    from bench.report.planned import PlanInputs

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = {"db": cfg.db, "command": cfg.command, "note": cfg.note,
             "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                  time.gmtime(t0)),
             "seconds": {k: round(v, 1) for k, v in phases.items()}, "machine": machine_facts(),
             "engine": _engine_facts(engine), "config": {k: v for k, v in asdict(cfg).items() if k != "db"},
             "runs": [asdict(r) for r in drv.runs]}
    path = out / "findings.json"
    earlier = _earlier(path, cfg.db, appended)
    if earlier:
        facts["earlier"] = earlier
    path.write_text(json.dumps(facts, indent=1) + "\n", encoding="utf-8")
    model = "gemma3-270m" if cfg.model is None else engine.model_name
    from engine.config import PRESETS

    plan = PlanInputs(model=model if model in PRESETS else "gemma3-270m")
    minutes = (time.time() - t0) / 60
    note = ((cfg.note + " " if cfg.note else "") + f"The measurement took {minutes:.1f} minutes "
            f"(findings.json: per phase). Engine: {engine_line(facts['engine'], cfg.kv_budget)}")
    source = "; then ".join([e["command"] for e in earlier if e.get("command")] + [cfg.command or "?"])
    req = ReportRequest(db=cfg.db, out=out, plan=plan, source_command=source, pool_instance=POOL_INSTANCE,
                        tenant_instance=TENANT_INSTANCE,
                        early_exit=tuple(Path(p) for p in cfg.early_exit), note=note,
                        facts="findings.json")
    return build_report(req)
