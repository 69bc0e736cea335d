"""The traffic of `crossover bench soak` (bench/soak.py's module doc, 2-3): the rehearsal, the
baseline, and the soak itself with its hostile clients, bad inputs, admin chaos and killed
search process; each phase's latency summary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.soak_clients import (
    Answer,
    BadCase,
    bad_cases,
    error_of,
    raw_request,
    request_body,
    well_formed,
    wrong_admin,
)
from bench.soak_daemon import Daemon, Note, SoakConfig
from bench.soak_hostile import ENGINE_HOSTILE, HOSTILE, Hostile
from bench.workloads import mixed


@dataclass
class Tally:
    """What the soak phase sent and got."""

    sent: int = 0
    statuses: Counter = dataclasses.field(default_factory=Counter)
    bad: Counter = dataclasses.field(default_factory=Counter)
    hostile: Counter = dataclasses.field(default_factory=Counter)
    hostile_open: int = 0
    hostile_peak: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    admin: Counter = dataclasses.field(default_factory=Counter)

    def saw(self, status: int, what: str) -> None:
        self.sent += 1
        self.statuses[str(status)] += 1
        if status >= 500:
            self.problems.append(f"{what}: {status}")


class Soak:
    def __init__(self, cfg: SoakConfig, daemon: Daemon, note: Note) -> None:
        from daemon.settings import load_settings

        self.cfg, self.d, self.note = cfg, daemon, note
        self.settings = load_settings({}, os.environ, None)
        self.session: aiohttp.ClientSession | None = None
        self.keys: dict[str, str] = {}
        self.model = ""
        self.tally = Tally()
        self.retunes: dict[str, Any] = {}

    # -- HTTP helpers --
    async def get(self, path: str, admin: bool = True) -> tuple[int, Any]:
        assert self.session is not None
        async with self.session.get(self.d.base + path, headers=self.d.admin if admin else None) as r:
            body = await r.json(content_type=None) if r.content_type == "application/json" else await r.text()
            return r.status, body

    async def send(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert self.session is not None
        async with self.session.request(method, self.d.base + path, json=body, headers=self.d.admin) as r:
            return r.status, await r.json(content_type=None)

    async def wait_ready(self) -> dict[str, Any]:
        start, last = time.monotonic(), 0.0
        while time.monotonic() - start < self.cfg.ready_timeout_s:
            if not self.d.alive():
                raise RuntimeError(f"the daemon exited ({self.d.proc.returncode}); see {self.d.log_path}")
            try:
                status, body = await self.get("/ready", admin=False)
            except aiohttp.ClientError:
                status, body = 0, None
            techniques = (body or {}).get("engine", {}).get("techniques",
                                                            {}) if isinstance(body, dict) else {}
            if status == 200 and all(v == "ready" for v in techniques.values()):
                self.note(f"soak: daemon ready, every technique compiled ({time.monotonic() - start:.0f} s)")
                return body
            if time.monotonic() - last > 15:
                last = time.monotonic()
                self.note(f"soak: waiting for the daemon: {status or 'not listening'} {techniques}")
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the daemon was not ready within {self.cfg.ready_timeout_s:.0f} s")

    async def setup(self) -> None:
        for name, limits in (("soak-clients", {}), ("soak-hostile", {"max_concurrent": 4, "max_queued": 2})):
            status, body = await self.send("POST", "/admin/tenants", {"name": name, **limits})
            if status != 201:
                raise RuntimeError(f"could not add tenant {name}: {status} {body}")
            self.keys[name] = body["api_key"]
        assert self.session is not None
        async with self.session.get(self.d.base + "/v1/models",
                                    headers={"Authorization": f"Bearer {self.keys['soak-clients']}"}) as r:
            self.model = (await r.json())["data"][0]["id"]

    # -- the well-formed load --
    def jobs(self) -> list[tuple[str, dict[str, Any]]]:
        rng = random.Random(f"crossover-soak:{self.cfg.seed}")
        prompts = mixed(self.cfg.well_formed, {"copy": 1, "code": 1, "chat": 1, "prose": 1}, self.cfg.seed)
        return [request_body(p, self.model, rng, self.cfg.max_tokens) for p in prompts]

    async def load(self, phase: str, n: int, count: Callable[[Answer], None] | None = None
                   ) -> tuple[list[Answer], float]:
        """The first `n` well-formed jobs from `--concurrency` clients, the prefix cache emptied first."""
        assert self.session is not None
        await self.send("POST", "/admin/reset_prefix_cache")
        pending, answers = list(reversed(self.jobs()[:n])), []
        key, start, last = self.keys["soak-clients"], time.perf_counter(), [time.monotonic()]

        async def client() -> None:
            while pending:
                path, body = pending.pop()
                answer = await well_formed(self.session, self.d.base, path, body,
                                           key)  # type: ignore[arg-type]
                answers.append(answer)
                if count is not None:
                    count(answer)
                if time.monotonic() - last[0] > 20:
                    last[0] = time.monotonic()
                    self.note(f"soak: {phase}: {len(answers)}/{n} well-formed requests")

        await asyncio.gather(*(client() for _ in range(self.cfg.concurrency)))
        return answers, time.perf_counter() - start

    async def idle(self, timeout_s: float = 180.0) -> dict[str, Any]:
        """/admin/status once nothing is in flight and no page is held (or after `timeout_s`)."""
        end = time.monotonic() + timeout_s
        while True:
            _, status = await self.get("/admin/status")
            queue, pool = status["queue"], status["pool"]
            quiet = (queue["http_in_flight"] == 0 and queue["engine_active"] == 0 and queue["running"] == 0
                     and queue["waiting"] == 0 and pool["pages_used"] == 0)
            if quiet or time.monotonic() > end:
                return status
            await asyncio.sleep(0.5)

    async def level(self) -> dict[str, int]:
        """RSS, descriptors and OS threads of the daemon, read with no client connected (the
        caller closed its session: a second for the daemon to close its ends)."""
        await asyncio.sleep(1.0)
        return {"rss_bytes": self.d.rss_bytes(), "fds": self.d.fds(), "os_threads": self.d.threads(),
                "fd_kinds": self.d.fd_kinds()}

    # -- the hostile side --
    async def hostile_slot(self, i: int, stop: asyncio.Event, engine: bool) -> None:
        rng = random.Random(f"crossover-soak:hostile:{self.cfg.seed}:{engine}:{i}")
        key = self.keys["soak-hostile"]
        while not stop.is_set():
            self.tally.hostile_open += 1
            self.tally.hostile_peak = max(self.tally.hostile_peak, self.tally.hostile_open)
            try:
                if engine:
                    out = await rng.choice(ENGINE_HOSTILE)(self.d.port, key, rng, self.model,
                                                           self.cfg.max_tokens,
                                                            self.settings.stream_write_timeout_s)
                else:
                    kind = rng.choice(HOSTILE)
                    timeout = self.settings.body_timeout_s if kind.__name__ == "stalled_body" \
                        else self.settings.header_timeout_s
                    out = await kind(self.d.port, key, rng, timeout)
            except OSError as exc:
                out = Hostile("connect", problem=f"could not connect: {exc}")
            finally:
                self.tally.hostile_open -= 1
            self.tally.hostile[out.kind] += 1
            self.tally.saw(out.status, out.kind)
            if out.problem:
                self.tally.problems.append(out.problem)

    async def bad_inputs(self, rate: float, paced: Callable[[], bool], stop: Callable[[], bool]) -> None:
        """Bad inputs in turn, `rate` a second while `paced()`, then as fast as they are
        answered until `stop()`."""
        cases = bad_cases(self.model, self.keys["soak-clients"], self.d.token,
                          self.settings.max_context or 4096,
                          self.settings.max_body_bytes)
        wrong, i, last_wrong = wrong_admin(self.d.token), 0, time.monotonic()
        next_at = time.monotonic()
        while not stop():
            case = cases[i % len(cases)]
            i += 1
            if time.monotonic() - last_wrong > 10:
                case, last_wrong = wrong, time.monotonic()
            if paced():
                next_at += 1.0 / rate
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await self.bad_one(case)

    async def bad_one(self, case: BadCase) -> None:
        raw = await raw_request(self.d.port, case.data)
        self.tally.bad[case.name] += 1
        self.tally.saw(raw.status, case.name)
        error = error_of(raw)
        if case.name == "wrong admin token" and raw.status == 429:  # the guess throttle
            case = dataclasses.replace(case, status=429, code="too_many_attempts")
        if raw.status != case.status or error is None or (case.code and error.get("code") != case.code):
            self.tally.problems.append(f"bad input {case.name!r}: {raw.status} {raw.body[:200]!r}")

    async def admin_chaos(self, stop: asyncio.Event, lock: asyncio.Lock) -> None:
        rng = random.Random(f"crossover-soak:admin:{self.cfg.seed}")
        while not stop.is_set():
            async with lock:
                if rng.random() < 0.6:
                    depth = rng.choice([1, 2, 3, 4])
                    pin = {"rules": [{"max_batch": rng.choice([1, 2, 4]), "technique": "ngram",
                                      "depth": depth},
                                     {"max_batch": 64}], "crossover": rng.choice([1, 2, 4])}
                    status, body = await self.send("PUT", "/admin/policy/pin", pin)
                    ok, what = status == 200 and body.get("pinned") is True, "pin"
                else:
                    status, body = await self.send("DELETE", "/admin/policy/pin")
                    ok, what = status in (200, 409), "unpin"
                self.tally.saw(status, what)
                self.tally.admin[what] += 1
                if not ok:
                    self.tally.problems.append(f"admin {what}: {status} {body}")
            await asyncio.sleep(rng.uniform(0.3, 1.0))

    async def retune(self) -> dict[str, Any]:
        status, body = await self.send("POST", "/admin/retune")
        self.tally.saw(status, "retune")
        if status not in (200, 202) or "retune" not in body:
            raise RuntimeError(f"POST /admin/retune: {status} {body}")
        return body["retune"]

    async def retune_done(self, retune_id: int, timeout_s: float,
                          searched_only: bool = False) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            _, view = await self.get(f"/admin/retunes/{retune_id}")
            if view["status"] != "running" or time.monotonic() > end or (
                    searched_only and view.get("phase") != "searching"):
                return view
            await asyncio.sleep(0.2)

    async def search_pid(self) -> int | None:
        _, tuner = await self.get("/admin/tuner")
        return tuner.get("search_pid") or next(
            (p for p, cmd in self.d.children() if "multiprocessing" in cmd and "resource_tracker" not in cmd),
            None)

    async def kill_search(self, lock: asyncio.Lock) -> None:
        """A retune whose search process is SIGKILLed while it searches (tried a few times: a
        search can end before it is seen; else the idle process is killed and a retune
        started), then one more retune that must end normally (its search in a new process)."""
        async with lock:
            await self.send("DELETE", "/admin/policy/pin")
            crashed, pid, when = None, None, "idle"
            for _ in range(4):
                started = await self.retune()
                while True:
                    _, view = await self.get(f"/admin/retunes/{started['id']}")
                    if view["status"] != "running":
                        break
                    pid = await self.search_pid() if view.get("phase") == "searching" else None
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        crashed, when = await self.retune_done(started["id"], 300), "searching"
                        break
                    await asyncio.sleep(0.01)
                if crashed is not None:
                    break
            if crashed is None:
                pid = await self.search_pid()
                if pid is None:
                    self.tally.problems.append("no search process to kill")
                    return
                os.kill(pid, signal.SIGKILL)
                crashed = await self.retune_done((await self.retune())["id"], 300)
            second = await self.retune()
            await self.retune_done(second["id"], 300, searched_only=True)
        self.retunes = {"killed_pid": pid, "killed_while": when, "killed": crashed, "next_id": second["id"]}
        self.note(f"soak: search process {pid} killed while {when}; that retune: {crashed['status']} "
                  f"{(crashed.get('error') or '')[:80]}")

    # -- the whole run --
    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            self.session = session
            ready = await self.wait_ready()
            await self.setup()
            # a short soak first, so that what the daemon makes once and keeps (pooled database
            # connections, a replaced search process, allocator arenas) is in the level it must return to
            rehearsal, self.tally = self.tally, Tally()
            n = min(cfg.well_formed, 2 * cfg.concurrency)
            self.note(f"soak: rehearsal: {n} well-formed requests beside all of the rest")
            await self.under_attack("rehearsal", n, n + 40, 20.0)
            # database-backed admin reads at once: the telemetry database's connection pool
            # opens the connections it keeps (pool_size) now, not first during the soak
            await asyncio.gather(*(self.get(path) for path in ("/admin/tenants", "/admin/retunes") * 8))
            rehearsal.problems += [f"rehearsal: {p}" for p in self.tally.problems]
            self.tally = rehearsal
            await self.idle()
            self.note(f"soak: baseline: {cfg.well_formed} well-formed requests, {cfg.concurrency} clients")
            base, base_wall = await self.load("baseline", cfg.well_formed)
            await self.idle()
        before = await self.level()
        self.note(f"soak: level before: {before}")
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            self.session = session
            # bad inputs spread over the time the load took alone: a steady trickle, not a flood
            rate = max(1.0, (cfg.requests - cfg.well_formed) / max(base_wall, 1.0))
            self.note(f"soak: {cfg.hostile} + {cfg.engine_hostile} hostile connections at once, bad inputs, "
                      f"admin pins; {cfg.requests} requests in all")
            answers, wall = await self.under_attack("soak", cfg.well_formed, cfg.requests, rate)
            self.note(f"soak: {self.tally.sent} requests sent; settling")
        return {"baseline": phase_summary(base, base_wall), "soak": phase_summary(answers, wall),
                "answers": (base, answers), "ready": {"techniques": ready["engine"].get("techniques")},
                "level_before": before}

    async def under_attack(self, phase: str, n: int, requests: int,
                           rate: float) -> tuple[list[Answer], float]:
        """`n` well-formed requests beside the hostile clients, the admin and bad inputs at `rate`
        a second (then unpaced until `requests` were sent); a search process killed a third of
        the way. Returns once every client stopped and the last retune ended."""
        cfg, tally = self.cfg, self.tally
        stop_hostile, stop_admin, lock = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        well_done, done, killer = asyncio.Event(), [0], []

        def counted(answer: Answer) -> None:
            tally.saw(answer.status, "well-formed")
            done[0] += 1
            if done[0] == max(1, n // 3):
                killer.append(asyncio.create_task(self.kill_search(lock)))

        hostile = [asyncio.create_task(self.hostile_slot(i, stop_hostile, False)) for i in range(cfg.hostile)]
        hostile += [asyncio.create_task(self.hostile_slot(i, stop_hostile, True))
                    for i in range(cfg.engine_hostile)]
        admin = asyncio.create_task(self.admin_chaos(stop_admin, lock))
        bad = asyncio.create_task(self.bad_inputs(rate, lambda: not well_done.is_set(),
                                                  lambda: well_done.is_set() and tally.sent >= requests))
        answers, wall = await self.load(phase, n, counted)
        well_done.set()
        stop_hostile.set()
        await asyncio.gather(*hostile, *killer)
        stop_admin.set()
        await admin
        await bad
        async with lock:
            await self.send("DELETE", "/admin/policy/pin")
        if "next_id" in self.retunes:
            self.retunes["next"] = await self.retune_done(self.retunes.pop("next_id"), 600)
        return answers, wall


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def phase_summary(answers: list[Answer], wall: float) -> dict[str, Any]:
    ttft = [a.ttft_s * 1000 for a in answers if a.ttft_s is not None]
    latency = [a.latency_s * 1000 for a in answers]
    tokens = sum(a.tokens for a in answers)
    return {"requests": len(answers), "errors": sum(a.error is not None for a in answers),
            "wall_s": round(wall, 2), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 2),
            "ttft_ms": {"p50": _r(percentile(ttft, 50)), "p99": _r(percentile(ttft, 99)), "n": len(ttft)},
            "latency_ms": {"p50": _r(percentile(latency, 50)), "p99": _r(percentile(latency, 99))},
            "statuses": dict(Counter(str(a.status) for a in answers))}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)
