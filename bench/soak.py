"""`crossover bench soak`: a daemon under well-formed and hostile traffic, then an audit.

1. Start `crossover serve` as a child process on a free loopback port with its defaults
   (the real model unless `--fake`), a fresh SQLite telemetry database, an admin token and
   API keys required (`--no-open`), plus `--serve-arg`s; wait until /ready says every
   technique is ready. Two tenants: `soak-clients` (the well-formed load) and
   `soak-hostile` (max 4 concurrent, 2 queued: its clients' requests that reach the engine).
2. Rehearsal: step 3 in small (twice `--concurrency` well-formed requests), so that what
   the daemon makes once and keeps (pooled database connections, a replaced search
   process, allocator arenas) is part of the level measured next. Its problems count.
   Baseline: the well-formed load alone: `--well-formed` requests (bench.workloads
   prompts, three in four streamed, greedy or seeded) from `--concurrency` clients, the
   prefix cache emptied first. Then, idle, the daemon's RSS, open descriptors and OS
   threads: the level the soak must return to.
3. Soak: the same load again (prefix cache emptied) beside `--hostile` connection-level
   hostile connections held at once (slowloris headers, idle sockets, stalled bodies) and
   `--engine-hostile` clients whose requests reach the engine (streams nobody reads, slow
   readers, hang-ups mid-stream and before the answer), every bad input of
   `bench.soak_clients.bad_cases` in turn, paced to spread `--requests` over the time the
   baseline took (a wrong admin token at most every 10 s, under the guess throttle), and an admin pinning valid policies and unpinning; once, a retune
   whose search process is killed (SIGKILL) as it starts, then a retune that must end
   normally. When the well-formed load is done the hostile clients stop and bad inputs
   continue until `--requests` requests were sent in all.
4. Audit, once the daemon is idle: /health 200 with no engine restart; no request in
   flight; every KV page back (used 0, free = total); every worker thread up; one
   telemetry row per request the engine finished (xo_requests = /metrics' requests, each
   well-formed request's id once) and none dropped; RSS and descriptors within
   `--tolerance` of the baseline level; no 5xx answered to anyone; every bad input its
   documented 4xx with an OpenAI error object; the well-formed TTFT p99 within
   `--ttft-ratio` of the baseline's; no traceback in the daemon's log. Then SIGTERM:
   the daemon must exit 0.
5. JSON: each check (`passed` and what it measured), both phases' latencies, the hostile
   and bad-input tallies; `ok` when every check passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak_clients import (
    ENGINE_HOSTILE,
    HOSTILE,
    Answer,
    BadCase,
    Hostile,
    bad_cases,
    error_of,
    raw_request,
    request_body,
    well_formed,
    wrong_admin,
)
from bench.workloads import mixed

Note = Callable[[str], None]


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    """HTTP requests the soak phase sends in all (well-formed, hostile, bad, admin)."""
    well_formed: int = 400
    concurrency: int = 8
    hostile: int = 56
    engine_hostile: int = 4
    max_tokens: int = 24
    seed: int = 0
    fake: bool = False
    serve_args: tuple[str, ...] = ()
    tolerance: float = 0.05
    ttft_ratio: float = 3.0
    ready_timeout_s: float = 1800.0
    work_dir: str | None = None

    def check(self) -> None:
        for name, low in (("requests", 1), ("well_formed", 1), ("concurrency", 1), ("hostile", 0),
                          ("engine_hostile", 0), ("max_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if not 0 < self.tolerance < 1 or not self.ttft_ratio > 0:
            raise ValueError("--tolerance must be in (0, 1) and --ttft-ratio positive")


# ---- the daemon ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`crossover serve` as a child process, and what /proc says about it."""

    def __init__(self, work: Path, cfg: SoakConfig) -> None:
        self.port, self.token = free_port(), secrets.token_urlsafe(24)
        self.db_path, self.log_path = work / "soak.db", work / "daemon.log"
        token_file = work / "admin-token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        fake = ["--fake-engine", "--fake-step-ms", "5", "--fake-speculation"] if cfg.fake else []
        self.argv = [sys.executable, "-m", "cli.main", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--db", f"sqlite:///{self.db_path}",
                     "--admin-token-file", str(token_file), "--no-open", *fake, *cfg.serve_args]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin = {"Authorization": f"Bearer {self.token}"}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_bytes(self) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def fd_kinds(self) -> dict[str, int]:
        """Open descriptors by what they are: socket, pipe, anon_inode, or the file's path."""
        kinds: Counter = Counter()
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{self.proc.pid}/fd/{fd}")
            except OSError:
                continue
            kinds[target.split(":")[0] if target.split(":")[0] in ("socket", "pipe", "anon_inode") else target] += 1
        return dict(kinds)

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def children(self) -> list[tuple[int, str]]:
        """(pid, command line) of the daemon's child processes."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                out.append((int(entry), cmd))
        return out

    def stop(self, timeout_s: float = 120.0) -> tuple[int | None, float]:
        """SIGTERM; (exit code or None when it had to be killed, seconds to exit)."""
        start = time.monotonic()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        self._log.close()
        return code, time.monotonic() - start


# ---- the run ------------------------------------------------------------------------------

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
            techniques = (body or {}).get("engine", {}).get("techniques", {}) if isinstance(body, dict) else {}
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
                answer = await well_formed(self.session, self.d.base, path, body, key)  # type: ignore[arg-type]
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
                    out = await rng.choice(ENGINE_HOSTILE)(self.d.port, key, rng, self.model, self.cfg.max_tokens,
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
        cases = bad_cases(self.model, self.keys["soak-clients"], self.d.token, self.settings.max_context or 4096,
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
                    pin = {"rules": [{"max_batch": rng.choice([1, 2, 4]), "technique": "ngram", "depth": depth},
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

    async def retune_done(self, retune_id: int, timeout_s: float, searched_only: bool = False) -> dict[str, Any]:
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
            (p for p, cmd in self.d.children() if "multiprocessing" in cmd and "resource_tracker" not in cmd), None)

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

    async def under_attack(self, phase: str, n: int, requests: int, rate: float) -> tuple[list[Answer], float]:
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
        hostile += [asyncio.create_task(self.hostile_slot(i, stop_hostile, True)) for i in range(cfg.engine_hostile)]
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


# ---- the audit ----------------------------------------------------------------------------

def scrape(text: str) -> dict[str, float]:
    """Each sample name of a /metrics page with its values summed over the labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def request_rows(db_path: Path) -> list[str]:
    """The request ids of the telemetry database's xo_requests rows."""
    from sqlalchemy import create_engine, select

    from store.models import Request as RequestRow

    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with engine.connect() as conn:
            return [row[0] for row in conn.execute(select(RequestRow.request_id))]
    finally:
        engine.dispose()


def within(before: int, after: int, tolerance: float) -> bool:
    return abs(after - before) <= tolerance * before


async def audit(soak: Soak, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The checks of the module docstring's step 4, each with `passed`."""
    cfg, tally, d = soak.cfg, soak.tally, soak.d
    checks: dict[str, dict[str, Any]] = {}
    status = await soak.idle()
    code, health = await soak.get("/health", admin=False)
    checks["health"] = {"passed": code == 200 and health == {"status": "ok", "engine_restarts": 0},
                        "status": code, "answer": health}
    queue, pool = status["queue"], status["pool"]
    checks["nothing_in_flight"] = {"passed": not any(queue.values()), **queue}
    checks["kv_pages_back"] = {"passed": pool["pages_used"] == 0 and pool["pages_free"] == pool["pages_total"],
                               **pool}
    _, metrics_text = await soak.get("/metrics")
    metrics = scrape(metrics_text)
    up = {k: v for k, v in status["threads"].items() if v is not None}
    checks["threads_up"] = {"passed": bool(up) and all(up.values()) and metrics.get("crossover_thread_up") == len(up),
                            **status["threads"]}
    finished = int(metrics.get("crossover_requests_total", -1))
    end, rows = time.monotonic() + 60, request_rows(d.db_path)
    while len(rows) < finished and time.monotonic() < end:
        await asyncio.sleep(1.0)
        rows = request_rows(d.db_path)
    answered = [a.request_id for phase in result["answers"] for a in phase if a.status == 200]
    missing = [rid for rid in answered if rid not in set(rows)]
    dropped = (status.get("recorder") or {}).get("dropped")
    checks["telemetry_rows"] = {
        "passed": len(rows) == len(set(rows)) == finished and not missing and dropped == 0,
        "rows": len(rows), "distinct": len(set(rows)), "engine_finished": finished,
        "well_formed_ids_missing": len(missing), "recorder_dropped": dropped}
    after = await soak.level()
    before = result["level_before"]
    checks["rss_back"] = {"passed": within(before["rss_bytes"], after["rss_bytes"], cfg.tolerance),
                          "before": before["rss_bytes"], "after": after["rss_bytes"],
                          "change": round(after["rss_bytes"] / before["rss_bytes"] - 1, 4)}
    checks["fds_back"] = {"passed": within(before["fds"], after["fds"], cfg.tolerance),
                          "before": before["fds"], "after": after["fds"]}
    result["level_after"] = after
    errors = [f"well-formed {a.status}: {a.error}" for phase in result["answers"] for a in phase if a.error]
    checks["well_formed_served"] = {"passed": not errors, "errors": errors[:20]}
    checks["no_5xx_and_each_bad_input_refused"] = {
        "passed": not tally.problems and not any(s.startswith("5") for s in tally.statuses),
        "problems": tally.problems[:40], "statuses": dict(tally.statuses)}
    p99 = (result["baseline"]["ttft_ms"]["p99"], result["soak"]["ttft_ms"]["p99"])
    ratio = None if None in p99 or not p99[0] else round(p99[1] / p99[0], 3)
    checks["ttft_p99_ratio"] = {"passed": ratio is not None and ratio <= cfg.ttft_ratio, "ratio": ratio,
                                "baseline_ms": p99[0], "soak_ms": p99[1], "limit": cfg.ttft_ratio}
    total = cfg.hostile + cfg.engine_hostile
    checks["load"] = {"passed": tally.sent >= cfg.requests and tally.hostile_peak >= total,
                      "requests": tally.sent, "hostile_connections": sum(tally.hostile.values()),
                      "hostile_peak_at_once": tally.hostile_peak, "bad_inputs": sum(tally.bad.values())}
    killed, nxt = soak.retunes.get("killed") or {}, soak.retunes.get("next") or {}
    # killed while it searched, the retune fails (SearchCrashed); killed just after its search
    # ended, the retune ends normally and the dead process is replaced before the next search
    crashed = killed.get("status") == "failed" and "search process died" in (killed.get("error") or "")
    ended = ("applied", "rejected", "skipped")
    checks["search_process_killed"] = {
        "passed": (crashed or killed.get("status") in ended) and nxt.get("status") in ended,
        "killed_pid": soak.retunes.get("killed_pid"), "search_crashed": crashed, "killed_retune": _brief(killed), "next_retune": _brief(nxt)}
    return checks


def _brief(view: dict[str, Any]) -> dict[str, Any]:
    return {k: view.get(k) for k in ("id", "status", "phase", "error") if k in view}


def log_findings(log_path: Path) -> dict[str, Any]:
    """Tracebacks and the warning and error lines (by their JSON `level`) of the daemon's log."""
    text = log_path.read_text(errors="replace")
    levels: Counter = Counter()
    firsts: dict[str, list[str]] = {"warning": [], "error": []}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            levels["not_json"] += 1
            continue
        level = str(record.get("level", "")).lower() if isinstance(record, dict) else ""
        levels[level] += 1
        if level in ("warning", "error", "critical"):
            said = firsts.setdefault(level, [])
            if len(said) < 10 and record.get("msg") not in said:
                said.append(record.get("msg"))
    return {"lines": sum(levels.values()), "tracebacks": text.count("Traceback (most recent call last)"),
            "levels": dict(levels), "messages": firsts}


def run_soak(cfg: SoakConfig, out: str | None, note: Note | None = None) -> dict[str, Any]:
    """Run the soak (module docstring); print and write its JSON; return it."""
    from bench import print_and_write

    cfg.check()
    note = note or (lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="crossover-soak-", dir=cfg.work_dir) as tmp:
        work = Path(tmp)
        daemon = Daemon(work, cfg)
        note(f"soak: started {' '.join(daemon.argv[2:])} (pid {daemon.proc.pid}); log {daemon.log_path}")
        soak = Soak(cfg, daemon, note)
        started = time.monotonic()

        def interrupted(signum: int, frame: Any) -> None:  # SIGTERM: stop the daemon on the way out
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, interrupted)
        try:
            result = asyncio.run(_run_and_audit(soak))
        finally:
            code, stop_s = daemon.stop()
            signal.signal(signal.SIGTERM, previous)
        checks = result.pop("checks")
        checks["clean_exit"] = {"passed": code == 0, "exit_code": code, "seconds": round(stop_s, 1)}
        logs = log_findings(daemon.log_path)
        if out:  # the daemon's log beside the JSON, for whoever reads a failed check
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            logs["copy"] = str(Path(out).with_suffix(".daemon.log"))
            shutil.copyfile(daemon.log_path, logs["copy"])
        checks["no_traceback_in_log"] = {"passed": logs["tracebacks"] == 0, **logs}
        result.pop("answers")
        tally = soak.tally
        summary = {
            "bench": "soak", "ok": all(c["passed"] for c in checks.values()),
            "config": dataclasses.asdict(cfg), "daemon_argv": daemon.argv[3:], "wall_s": round(time.monotonic() - started, 1),
            "checks": checks, **result,
            "hostile": dict(tally.hostile), "bad_inputs": dict(tally.bad), "admin": dict(tally.admin),
            "retunes": {k: _brief(v) if isinstance(v, dict) else v for k, v in soak.retunes.items()},
        }
        failed = [name for name, c in checks.items() if not c["passed"]]
        note(f"soak: {'every check passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
        return print_and_write(summary, out)


async def _run_and_audit(soak: Soak) -> dict[str, Any]:
    result = await soak.run()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        soak.session = session  # force_close: no connection of the audit's stays open for the level
        result["checks"] = await audit(soak, result)
    return result
