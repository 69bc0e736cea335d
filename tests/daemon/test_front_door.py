"""HAProxy in front of three `crossover serve` replicas: a rolling restart under traffic loses nothing.

The HAProxy configuration is the one docs/scale-out.md gives a user, read from
that file, with only its ports and its stats socket moved to this test's.
Three fake-engine daemons serve behind it while a load thread sends steady
completions (half of them streamed) through HAProxy; each replica in turn is
sent SIGTERM while a long stream of its own is in flight, is started again
with a slow warmup, and is waited for until HAProxy has it UP. Checked: every
request through HAProxy was answered 200 with its own complete text; a
draining replica answers /ready 503 and HAProxy takes it out of rotation
while it still listens; a warming replica gets no request before it is
ready, and gets traffic after.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.daemon.helpers import (
    MODEL,
    REPO,
    SERVE,
    daemon_env,
    free_port,
    http_request,
    parse_sse,
    stop_process,
)

DOC = REPO / "docs" / "scale-out.md"
HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="HAProxy is not installed (`apt-get install haproxy`; .ci/run installs it)")

WARMUP_S = 2.0
"""--fake-warmup-s of a restarted replica: long enough for several health checks to fail."""
WORKERS = 6
"""Concurrent clients of the load thread."""
PIN_HEADER = "x-test-replica"
"""Names the replica HAProxy must send a request to (a rule this test adds to the doc's config)."""
LONG_TOKENS = 400
"""The pinned stream's length: 2 s of fake steps at least, in flight across SIGTERM."""


def _until(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


@dataclass
class Replica:
    """One `crossover serve --fake-engine` process on a fixed port (a restart keeps the port)."""

    name: str
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    """One log file per start, oldest first."""

    def start(self, warmup_s: float = 0.0) -> None:
        log_path = self.workdir / f"{self.name}-{len(self.logs)}.log"
        self.logs.append(log_path)
        cmd = [*SERVE, "--fake-engine", "--fake-step-ms", "5",
               "--fake-warmup-s", str(warmup_s), "--port", str(self.port), "--open",
               "--db", f"sqlite:///{self.workdir / (self.name + '.db')}"]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=daemon_env(), stdout=log,
                                         stderr=subprocess.STDOUT)

    def listening(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.logs[-1].read_text()
        return any(line.get("msg") == "listening" for line in _json_lines(self.logs[-1]))

    def ready(self) -> tuple[int, str]:
        r = http_request(self.port, "GET", "/ready")
        return r.status, r.json()["status"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class HAProxy:
    """HAProxy run in the foreground on docs/scale-out.md's configuration, moved to this test's ports."""

    def __init__(self, workdir: Path, front_port: int, replicas: list[Replica]) -> None:
        self.socket_path = workdir / "haproxy.sock"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(_config_from_doc(front_port, replicas, self.socket_path))
        self.log = workdir / "haproxy.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([str(HAPROXY), "-db", "-f", str(self.config)],
                                         stdout=log, stderr=subprocess.STDOUT)

    def servers(self) -> dict[str, dict[str, str]]:
        """`show stat` of the backend's servers: name -> column -> value."""
        assert self.proc.poll() is None, self.log.read_text()
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.socket_path))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        lines = data.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        return {r["svname"]: r for r in rows if r["pxname"] == "replicas" and r["svname"] != "BACKEND"}

    def status(self, name: str) -> str:
        return self.servers()[name]["status"]

    def close(self) -> None:
        stop_process(self.proc, 10)


def _config_from_doc(front_port: int, replicas: list[Replica], socket_path: Path) -> str:
    """The ```haproxy block of docs/scale-out.md with its listen port, stats socket and servers
    moved; each substitution must match exactly once, so the doc and the test cannot drift apart."""
    blocks = re.findall(r"```haproxy\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 1, "docs/scale-out.md must hold one ```haproxy block"
    text = blocks[0]
    moves = [(r"bind \*:8000\b", f"bind 127.0.0.1:{front_port}"),
             (r"stats socket /run/haproxy/admin\.sock", f"stats socket {socket_path}"),
             *((rf"\n *{key} [^\n]*", "") for key in ("user", "group", "chroot"))]  # runs unprivileged
    moves += [(rf"server {r.name} 127\.0\.0\.1:800{i + 1}\b", f"server {r.name} 127.0.0.1:{r.port}")
              for i, r in enumerate(replicas)]
    for pattern, new in moves:
        text, n = re.subn(pattern, new, text)
        assert n == 1, f"docs/scale-out.md's haproxy block: {pattern!r} matched {n} times"
    # test only: a request with this header goes to the named server (while it is up)
    assert text.rstrip().splitlines()[-1].lstrip().startswith("server "), "the backend must end the block"
    return text + "".join(f"    use-server {r.name} if {{ req.hdr({PIN_HEADER}) -m str {r.name} }}\n"
                          for r in replicas)


@dataclass
class Load:
    """Steady completions through HAProxy from a thread of its own until `stop` is set."""

    port: int
    stop: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    answered: int = 0
    streamed: int = 0
    failures: list[str] = field(default_factory=list)

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._worker(session, w) for w in range(WORKERS)))

    async def _worker(self, session: aiohttp.ClientSession, worker: int) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = f"w{worker}-req{i:05d}-" + "abcdefgh" * 2  # the fake engine answers it reversed
            stream = i % 2 == 1
            i += 1
            self.sent += 1
            try:
                problem = await self._one(session, prompt, stream)
            except (TimeoutError, aiohttp.ClientError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                self.answered += 1
                self.streamed += stream
            else:
                self.failures.append(f"{prompt} stream={stream}: {problem}")

    async def _one(self, session: aiohttp.ClientSession, prompt: str, stream: bool) -> str | None:
        """None when the answer is 200 and complete: the reversed prompt, then EOS ("stop")."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "stream": stream}
        async with session.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body) as r:
            raw = await r.read()
        if r.status != 200:
            return f"status {r.status}: {raw[:200]!r}"
        if stream:
            events = parse_sse(raw)
            if events[-1] != "[DONE]":
                return f"no [DONE]: {events[-2:]}"
            text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")][-1]
        else:
            choice = json.loads(raw)["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        if text != prompt[::-1] or finish != "stop":
            return f"wrong answer {text!r} ({finish})"
        return None


async def _open_long_stream(front_port: int, replica: str) -> tuple[aiohttp.ClientSession,
                                                                    aiohttp.ClientResponse, bytes]:
    """A long stream through HAProxy, pinned to `replica`, its first event read."""
    session = aiohttp.ClientSession()
    body = {"model": MODEL, "prompt": "z" * LONG_TOKENS, "max_tokens": LONG_TOKENS, "stream": True}
    response = await session.post(f"http://127.0.0.1:{front_port}/v1/completions", json=body,
                                  headers={PIN_HEADER: replica})
    assert response.status == 200
    head = await response.content.readline() + await response.content.readline()
    assert head.startswith(b"data: ") and head.endswith(b"\n\n")
    return session, response, head


def _restart(replica: Replica, haproxy: HAProxy, front_port: int) -> dict[str, Any]:
    """SIGTERM `replica` with a long stream through HAProxy in flight on it, start it again with a
    slow warmup, wait until HAProxy has it UP. What was seen on the way."""
    assert replica.proc is not None
    loop = asyncio.new_event_loop()
    try:
        session, response, head = loop.run_until_complete(_open_long_stream(front_port, replica.name))
        replica.proc.send_signal(signal.SIGTERM)
        _until(lambda: replica.ready() == (503, "draining"), 5, f"{replica.name}'s /ready to say draining")
        _until(lambda: haproxy.status(replica.name).startswith("DOWN"), 10,
               f"HAProxy to take {replica.name} out of rotation")
        still_listening = replica.proc.poll() is None  # marked down before the port closed
        rest = loop.run_until_complete(response.read())
        loop.run_until_complete(session.close())
    finally:
        loop.close()
    events = parse_sse(head + rest)  # it ran to its end while HAProxy had the replica down
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "z" * LONG_TOKENS
    assert replica.proc.wait(timeout=20) == 0
    replica.start(warmup_s=WARMUP_S)
    _until(replica.listening, 60, f"{replica.name} to listen again")
    warming = replica.ready()
    status_while_warming = haproxy.status(replica.name)
    _until(lambda: haproxy.status(replica.name) == "UP", 60, f"HAProxy to put {replica.name} back")
    return {"still_listening": still_listening, "warming": warming,
            "haproxy_while_warming": status_while_warming}


def _requests_before_ready(log_path: Path) -> tuple[int, Counter[int]]:
    """(requests logged before the "ready" line, status counts of all requests) of one daemon log."""
    before, statuses, ready = 0, Counter[int](), False
    for line in _json_lines(log_path):
        if line.get("msg") == "ready":
            ready = True
        elif line.get("msg") == "request":
            statuses[line["status"]] += 1
            before += not ready
    return before, statuses


def test_rolling_restart_behind_haproxy_loses_no_request(tmp_path: Path) -> None:
    replicas = [Replica(f"r{i + 1}", free_port(), tmp_path) for i in range(3)]
    front = free_port()
    haproxy: HAProxy | None = None
    load = Load(front)
    thread = threading.Thread(target=load.run, daemon=True)
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            _until(r.listening, 60, f"{r.name} to listen")
            _until(lambda r=r: r.ready()[0] == 200, 30, f"{r.name} to be ready")
        haproxy = HAProxy(tmp_path, front, replicas)
        _until(lambda: haproxy is not None and haproxy.socket_path.exists(), 10, "HAProxy's stats socket")
        _until(lambda: all(s["status"] == "UP" for s in haproxy.servers().values()), 10, "three servers UP")
        assert http_request(front, "GET", "/v1/models").status == 200
        thread.start()
        time.sleep(1.0)
        seen = [_restart(r, haproxy, front) for r in replicas]
        time.sleep(1.5)  # the last one gets traffic again
    finally:
        load.stop.set()
        if thread.ident is not None:
            thread.join(60)
        stats: dict[str, dict[str, str]] = {}
        if haproxy is not None:
            try:
                stats = haproxy.servers()
            except (OSError, AssertionError):  # it did not start; the error above is the one to see
                pass
            haproxy.close()
        for r in replicas:
            r.stop()

    assert not load.failures, f"{len(load.failures)} of {load.sent} failed, e.g. {load.failures[:5]}"
    assert load.answered == load.sent and load.sent > 100 and load.streamed > 50
    for r, s in zip(replicas, seen, strict=True):
        assert s["still_listening"], f"{r.name} closed its port before HAProxy marked it down"
        assert s["warming"] == (503, "starting") and s["haproxy_while_warming"].startswith("DOWN")
        drained = [line for line in _json_lines(r.logs[0]) if line.get("msg") == "request"
                   and line.get("completion_tokens") == LONG_TOKENS]
        assert [line["status"] for line in drained] == [200], f"{r.name} did not serve the long stream"
        before_ready, statuses = _requests_before_ready(r.logs[-1])
        assert before_ready == 0 and set(statuses) == {200}, (r.name, before_ready, statuses)
        assert statuses[200] > 0, f"{r.name} got no traffic after its restart"
    per_server = {name: int(row["stot"]) for name, row in stats.items()}
    retried = sum(int(row["wretr"]) + int(row["wredis"]) for row in stats.values())
    refused = sum(_requests_before_ready(r.logs[0])[1][503] for r in replicas)
    print(f"\nfront door: {load.sent} requests sent, {load.answered} answered 200 "
          f"({load.streamed} streamed); HAProxy sessions per server {per_server}, "
          f"retries+redispatches {retried}; 503s from draining replicas, resent by HAProxy: {refused}")
