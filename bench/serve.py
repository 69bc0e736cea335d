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
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.efficiency import EngineRates, efficiency, measure_rates, rates_from_file
from bench.loadgen import Job, Sample, empty_prefix_cache, forget_prefixes, make_jobs, run_engine, run_http
from daemon.user_error import UserError

PERCENTILES = (50, 90, 99)
DEFAULT_MIX = {"copy": 1.0, "code": 1.0, "chat": 1.0, "prose": 1.0}


@dataclass(frozen=True)
class ServeBenchConfig:
    """What `crossover bench serve` was asked to do."""

    concurrency: int = 8
    """Closed loop: clients, each with one request in flight."""
    requests: int = 64
    """Jobs to send (fewer when --seconds runs out first)."""
    max_tokens: int = 64
    """Output tokens per request (exactly: EOS is ignored)."""
    rate: float | None = None
    """Open loop: Poisson arrivals per second; None is the closed loop."""
    seconds: float | None = None
    """Stop sending new requests after this long."""
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    """Prompt kind -> weight."""
    seed: int = 0
    """Seed of the prompt draw and of the arrival times."""
    rounds: int = 1
    """Both phases this many times, alternating; each phase reports its fastest round."""
    model: str | None = None
    """A .gguf file or a HF Gemma 3 directory; None: Gemma 3 270M."""
    dtype: str | None = None
    """Compute dtype; None: the backend's default."""
    max_batch: int = 32
    """The engine's most sequences decoded together."""
    max_context: int = 1024
    """The engine's context in tokens; prompts that do not fit with max_tokens are not drawn."""
    fake: bool = False
    """FakeEngine instead of the model (fast; for tests)."""
    fake_step_ms: float = 10.0
    """FakeEngine: sleep per step, standing in for the model's step time."""
    url: str | None = None
    """Bench a running daemon instead of one started here."""
    api_key: str | None = None
    """Bearer key for `url` (never written to the JSON)."""
    admin_token: str | None = None
    """`url`'s admin token: its prefix cache is emptied where the engine here has its own emptied
    (before each HTTP round and the idle phase); without it the daemon keeps its cache. Never
    written to the JSON."""
    db: str | None = None
    """Telemetry database of the in-process daemon; None: a temporary SQLite file."""
    no_db: bool = False
    """Run the in-process daemon without a telemetry database."""
    shared_prefix: bool = False
    """The shared-prefix workload (bench.workloads.shared) instead of --mix."""
    prefix_tokens: int = 1000
    """--shared-prefix: tokens of each tenant's system prompt."""
    prefix_cache: bool = True
    """The engine started here shares KV pages of common prompt prefixes (engine/memory/prefix_cache.py)."""
    speculation: bool = True
    """The engine started here loads the n-gram proposer and serves the policy a new daemon
    starts with (daemon.tuning.starter_policy), in both phases; False: plain decoding only."""
    engine_rates: str | None = None
    """A `crossover bench engine` JSON whose rates the efficiency bound uses (else measured here)."""
    tenant_keys: str | None = None
    """--url: a JSON file {tenant: API key}; a tenant's requests are sent with its key."""
    idle_ttft: bool = True
    """After the rounds, send each served job alone (one token) and compare its TTFT with the
    fastest HTTP round's (`ttft_vs_idle` in the JSON)."""


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
    _log(f"{len(jobs)} requests of {cfg.max_tokens} tokens, {mode}, {cfg.rounds} round(s)")
    rounds, served = [], []
    for r in range(cfg.rounds):
        asyncio.run(empty_prefix_cache(engine, cfg.url, cfg.admin_token))
        http, samples = asyncio.run(_http_phase(cfg, engine, jobs, remote_keys, deadline=r == 0))
        jobs = jobs[:len(samples)]  # later rounds, and the engine, send what the first round sent
        sent = len(jobs)
        _log(_line(f"round {r + 1} http", http))
        rounds.append({"http": http})
        served.append(samples)
        if engine is not None:
            engine.set_policy(_policy(cfg, engine))  # the HTTP phase's daemon may have retuned it
            forget_prefixes(engine)
            meter = CpuMeter()
            direct, wall = run_engine(engine, jobs, cfg.concurrency, cfg.rate,
                                      _progress("engine", sent), tag=f"r{r}")
            rounds[-1]["engine_only"] = summarize(direct, wall, meter.share())
            _log(_line(f"round {r + 1} engine only", rounds[-1]["engine_only"]))
    result["workload"] = _workload(cfg, jobs, remote_keys)  # the jobs sent
    result.update(_best_rounds(rounds))
    if engine is not None:
        result["compiles_since_warmup"] = _compiles(engine)
    _log(f"http_over_engine: {result['http_over_engine']}")
    best = max(range(len(rounds)), key=lambda i: rounds[i]["http"]["output_tokens_per_s"] or 0.0)
    result["efficiency"] = _efficiency(cfg, engine, file_rates, result, served[best], jobs)
    if cfg.idle_ttft:
        result["ttft_vs_idle"] = _ttft_vs_idle(served[best], *asyncio.run(_idle_phase(cfg, engine, jobs,
                                                                                     remote_keys)))
        idle = result["ttft_vs_idle"]
        _log(f"ttft vs idle: {idle['reason']}" if "reason" in idle else
             f"ttft vs idle: p99 {idle['loaded_p99_over_idle_p99']}x the idle p99; per request "
             f"p50 / p99 {idle['per_request']['p50']} / {idle['per_request']['p99']}x")
    _log(f"efficiency: {result['efficiency'].get('ratio')} (served "
         f"{result['efficiency'].get('served_tokens_per_s')} of a bound of "
         f"{result['efficiency'].get('bound_tokens_per_s')} output tok/s)")
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
        _log(f"wrote {out_path}")
    return result


def _best_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each phase's fastest round (other processes only ever slow a round down) and the ratio.

    Every round's throughput and the CPU share others took stay in `rounds`.
    """
    out: dict[str, Any] = {}
    for phase in ("http", "engine_only"):
        runs = [r[phase] for r in rounds if phase in r]
        if runs:
            out[phase] = max(runs, key=lambda s: s["output_tokens_per_s"] or 0.0)
    engine_tps = out.get("engine_only", {}).get("output_tokens_per_s")
    out["http_over_engine"] = (round(out["http"]["output_tokens_per_s"] / engine_tps, 4)
                               if engine_tps else None)
    out["rounds"] = [{f"{phase}_{key}": r[phase][key] for phase in ("http", "engine_only")
                      if phase in r for key in ("output_tokens_per_s", "other_processes_cpu_share")}
                     for r in rounds]
    return out


# ---- the phases ---------------------------------------------------------------
async def _http_phase(cfg: ServeBenchConfig, engine: Any, jobs: list[Job],
                      remote_keys: dict[str, str], deadline: bool
                      ) -> tuple[dict[str, Any], list[Sample]]:
    """Summary of the HTTP phase and the samples of the jobs it sent (within --seconds if
    `deadline`)."""
    seconds = cfg.seconds if deadline else None
    if cfg.url:
        any_key = cfg.api_key or next(iter(remote_keys.values()), None)
        model = await _served_model(cfg.url, any_key)
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
        _log(f"warning: without --admin-token the daemon at {cfg.url} keeps its prefix cache: idle "
             "requests may hit the load phase's prompts, so the idle TTFT may come out low")
    alone = [Job(job.index, job.prompt, 1) for job in jobs]
    _, samples = await _http_phase(replace(cfg, concurrency=1, rate=None, seconds=None), engine, alone,
                                   remote_keys, deadline=False)
    return samples, emptied


def _ttft_vs_idle(loaded: list[Sample], idle: list[Sample], cache_emptied: bool) -> dict[str, Any]:
    """Loaded TTFT against the same requests' idle TTFT: the two p99s' ratio, and per request
    the ratio loaded / idle (its distribution; the ratios, not ms)."""
    alone = {s.index: s.ttft_s for s in idle if s.error is None and s.ttft_s}
    pairs = [(s.ttft_s, alone[s.index]) for s in loaded if s.error is None and s.ttft_s and s.index in alone]
    if not pairs:
        return {"reason": "no request has both a loaded and an idle TTFT"}
    ratios = [a / b for a, b in pairs]
    loaded_ms, idle_ms = distribution([a for a, _ in pairs]), distribution([b for _, b in pairs])
    per_request = {k: (None if v is None else round(v / 1000.0, 3)) for k, v in distribution(ratios).items()}
    per_request["n"] = len(ratios)
    return {"requests": len(pairs), "prefix_cache_emptied": cache_emptied,
            "idle_prefix_cache": "reset" if cache_emptied else "not reset",
            "loaded_ttft_ms": loaded_ms, "idle_ttft_ms": idle_ms,
            "loaded_p99_over_idle_p99": round(loaded_ms["p99"] / idle_ms["p99"], 3),
            "per_request": per_request}


# ---- the efficiency bound -----------------------------------------------------------
def _efficiency(cfg: ServeBenchConfig, engine: Any, file_rates: EngineRates | None,
                result: dict[str, Any], samples: list[Sample], jobs: list[Job]) -> dict[str, Any]:
    """The `efficiency` block for the served (error-free) samples of the fastest HTTP round."""
    ok = [s for s in samples if s.error is None]
    http = result["http"]
    if not ok:
        return {"ratio": None, "reason": "no request was served without an error"}
    if cfg.rate is None:
        concurrency, how = min(cfg.concurrency, len(ok)), "--concurrency (closed loop)"
    else:
        concurrency, how = max(1, round(http["mean_in_flight"])), "mean requests in flight (open loop)"
    if engine is not None:
        concurrency = min(concurrency, engine.max_batch)
    rates = file_rates
    if rates is None and engine is None:
        return {"served_tokens_per_s": http["output_tokens_per_s"], "ratio": None,
                "reason": "no engine here to measure (--url): pass --engine-rates FILE, the JSON of "
                          "`crossover bench engine` on the daemon's machine and model"}
    if rates is None:
        rates = _measure(cfg, engine, ok, concurrency, jobs)
    block = efficiency(http["output_tokens_per_s"], [s.prompt_tokens for s in ok],
                       [s.output_tokens for s in ok], concurrency, rates,
                       result.get("engine_only", {}).get("output_tokens_per_s"))
    block["bound"]["concurrency_from"] = how
    return block


def _measure(cfg: ServeBenchConfig, engine: Any, ok: list[Sample], concurrency: int,
             jobs: list[Job]) -> EngineRates:
    """Rates of the idle `engine` at the batch sizes an ideal closed loop of `concurrency` runs,
    decoding the served prompts (speculation meets their acceptance), prefilling one of their
    mean length."""
    from bench.efficiency import decode_schedule

    batches = list(decode_schedule([s.output_tokens for s in ok], concurrency)) or [1]
    new_tokens = max(4, min(cfg.max_tokens, 64))
    mean_prompt = round(sum(s.prompt_tokens for s in ok) / len(ok))
    prompt_len = max(2, min(mean_prompt, engine.max_context - new_tokens - 1))
    _log(f"measuring the engine's rates: decode at batch {sorted(batches)}, prefill of "
         f"{prompt_len} tokens")
    meter = CpuMeter()
    by_index = {job.index: job for job in jobs}
    prompts = [by_index[s.index].request(engine.tokenizer, "rate").prompt_ids for s in ok if s.index in by_index]
    rates = measure_rates(engine, batches, prompt_len, new_tokens, prompt_len, prompts)
    return replace(rates, detail={**rates.detail, "other_processes_cpu_share": meter.share()})


# ---- the summary --------------------------------------------------------------
def summarize(samples: list[Sample], wall_s: float, cpu_share: float | None = None
              ) -> dict[str, Any]:
    """Throughput and latency percentiles of the samples without an error."""
    ok = [s for s in samples if s.error is None]
    tokens = sum(s.output_tokens for s in ok)
    errors = [s.error for s in samples if s.error is not None]
    return {
        "requests": len(ok), "errors": len(errors), "error_examples": sorted(set(errors))[:3],
        "duration_s": round(wall_s, 4),
        "prompt_tokens": sum(s.prompt_tokens for s in ok), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
        "ttft_ms": distribution([s.ttft_s for s in ok]),
        "tpot_ms": distribution([s.tpot_s for s in ok]),
        "itl_ms": distribution([gap for s in ok for gap in s.itl_s]),
        "latency_ms": distribution([s.latency_s for s in ok]),
        "mean_in_flight": (round(sum(s.latency_s or 0.0 for s in ok) / wall_s, 3)
                           if wall_s > 0 else None),
        "other_processes_cpu_share": cpu_share,
    }


def distribution(seconds: list[float | None]) -> dict[str, float | None]:
    """Mean and PERCENTILES in ms of the values that are not None (numpy's linear interpolation).

    >>> distribution([0.001, 0.002, 0.003, None])
    {'n': 3, 'mean': 2.0, 'p50': 2.0, 'p90': 2.8, 'p99': 2.98}
    """
    ms = np.asarray([v * 1000.0 for v in seconds if v is not None], dtype=np.float64)
    out: dict[str, float | None] = {"n": int(ms.size),
                                    "mean": round(float(ms.mean()), 3) if ms.size else None}
    qs = np.percentile(ms, PERCENTILES) if ms.size else [None] * len(PERCENTILES)
    out.update({f"p{q}": None if v is None else round(float(v), 3) for q, v in zip(PERCENTILES, qs)})
    return out


class CpuMeter:
    """Share of the machine's CPU time that other processes used since it was made, and
    `steal()`: the share the hypervisor gave to other machines while ours wanted it (a VM's
    steal time, which "other processes" includes: /proc/stat counts it busy)."""

    def __init__(self) -> None:
        self._start = _cpu_sample()

    def share(self) -> float | None:
        return self._of_capacity(lambda busy, own, steal: max(0.0, busy - own))

    def steal(self) -> float | None:
        return self._of_capacity(lambda busy, own, steal: steal)

    def _of_capacity(self, seconds) -> float | None:
        """`seconds(busy, own, steal)` (CPU seconds since the start) over the machine's CPU
        seconds in that time."""
        end = _cpu_sample()
        if self._start is None or end is None:
            return None
        busy, own, wall, steal = (b - a for a, b in zip(self._start, end, strict=True))
        capacity = wall * (os.cpu_count() or 1)
        return round(seconds(busy, own, steal) / capacity, 3) if capacity > 0 else None


def _cpu_sample() -> tuple[float, float, float, float] | None:
    """(seconds of busy CPU machine-wide, this process's CPU seconds, wall seconds, seconds
    of steal machine-wide)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = (sum(ticks) - ticks[3] - ticks[4]) / hz  # all but idle, iowait
    steal = ticks[7] / hz if len(ticks) > 7 else 0.0
    own = os.times()
    return busy, own.user + own.system, time.perf_counter(), steal


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
    _log("loading the model")
    engine = load_engine(model=cfg.model, dtype=cfg.dtype, max_batch=cfg.max_batch,
                         max_context=cfg.max_context, speculation=cfg.speculation, model_proposers=(),
                         progress=progress, prefix_cache=cfg.prefix_cache)
    _log("warming up (every bucket compiles once; cached on disk for the next run)")
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
        _log(f"no local tokenizer ({exc}); system prompts sized at 4 characters a token")
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


async def _served_model(url: str, api_key: str | None) -> str:
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
def _log(message: str) -> None:
    from daemon.progress import say

    say(f"bench serve: {message}")


def _progress(phase: str, total: int) -> Any:
    """Requests done in a phase: a bar on a terminal, else a line every eighth of them."""
    from daemon.progress import reporter

    bars, every = reporter(), max(1, total // 8)

    def report(done: int) -> None:
        if callable(bars):
            bars(f"bench serve: {phase} requests", done, total)
        elif done % every == 0 or done == total:
            _log(f"{phase}: {done}/{total} requests done")

    return report


def _line(phase: str, s: dict[str, Any]) -> str:
    return (f"{phase}: {s['output_tokens_per_s']} output tok/s, {s['requests_per_s']} req/s, "
            f"TTFT p50/p99 {s['ttft_ms']['p50']}/{s['ttft_ms']['p99']} ms, "
            f"TPOT p50/p99 {s['tpot_ms']['p50']}/{s['tpot_ms']['p99']} ms, "
            f"{s['errors']} errors")
