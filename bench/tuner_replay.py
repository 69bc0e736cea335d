"""`crossover bench tuner`'s client: the trace replayed over HTTP, open loop, each request with its
tenant's key (bench/tuner.py's module doc, 3), and the retune probe (4).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.tuner_config import TunerBenchConfig
from bench.workloads.trace import PHASE_NAMES
from daemon.user_error import UserError


@dataclass(frozen=True)
class Arrival:
    """One request of the trace, ready to send."""

    index: int
    at_s: float
    phase: int
    tenant: str
    route: str
    body: dict[str, Any]


@dataclass
class Stream:
    """What the client saw of one request; times are unix seconds."""

    index: int
    phase: int
    request_id: str = ""
    """The daemon's id (X-Request-Id), which is the engine request's."""
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried text."""
    output_tokens: int = 0
    done: float | None = None
    error: str | None = None


class Client:
    """Streams requests with their tenant's key and calls the admin API."""

    def __init__(self, http: Any, base: str, keys: dict[str, str], admin_token: str) -> None:
        self.http, self.base, self.keys, self.admin_token = http, base, keys, admin_token

    async def admin(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        async with self.http.request(method, self.base + path, json=body, headers=headers) as r:
            payload = await r.json()
            if r.status >= 300:
                raise UserError(f"{method} {path}: HTTP {r.status}: {payload}")
            return payload

    async def stream(self, arrival: Arrival, s: Stream) -> Stream:
        import aiohttp

        from bench.loadgen import read_sse

        s.sent = time.time()
        headers = {"Authorization": f"Bearer {self.keys[arrival.tenant]}"}
        try:
            async with self.http.post(self.base + arrival.route, json=arrival.body,
                                      headers=headers) as response:
                if response.status != 200:
                    s.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return s
                s.request_id = response.headers.get("X-Request-Id", "")
                async for chunk in read_sse(response.content):
                    if chunk.error is not None:
                        s.error = chunk.error
                    if chunk.usage:
                        s.output_tokens = chunk.usage["completion_tokens"]
                    s.chunks += [time.time()] * chunk.texts
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        s.done = time.time()
        return s


async def replay(client: Client, phases: list[Any], arrivals: list[Arrival], name: str,
                 drain: bool = True) -> tuple[list[Stream], list[tuple[float, float]]]:
    """Send every arrival at its time (open loop), honouring each phase's max_concurrency.

    With `drain`, a phase starts once the previous one's requests have all finished (its
    arrivals keep their offsets from the phase's start). Returns the streams and each
    phase's (start, end) in unix seconds; the last ends when its last request finished.
    """
    streams = [Stream(a.index, a.phase) for a in arrivals]
    tasks: list[asyncio.Task] = []
    bounds: list[tuple[float, float]] = []
    offset, start = 0.0, time.time()
    for i, phase in enumerate(phases):
        begin = time.time() if drain else start + offset
        gate = asyncio.Semaphore(phase.max_concurrency) if phase.max_concurrency else None
        done = sum(s.done is not None for s in streams)
        log(f"{name}: phase {i + 1}/{len(phases)} ({PHASE_NAMES[i]}), {done} requests done")
        mine = []
        for a in (a for a in arrivals if a.phase == i):
            await asyncio.sleep(max(0.0, begin + a.at_s - offset - time.time()))
            mine.append(asyncio.create_task(_send(client, a, streams[a.index], gate)))
        await asyncio.sleep(max(0.0, begin + phase.duration_s - time.time()))
        if drain:
            await asyncio.gather(*mine)
        tasks += mine
        offset += phase.duration_s
        bounds.append((begin, time.time() if drain else begin + phase.duration_s))
    await asyncio.gather(*tasks)
    bounds[-1] = (bounds[-1][0], max(bounds[-1][1], time.time()))
    errors = Counter(s.error.split(":", 1)[0] for s in streams if s.error is not None)
    log(f"{name}: trace done in {time.time() - start:.1f} s, {sum(errors.values())} errors"
        + "".join(f", {n} {e}" for e, n in errors.most_common(3)))
    return streams, bounds


async def _send(client: Client, a: Arrival, s: Stream, gate: asyncio.Semaphore | None) -> None:
    if gate is None:
        await client.stream(a, s)
        return
    async with gate:
        await client.stream(a, s)


async def retune_probe(client: Client, cfg: TunerBenchConfig, tuner: Any,
                       arrivals: list[Arrival]) -> dict[str, Any]:
    """Closed-loop mixed traffic; retunes triggered between quiet windows (bench/tuner.py, module doc 4)."""
    tuner.config = dataclasses.replace(tuner.config, min_new_steps=1 << 30)  # schedule: skip
    pool = [a for a in arrivals if a.phase == 1] or arrivals
    streams: list[Stream] = []
    stop = asyncio.Event()

    async def worker(k: int) -> None:
        i = k
        while not stop.is_set():
            a = pool[i % len(pool)]
            s = Stream(len(streams), 1)
            streams.append(s)
            await client.stream(a, s)
            i += cfg.probe_concurrency

    log(f"probe: {cfg.probe_concurrency} clients, a settling retune, then {cfg.probe_retunes} "
        f"retunes {cfg.quiet:g} s apart")
    workers = [asyncio.create_task(worker(k)) for k in range(cfg.probe_concurrency)]
    try:
        await _wait_running(client, tuner)
        settle = await _retune(client)
        windows = []
        for k in range(cfg.probe_retunes):
            await asyncio.sleep(cfg.quiet)
            windows.append(await _retune(client))
            log(f"probe: retune {k + 1}/{cfg.probe_retunes} searched "
                f"{windows[-1]['search_end'] - windows[-1]['start']:.1f} s, {windows[-1]['status']}")
        await asyncio.sleep(cfg.quiet)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    return {"settle": settle, "windows": windows, "streams": streams, "end": time.time()}


async def _wait_running(client: Client, tuner: Any) -> None:
    """Let a scheduled retune that is still running finish first."""
    running = tuner.describe()["running"]
    while running is not None:
        view = await client.admin("GET", f"/admin/retunes/{running}")
        if view["status"] != "running":
            return
        await asyncio.sleep(0.1)


async def _retune(client: Client) -> dict[str, Any]:
    """Trigger a retune and follow it: when it started, stopped searching and ended."""
    start = time.time()
    view = (await client.admin("POST", "/admin/retune"))["retune"]
    search_end = None
    while view["status"] == "running":
        if search_end is None and view.get("phase") not in ("searching", "running"):
            search_end = time.time()
        await asyncio.sleep(0.05)
        view = await client.admin("GET", f"/admin/retunes/{view['id']}")
    end = time.time()
    return {"id": view["id"], "start": start, "search_end": search_end or end, "end": end,
            "status": view["status"], "version": view["chosen_policy_version"],
            "note": view["error"] or (view["details"] or {}).get("reason")}


def log(message: str) -> None:
    from daemon.progress import say

    say(f"bench tuner: {message}")
