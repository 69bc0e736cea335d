"""`crossover bench serve`: throughput and latency over HTTP, and its cost over the bare engine.

1. Load the engine (Gemma 3 270M unless --model; FakeEngine with --fake) and
   warm it up once; both phases below share it.
2. Draw prompts from bench.workloads (`mixed`, seeded; --mix weights the
   kinds copy/code/chat/prose), keeping those whose tokens plus max_tokens fit
   the context, and make jobs (bench.loadgen): closed loop with
   --concurrency clients, or Poisson arrivals at --rate requests/s.
3. HTTP phase: the daemon runs in this process (make_app on this event loop,
   127.0.0.1, an ephemeral port, open mode, a temporary telemetry database,
   the tuner off), or is the one at --url. One warm-up request, then the jobs,
   streamed, until they are all sent or --seconds have passed.
4. Engine phase: the same jobs (those the HTTP phase sent), at the same
   concurrency or arrival times, straight into `engine.step()` on this
   thread. Skipped with --url (the engine is elsewhere).
5. Steps 3 and 4 alternate --rounds times (default 1).
6. Summary per phase: output tokens/s and requests/s over the wall time from
   the first send to the last finish; mean/p50/p90/p99 of TTFT, TPOT and
   end-to-end latency in ms; the share of CPU other processes took meanwhile
   (the machine may be shared). Each phase reports its fastest round, since
   other processes only ever slow a round down; `rounds` lists them all.
   `http_over_engine` = HTTP output tokens/s over engine output tokens/s
   (the serving overhead; 1.0 is none). JSON goes to --out, progress to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import Job, Sample, make_jobs, run_engine, run_http
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
    db: str | None = None
    """Telemetry database of the in-process daemon; None: a temporary SQLite file."""
    no_db: bool = False
    """Run the in-process daemon without a telemetry database."""


def run_bench(cfg: ServeBenchConfig, out_path: str | None = None) -> dict[str, Any]:
    """Run both phases (cfg.rounds times) and return (and write to `out_path`) the JSON result."""
    engine = None if cfg.url else _load_engine(cfg)
    prompts = _prompts(cfg, engine)
    jobs = make_jobs(prompts, cfg.max_tokens, cfg.rate, cfg.seed)
    shown = {**asdict(cfg), "api_key": "***" if cfg.api_key else None}
    result: dict[str, Any] = {"bench": "serve", "config": shown, **_describe(engine)}
    mode = f"rate {cfg.rate}/s" if cfg.rate else f"concurrency {cfg.concurrency}"
    _log(f"{len(jobs)} requests of {cfg.max_tokens} tokens, {mode}, {cfg.rounds} round(s)")
    rounds = []
    for r in range(cfg.rounds):
        http, sent = asyncio.run(_http_phase(cfg, engine, jobs, deadline=r == 0))
        jobs = jobs[:sent]  # later rounds, and the engine, send what the first round sent
        _log(_line(f"round {r + 1} http", http))
        rounds.append({"http": http})
        if engine is not None:
            meter = CpuMeter()
            samples, wall = run_engine(engine, jobs, cfg.concurrency, cfg.rate,
                                       _progress("engine", sent), tag=f"r{r}")
            rounds[-1]["engine_only"] = summarize(samples, wall, meter.share())
            _log(_line(f"round {r + 1} engine only", rounds[-1]["engine_only"]))
    result.update(_best_rounds(rounds))
    if engine is not None:
        result["compiles_since_warmup"] = _compiles(engine)
    _log(f"http_over_engine: {result['http_over_engine']}")
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
                      deadline: bool) -> tuple[dict[str, Any], int]:
    """Summary of the HTTP phase and how many jobs it sent (within --seconds if `deadline`)."""
    seconds = cfg.seconds if deadline else None
    if cfg.url:
        model = await _served_model(cfg.url, cfg.api_key)
        return await _measure_http(cfg, cfg.url, model, jobs, seconds)
    from aiohttp import web

    from daemon.app import make_app
    from daemon.state import ENGINE_THREAD

    with tempfile.TemporaryDirectory(prefix="crossover-bench-") as tmp:
        database = None if cfg.no_db else _open_database(cfg.db or f"sqlite:///{tmp}/serve.db")
        app = make_app(_settings(cfg, engine, len(jobs)), engine, database=database, warmup=False)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                               shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            while not app[ENGINE_THREAD].ready:
                await asyncio.sleep(0.01)
            return await _measure_http(cfg, url, engine.model_name, jobs, seconds)
        finally:
            await runner.cleanup()


async def _measure_http(cfg: ServeBenchConfig, url: str, model: str, jobs: list[Job],
                        seconds: float | None) -> tuple[dict[str, Any], int]:
    warm = Job(-1, jobs[0].prompt, 2)
    warm_samples, _ = await run_http(url, model, [warm], 1, None, cfg.api_key)
    if warm_samples[0].error:
        raise UserError(f"the warm-up request to {url} failed: {warm_samples[0].error}")
    meter = CpuMeter()
    samples, wall = await run_http(url, model, jobs, cfg.concurrency, cfg.rate, cfg.api_key,
                                   seconds, _progress("http", len(jobs)))
    return summarize(samples, wall, meter.share()), len(samples)


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
        "latency_ms": distribution([s.latency_s for s in ok]),
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
    """Share of the machine's CPU time that other processes used since it was made."""

    def __init__(self) -> None:
        self._start = _cpu_sample()

    def share(self) -> float | None:
        end = _cpu_sample()
        if self._start is None or end is None:
            return None
        busy, own, wall = (b - a for a, b in zip(self._start, end, strict=True))
        capacity = wall * (os.cpu_count() or 1)
        return round(max(0.0, busy - own) / capacity, 3) if capacity > 0 else None


def _cpu_sample() -> tuple[float, float, float] | None:
    """(seconds of busy CPU machine-wide, this process's CPU seconds, wall seconds)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
    own = os.times()
    return busy, own.user + own.system, time.perf_counter()


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
                         max_context=cfg.max_context, speculation=False, progress=progress)
    _log("warming up (every bucket compiles once; cached on disk for the next run)")
    engine.warmup(progress=progress)
    return engine


def _prompts(cfg: ServeBenchConfig, engine: Any) -> list[Any]:
    """cfg.requests prompts of the mix; with an engine, only those that fit its context."""
    from bench.workloads import mixed

    if engine is None:
        return mixed(cfg.requests, cfg.mix, cfg.seed)
    room = engine.max_context - cfg.max_tokens
    drawn = mixed(cfg.requests * 4, cfg.mix, cfg.seed)
    fits = [p for p in drawn
            if len(engine.tokenizer.encode(p.render(engine.tokenizer))) <= room][: cfg.requests]
    if len(fits) < cfg.requests:
        raise UserError(f"only {len(fits)} of {len(drawn)} prompts fit max_context "
                        f"{engine.max_context} with max_tokens {cfg.max_tokens}; "
                        "raise max_context")
    return fits


def _settings(cfg: ServeBenchConfig, engine: Any, jobs: int) -> Any:
    from daemon.settings import Settings
    from tuner.config import TunerConfig

    return Settings(host="127.0.0.1", port=0, max_batch=engine.max_batch,
                    max_context=engine.max_context, max_waiting=max(256, jobs, cfg.concurrency),
                    tuner=TunerConfig(enabled=False, search_process=False), open_mode=True,
                    log_level="warning")


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
