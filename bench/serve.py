"""`crossover bench serve`: throughput and latency over HTTP, and its cost over the bare engine.

1. Load the engine (Gemma 3 270M unless --model; FakeEngine with --fake) and
   warm it up once; both phases below share it.
2. Draw prompts from bench.workloads (`mixed`, seeded; --mix weights the
   kinds copy/code/chat/prose; or with --shared-prefix `shared_prefix`: 4
   tenants, each with its own ~1,000-token system prompt, sized with the
   engine's tokenizer), keeping those whose tokens plus max_tokens fit
   the context, and make jobs (bench.loadgen): closed loop with
   --concurrency clients, or Poisson arrivals at --rate requests/s.
3. HTTP phase: the daemon runs in this process (make_app on this event loop,
   127.0.0.1, an ephemeral port, open mode, a temporary telemetry database,
   the tuner off; with tenants in the workload, closed mode instead, each
   tenant created in that database and sending with its own key), or is the
   one at --url (tenants' keys from --tenant-keys, else --api-key for all).
   One warm-up request, then the jobs, streamed, until they are all sent or
   --seconds have passed.
4. Engine phase: the same jobs (those the HTTP phase sent), at the same
   concurrency or arrival times, straight into `engine.step()` on this
   thread. Skipped with --url (the engine is elsewhere). Each phase starts
   with the engine's prefix cache emptied, so no phase finds the prompts of
   the one before it cached; a daemon at --url has its cache emptied through
   its admin API (POST /admin/reset_prefix_cache) with --admin-token, else
   keeps it.
5. Steps 3 and 4 alternate --rounds times (default 1).
6. Summary per phase: output tokens/s and requests/s over the wall time from
   the first send to the last finish; mean/p50/p90/p99 of TTFT, TPOT and
   end-to-end latency and of the inter-token latency (ITL) in ms; the share
   of CPU other processes took meanwhile (the machine may be shared). Each
   phase reports its fastest round, since other processes only ever slow a
   round down; `rounds` lists them all. `http_over_engine` = HTTP output
   tokens/s over engine output tokens/s (the serving overhead; 1.0 is none).
7. Efficiency (bench.efficiency): the engine's prefill and decode rates at
   the batch sizes the bound needs, measured on the same engine after the
   phases (or read from --engine-rates, a `crossover bench engine` JSON);
   the bound for the requests the fastest HTTP round served, and served
   tokens/s over it.
8. TTFT against an idle daemon (unless --no-idle-ttft): each job of the
   fastest HTTP round once more, alone and for one token, on a fresh in-process
   daemon with the prefix cache emptied (or the one at --url, its cache emptied
   only with --admin-token: else a warning, and `idle_prefix_cache` "not
   reset"); `ttft_vs_idle` has the loaded p99 over the idle p99 and, per
   request, loaded / idle.
JSON goes to --out, progress to stderr.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.efficiency import EngineRates, rates_from_file
from bench.loadgen import Job, Sample, empty_prefix_cache, forget_prefixes, make_jobs, run_engine, run_http
from bench.serve_bound import efficiency_block
from bench.serve_config import ServeBenchConfig
from bench.serve_stats import CpuMeter, best_rounds, log, summarize, summary_line, ttft_vs_idle
from daemon.user_error import UserError


def run_bench(cfg: ServeBenchConfig, out_path: str | None = None) -> dict[str, Any]:
    """Run both phases (cfg.rounds times) and return (and write to `out_path`) the JSON result."""
    file_rates = _file_rates(cfg.engine_rates)
    remote_keys = _tenant_keys(cfg.tenant_keys)
    engine = None if cfg.url else _load_engine(cfg)
    prompts = _prompts(cfg, engine)
    jobs = make_jobs(prompts, cfg.max_tokens, cfg.rate, cfg.seed)
    shown = {**asdict(cfg), "api_key": "***" if cfg.api_key else None,
             "admin_token": "***" if cfg.admin_token else None}
    result: dict[str, Any] = {"bench": "serve", "config": shown, **_describe(engine),
                              "workload": None}  # filled in once the jobs are sent
    if engine is not None:
        result["engine_only_policy"] = _policy(cfg, engine).to_dict()
    mode = f"rate {cfg.rate}/s" if cfg.rate else f"concurrency {cfg.concurrency}"
    log(f"{len(jobs)} requests of {cfg.max_tokens} tokens, {mode}, {cfg.rounds} round(s)")
    rounds, served = [], []
    for r in range(cfg.rounds):
        asyncio.run(empty_prefix_cache(engine, cfg.url, cfg.admin_token))
        http, samples = asyncio.run(_http_phase(cfg, engine, jobs, remote_keys, deadline=r == 0))
        jobs = jobs[:len(samples)]  # later rounds, and the engine, send what the first round sent
        sent = len(jobs)
        log(summary_line(f"round {r + 1} http", http))
        rounds.append({"http": http})
        served.append(samples)
        if engine is not None:
            engine.set_policy(_policy(cfg, engine))  # the HTTP phase's daemon may have retuned it
            forget_prefixes(engine)
            meter = CpuMeter()
            direct, wall = run_engine(engine, jobs, cfg.concurrency, cfg.rate,
                                      _progress("engine", sent), tag=f"r{r}")
            rounds[-1]["engine_only"] = summarize(direct, wall, meter.share())
            log(summary_line(f"round {r + 1} engine only", rounds[-1]["engine_only"]))
    result["workload"] = _workload(cfg, jobs, remote_keys)  # the jobs sent
    result.update(best_rounds(rounds))
    if engine is not None:
        result["compiles_since_warmup"] = _compiles(engine)
    log(f"http_over_engine: {result['http_over_engine']}")
    best = max(range(len(rounds)), key=lambda i: rounds[i]["http"]["output_tokens_per_s"] or 0.0)
    result["efficiency"] = efficiency_block(cfg, engine, file_rates, result, served[best], jobs)
    if cfg.idle_ttft:
        result["ttft_vs_idle"] = ttft_vs_idle(served[best], *asyncio.run(_idle_phase(cfg, engine, jobs,
                                                                                     remote_keys)))
        idle = result["ttft_vs_idle"]
        log(f"ttft vs idle: {idle['reason']}" if "reason" in idle else
            f"ttft vs idle: p99 {idle['loaded_p99_over_idle_p99']}x the idle p99; per request "
            f"p50 / p99 {idle['per_request']['p50']} / {idle['per_request']['p99']}x")
    log(f"efficiency: {result['efficiency'].get('ratio')} (served "
        f"{result['efficiency'].get('served_tokens_per_s')} of a bound of "
        f"{result['efficiency'].get('bound_tokens_per_s')} output tok/s)")
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out_path}")
    return result


# ---- the phases ---------------------------------------------------------------
async def _http_phase(cfg: ServeBenchConfig, engine: Any, jobs: list[Job],
                      remote_keys: dict[str, str], deadline: bool
                      ) -> tuple[dict[str, Any], list[Sample]]:
    """Summary of the HTTP phase and the samples of the jobs it sent (within --seconds if
    `deadline`)."""
    seconds = cfg.seconds if deadline else None
    if cfg.url:
        any_key = cfg.api_key or next(iter(remote_keys.values()), None)
        model = await served_model(cfg.url, any_key)
        return await _measure_http(cfg, cfg.url, model, jobs, seconds, remote_keys)
    from aiohttp import web

    from daemon.app import make_app
    from daemon.state import ENGINE_THREAD

    tenants = _tenants_of(jobs)
    with tempfile.TemporaryDirectory(prefix="crossover-bench-") as tmp:
        database = None if cfg.no_db else _open_database(cfg.db or f"sqlite:///{tmp}/serve.db")
        keys = _create_tenants(database, tenants, len(jobs)) if tenants else {}
        app = make_app(_settings(cfg, engine, len(jobs), open_mode=not tenants), engine,
                       database=database, warmup=False)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                               shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            while not app[ENGINE_THREAD].ready:
                await asyncio.sleep(0.01)
            return await _measure_http(cfg, url, engine.model_name, jobs, seconds, keys)
        finally:
            await runner.cleanup()


async def _measure_http(cfg: ServeBenchConfig, url: str, model: str, jobs: list[Job],
                        seconds: float | None, keys: dict[str, str]
                        ) -> tuple[dict[str, Any], list[Sample]]:
    # One short request per route the jobs use (completions, chat), one after the other: the
    # first request of each route runs code paths (and lazy imports) for the first time.
    firsts = {job.route(): job for job in reversed(jobs)}
    warm = [Job(-1 - i, job.prompt, 2) for i, job in enumerate(firsts.values())]
    warm_samples, _ = await run_http(url, model, warm, 1, None, cfg.api_key, keys=keys)
    failed = [s.error for s in warm_samples if s.error]
    if failed:
        raise UserError(f"the warm-up request to {url} failed: {failed[0]}")
    meter = CpuMeter()
    samples, wall = await run_http(url, model, jobs, cfg.concurrency, cfg.rate, cfg.api_key,
                                   seconds, _progress("http", len(jobs)), keys)
    return summarize(samples, wall, meter.share()), samples


# ---- TTFT against an idle daemon ----------------------------------------------------
async def _idle_phase(cfg: ServeBenchConfig, engine: Any, jobs: list[Job], remote_keys: dict[str, str]
                      ) -> tuple[list[Sample], bool]:
    """Each job's TTFT with the daemon otherwise idle: the jobs one at a time, each for one
    token (TTFT is its prefill and first token), the prefix cache emptied first (the engine's
    here; a daemon's at --url only with --admin-token, else it keeps its cache and the load
    phase's prompts may hit it: a warning says so). (samples, whether the cache was emptied)."""
    emptied = await empty_prefix_cache(engine, cfg.url, cfg.admin_token)
    if not emptied:
        log(f"warning: without --admin-token the daemon at {cfg.url} keeps its prefix cache: idle "
            "requests may hit the load phase's prompts, so the idle TTFT may come out low")
    alone = [Job(job.index, job.prompt, 1) for job in jobs]
    _, samples = await _http_phase(replace(cfg, concurrency=1, rate=None, seconds=None), engine, alone,
                                   remote_keys, deadline=False)
    return samples, emptied


# ---- setup ----------------------------------------------------------------------
def _load_engine(cfg: ServeBenchConfig) -> Any:
    if cfg.fake:
        from engine.fake import FakeEngine

        engine = FakeEngine(max_batch=cfg.max_batch, max_context=cfg.max_context,
                            step_delay_s=cfg.fake_step_ms / 1000.0)
        engine.warmup(progress=False)
        return engine
    from daemon.progress import reporter
    from engine.loader import load_engine

    progress = reporter()
    log("loading the model")
    engine = load_engine(model=cfg.model, dtype=cfg.dtype, max_batch=cfg.max_batch,
                         max_context=cfg.max_context, speculation=cfg.speculation, model_proposers=(),
                         progress=progress, prefix_cache=cfg.prefix_cache)
    log("warming up (every bucket compiles once; cached on disk for the next run)")
    engine.warmup(progress=progress)
    from bench.engine import run_each_shape_once

    run_each_shape_once(engine, progress)  # a daemon does this while idle; a benchmark measures after
    return engine


def _policy(cfg: ServeBenchConfig, engine: Any) -> Any:
    """The policy of the engine-only phase: a new daemon's starter policy (n-gram at small
    batches) with --speculation, else never speculating."""
    from daemon.tuning import starter_policy
    from engine.policy import NEVER

    return starter_policy(engine.capacity()) if cfg.speculation else NEVER


def _prompts(cfg: ServeBenchConfig, engine: Any) -> list[Any]:
    """cfg.requests prompts of the workload; with an engine, only those that fit its context."""
    from bench.workloads import mixed, shared_prefix

    def draw(n: int) -> list[Any]:
        if not cfg.shared_prefix:
            return mixed(n, cfg.mix, cfg.seed)
        tokenizer = engine.tokenizer if engine is not None else _local_tokenizer(cfg.model)
        return shared_prefix(n, cfg.seed, tokenizer, cfg.prefix_tokens)

    if engine is None:
        return draw(cfg.requests)
    room = engine.max_context - cfg.max_tokens
    drawn = draw(cfg.requests * 4)
    fits = [p for p in drawn
            if len(engine.tokenizer.encode(p.render(engine.tokenizer))) <= room][: cfg.requests]
    if len(fits) < cfg.requests:
        raise UserError(f"only {len(fits)} of {len(drawn)} prompts fit max_context "
                        f"{engine.max_context} with max_tokens {cfg.max_tokens}; "
                        "raise max_context")
    return fits


def _local_tokenizer(model: str | None) -> Any:
    """--url: the tokenizer of --model (a .gguf) or of the default model, to size system
    prompts; None (4 characters a token) when it cannot be loaded."""
    try:
        from engine.model.tokenizer import Tokenizer

        gguf = model if model and model.endswith(".gguf") else None
        return Tokenizer.from_gguf(gguf, progress=False) if model is None or gguf else None
    except Exception as exc:  # no model package here: size by characters
        log(f"no local tokenizer ({exc}); system prompts sized at 4 characters a token")
        return None


def _settings(cfg: ServeBenchConfig, engine: Any, jobs: int, open_mode: bool = True) -> Any:
    from daemon.settings import Settings
    from tuner.config import TunerConfig

    return Settings(host="127.0.0.1", port=0, max_batch=engine.max_batch,
                    max_context=engine.max_context, max_waiting=max(256, jobs, cfg.concurrency),
                    tuner=TunerConfig(enabled=False, search_process=False), open_mode=open_mode,
                    log_level="warning")


def _tenants_of(jobs: list[Job]) -> list[str]:
    return sorted({job.prompt.tenant for job in jobs if job.prompt.tenant})


def _create_tenants(database: Any, names: list[str], jobs: int) -> dict[str, str]:
    """Add the workload's tenants to the in-process daemon's database, none of them limited
    below the whole load; name -> API key. A tenant an earlier phase added to the same --db
    gets a new key (keys are stored hashed, so the old one cannot be read back)."""
    from daemon.tenants.admin_ops import create_tenant, find
    from store.apikeys import generate_api_key, hash_api_key
    from store.db import session_scope

    if database is None:
        raise UserError("the workload's tenants need the telemetry database for their API "
                        "keys: drop --no-db")
    limits, keys = {"max_concurrent": max(1, jobs)}, {}
    with session_scope(database.engine) as session:
        for name in names:
            tenant = find(session, name)
            if tenant is None:
                keys[name] = create_tenant(session, name, dict(limits))[1]
            else:
                keys[name] = generate_api_key()
                tenant.api_key_hash = hash_api_key(keys[name])
    return keys


def _tenant_keys(path: str | None) -> dict[str, str]:
    """--tenant-keys: {tenant: API key} from a JSON file; UserError when it is not one."""
    if path is None:
        return {}
    try:
        keys = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--tenant-keys {path}: {exc}") from None
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        raise UserError(f"--tenant-keys {path}: expected a JSON object of tenant name -> API key")
    return keys


def _file_rates(path: str | None) -> EngineRates | None:
    if path is None:
        return None
    try:
        return rates_from_file(path)
    except ValueError as exc:
        raise UserError(f"--engine-rates: {exc}") from None


def _workload(cfg: ServeBenchConfig, jobs: list[Job], remote_keys: dict[str, str]
              ) -> dict[str, Any]:
    """What was sent: the workload's name and, with tenants, who sent it how."""
    tenants = _tenants_of(jobs)
    out: dict[str, Any] = {"name": "shared-prefix" if cfg.shared_prefix else "mixed"}
    if cfg.shared_prefix:
        out["prefix_tokens"] = cfg.prefix_tokens
    if tenants:
        per = {t: sum(job.prompt.tenant == t for job in jobs) for t in tenants}
        if not cfg.url:
            how = "each tenant with its own API key, created in the daemon started here"
        elif remote_keys:
            how = "each tenant with its key from --tenant-keys (--api-key for the rest)"
        else:
            how = "every tenant with --api-key: the daemon sees one tenant"
        out["tenants"] = {"requests": per, "sent": how}
    return out


def _open_database(url: str) -> Any:
    from daemon.database import open_database

    return open_database(url)


async def served_model(url: str, api_key: str | None) -> str:
    """The first model name the daemon at `url` serves (GET /v1/models); UserError when it cannot
    be reached or refuses."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(url.rstrip("/") + "/v1/models") as response:
                if response.status != 200:
                    raise UserError(f"GET {url}/v1/models: HTTP {response.status}: "
                                    f"{(await response.text())[:200]}")
                return str((await response.json())["data"][0]["id"])
    except (aiohttp.ClientError, OSError) as exc:
        raise UserError(f"cannot reach the daemon at {url}: {exc}") from None


def _describe(engine: Any) -> dict[str, Any]:
    if engine is None:
        return {"model": None, "engine": "remote"}
    info: dict[str, Any] = {"model": engine.model_name, "max_batch": engine.max_batch,
                            "max_context": engine.max_context}
    from engine.fake import FakeEngine

    if isinstance(engine, FakeEngine):
        info.update(engine="FakeEngine", fake_step_ms=engine.step_delay_s * 1000.0)
    else:
        import jax

        info.update(engine="EngineCore", dtype=engine.runner.rc.dtype,
                    backend=jax.default_backend())
    return info


def _compiles(engine: Any) -> int | None:
    return engine.status().get("compiles_since_warmup")  # the fake compiles nothing: None


# ---- progress on stderr -----------------------------------------------------------


def _progress(phase: str, total: int) -> Any:
    """Requests done in a phase: a bar on a terminal, else a line every eighth of them."""
    from daemon.progress import reporter

    bars, every = reporter(), max(1, total // 8)

    def report(done: int) -> None:
        if callable(bars):
            bars(f"bench serve: {phase} requests", done, total)
        elif done % every == 0 or done == total:
            log(f"{phase}: {done}/{total} requests done")

    return report
