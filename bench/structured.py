"""`crossover bench structured`: constrained decoding against free decoding, same daemon, same run.

1. The daemon: the one at `--url`, or a `crossover serve` child on a free loopback port with its
   defaults (a temporary telemetry database; `--serve-arg`s added), ready once every technique is.
2. The workload: bench.workloads.schemas, 20 JSON schemas (nested objects, arrays, enums,
   bounded numbers, optional fields, patterns, `$ref`) times 5 subjects, as chat requests,
   streamed, greedy, from `--concurrency` clients.
3. Rounds alternate two phases over the same requests: `constrained` (each with its schema as
   `response_format` json_schema, `--max-tokens`) and `free` (no constraint, ignore_eos,
   `--free-tokens` tokens each). The daemon's prefix cache is emptied before each phase (with
   `--admin-token` for a daemon at `--url`).
4. Per phase: TPOT p50/p90 (time per output token after the first), TTFT p50, output tokens/s;
   for constrained phases every answer parsed and validated against its schema (jsonschema), and
   the grammar's host time per step from /metrics (`crossover_grammar_seconds_total` over
   `crossover_grammar_steps_total`). The headline is the constrained TPOT p50 over the free one,
   per round and its median.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak import scrape
from bench.soak_daemon import Daemon
from bench.soak_run import percentile
from bench.workloads.schemas import structured_requests


@dataclass(frozen=True)
class StructuredConfig:
    url: str | None = None
    admin_token: str | None = None
    concurrency: int = 8
    rounds: int = 2
    max_tokens: int = 160
    free_tokens: int = 48
    serve_args: tuple[str, ...] = ()


@dataclass
class Answer:
    name: str
    ttft_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    text: str = ""
    finish: str | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.last_s is None or self.tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.tokens - 1)


async def _one(session: aiohttp.ClientSession, base: str, model: str, name: str,
               schema: dict[str, Any] | None,
               message: str, max_tokens: int) -> Answer:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": message}],
                            "temperature": 0, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                          "strict": True}}
    out, sent, parts = Answer(name), time.perf_counter(), []
    try:
        async with session.post(base + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            async for line in r.content:
                if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter() - sent
                for c in chunk.get("choices", ()):
                    if c["delta"].get("content"):
                        parts.append(c["delta"]["content"])
                        out.ttft_s = out.ttft_s if out.ttft_s is not None else now
                    out.finish = c.get("finish_reason") or out.finish
                    out.last_s = now if c.get("finish_reason") else out.last_s
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.text = "".join(parts)
    return out


def valid(answer: Answer, schema: dict[str, Any]) -> str | None:
    """Why `answer` does not hold an instance of `schema`; None when it does."""
    import jsonschema

    if answer.error:
        return answer.error
    try:
        jsonschema.validate(json.loads(answer.text), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        return (f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]} (finish {answer.finish}): "
                f"{answer.text[:200]!r}")
    return None


class Runner:
    def __init__(self, cfg: StructuredConfig, base: str, admin: dict[str, str] | None,
                 note: Callable[[str], None]):
        self.cfg, self.base, self.admin, self.note = cfg, base, admin, note
        self.work = structured_requests()

    async def phase(self, session: aiohttp.ClientSession, model: str, constrained: bool) -> dict[str, Any]:
        if self.admin is not None:
            await (await session.post(self.base + "/admin/reset_prefix_cache", headers=self.admin)).release()
        before = await self.metrics(session)
        pending, answers = list(reversed(range(len(self.work)))), {}
        start = time.perf_counter()

        async def client() -> None:
            while pending:
                i = pending.pop()
                name, schema, message = self.work[i]
                answers[i] = await _one(session, self.base, model, name, schema if constrained else None,
                                        message, self.cfg.max_tokens if constrained else self.cfg.free_tokens)

        await asyncio.gather(*(client() for _ in range(self.cfg.concurrency)))
        wall = time.perf_counter() - start
        after = await self.metrics(session)
        got = [answers[i] for i in range(len(self.work))]
        tpot = [a.tpot_s * 1e3 for a in got if a.tpot_s is not None]
        ttft = [a.ttft_s * 1e3 for a in got if a.ttft_s is not None]
        out: dict[str, Any] = {
            "phase": "constrained" if constrained else "free", "requests": len(got), "wall_s": round(wall, 2),
            "output_tokens": sum(a.tokens for a in got),
            "output_tok_s": round(sum(a.tokens for a in got) / wall, 2),
            "tpot_ms": {"p50": _r(percentile(tpot, 50)), "p90": _r(percentile(tpot, 90))},
            "ttft_ms": {"p50": _r(percentile(ttft, 50))}, "errors": [a.error for a in got if a.error][:5]}
        if constrained:
            bad = [(a.name, why) for a, (_, schema, _) in zip(got, self.work) if (why := valid(a, schema))]
            steps = after.get("crossover_grammar_steps_total",
                              0) - before.get("crossover_grammar_steps_total", 0)
            secs = after.get("crossover_grammar_seconds_total",
                             0) - before.get("crossover_grammar_seconds_total", 0)
            out.update(valid=len(got) - len(bad), invalid=bad[:10],
                       finish_reasons={r: sum(a.finish == r for a in got) for r in {a.finish for a in got}},
                       grammar_steps=int(steps),
                       grammar_ms_per_step=_r(secs * 1e3 / steps) if steps else None)
        self.note(f"structured: {out['phase']}: TPOT p50 {out['tpot_ms']['p50']} ms, "
                  f"{out['output_tok_s']} tok/s"
                  + (f", {out['valid']}/{len(got)} valid" if constrained else ""))
        return out

    async def metrics(self, session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(self.base + "/metrics", headers=self.admin) as r:
            return scrape(await r.text()) if r.status == 200 else {}

    async def run(self) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            async with session.get(self.base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            rounds = []
            for k in range(self.cfg.rounds):
                self.note(f"structured: round {k + 1}/{self.cfg.rounds}")
                constrained = await self.phase(session, model, True)
                free = await self.phase(session, model, False)
                ratio = (constrained["tpot_ms"]["p50"] / free["tpot_ms"]["p50"]
                         if constrained["tpot_ms"]["p50"] and free["tpot_ms"]["p50"] else None)
                rounds.append({"constrained": constrained, "free": free, "tpot_p50_ratio": _r(ratio, 3)})
        ratios = [r["tpot_p50_ratio"] for r in rounds if r["tpot_p50_ratio"] is not None]
        return {"bench": "structured", "config": asdict(self.cfg), "model": model, "rounds": rounds,
                "tpot_p50_ratio_median": _r(statistics.median(ratios), 3) if ratios else None,
                "valid_all_rounds": all(r["constrained"]["valid"] == r["constrained"]["requests"]
                                        for r in rounds)}


def _r(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def run_structured(cfg: StructuredConfig, out: str | None, note: Callable[[str], None] | None = None) -> dict:
    """Run the bench (module docstring); print and write its JSON."""
    from bench import print_and_write
    from bench.soak_daemon import SoakConfig

    note = note or (lambda line: print(line, file=sys.stderr, flush=True))
    if cfg.url:
        admin = {"Authorization": f"Bearer {cfg.admin_token}"} if cfg.admin_token else None
        result = asyncio.run(Runner(cfg, cfg.url.rstrip("/"), admin, note).run())
        return print_and_write(result, out)
    with tempfile.TemporaryDirectory(prefix="crossover-structured-") as tmp:
        daemon = Daemon(Path(tmp), SoakConfig(serve_args=("--open", *cfg.serve_args)))
        note(f"structured: started {' '.join(daemon.argv[2:])} (pid {daemon.proc.pid})")
        try:
            async def go() -> dict[str, Any]:
                from bench.soak_run import Soak

                soak = Soak(SoakConfig(), daemon, note)
                async with aiohttp.ClientSession() as session:
                    soak.session = session
                    await soak.wait_ready()
                return await Runner(cfg, daemon.base, daemon.admin, note).run()

            result = asyncio.run(go())
        finally:
            daemon.stop()
        result["daemon_argv"] = daemon.argv[3:]
        return print_and_write(result, out)
