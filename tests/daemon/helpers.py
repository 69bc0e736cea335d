"""Test helpers: a real daemon on 127.0.0.1 (ephemeral port) over FakeEngine, raw HTTP, SSE.

`LiveServer(db_url=...)` gives the daemon a real telemetry database (created
when empty) whose recorder flushes every 50 ms.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web

from daemon.app import make_app
from daemon.connections import make_runner
from daemon.database import Database, open_database
from daemon.settings import Settings
from daemon.state import ENGINE_THREAD, STATE
from engine.fake import FakeEngine
from telemetry.recorder import RecorderConfig
from tests.daemon.memory_sink import MemorySink

MODEL = "fake-reverse"
REPO = Path(__file__).resolve().parents[2]
SERVE = [sys.executable, "-m", "cli.main", "serve"]
"""`crossover serve` as a subprocess command (run with cwd=REPO)."""
REAL_ENGINE = {"max_batch": 2, "max_context": 1024, "kv_budget_bytes": 64 << 20}
"""The real model's engine in test_real_model.py and in each daemon of test_replicas_real.py
(the default weights, no speculation): one set of shapes, so the daemons load from the persistent
compilation cache what the earlier test compiled instead of compiling it again."""


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM `proc` (unless it has exited), wait up to `timeout_s`, then SIGKILL it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def daemon_env(**extra: str) -> dict[str, str]:
    """This process's environment without CROSSOVER_* settings, plus `extra`: a spawned daemon
    is configured by its flags alone."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("CROSSOVER_")}, **extra}


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """`make_app(settings, engine)` served from a background thread's event loop."""

    def __init__(self, engine: FakeEngine | None = None, db_url: str | None = None,
                 **settings: Any) -> None:
        self.engine = engine or FakeEngine()
        settings.setdefault("max_batch", self.engine.max_batch)
        settings.setdefault("max_context", self.engine.max_context)
        self.settings = Settings(port=0, **settings)
        self.sink = MemorySink()
        self.database: Database | None = None
        if db_url is not None:
            config = RecorderConfig(flush_interval_s=0.05)
            self.database = open_database(db_url, recorder_config=config,
                                          instance=self.settings.instance or "")
        self.app = make_app(self.settings, self.engine, self.sink, database=self.database)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True) -> LiveServer:
        self._thread.start()
        self.port = self.call(self._start())
        if wait_ready:
            wait_for(lambda: self.app[ENGINE_THREAD].ready, what="engine ready")
        return self

    async def _start(self) -> int:
        self.runner = make_runner(self.app, self.settings, 2.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(self.runner.addresses[0][1])

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run `coro` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is in flight and the engine holds no pages (either engine: the
        fake counts its pages, the real one's pool does)."""
        engine = self.engine
        used = (lambda: engine.pages_used) if isinstance(engine, FakeEngine) else (lambda: engine.pool.used)
        wait_for(lambda: (self.app[STATE].in_flight == 0 and self.app[ENGINE_THREAD].active == 0
                          and used() == 0 and not engine.has_work()),
                 timeout, "server idle")

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Response:
        return http_request(self.port, "POST", path, body, headers)

    def get(self, path: str, headers: dict[str, str] | None = None) -> Response:
        return http_request(self.port, "GET", path, None, headers)

    def delete(self, path: str, headers: dict[str, str] | None = None) -> Response:
        return http_request(self.port, "DELETE", path, None, headers)


class Response:
    def __init__(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.status, self.headers, self.data = status, headers, data

    def json(self) -> Any:
        return json.loads(self.data)


def http_request(port: int, method: str, path: str, body: Any = None,
                 headers: dict[str, str] | None = None) -> Response:
    """One request over a fresh connection; `body` is bytes or JSON-able."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                       **(headers or {})})
        resp = conn.getresponse()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response's head and body (by its Content-Length)."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def parse_sse(data: bytes) -> list[Any]:
    """The JSON payloads of an SSE body, "[DONE]" kept as the string; asserts framing."""
    text = data.decode("utf-8")
    assert text.endswith("\n\n"), "stream does not end with a blank line"
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


RCVBUF = 4096
"""Socket buffer of the stalled-reader tests: small, so a client that stops reading backs up
the daemon's writes after a few kilobytes."""


class SmallBufferServer(LiveServer):
    """A LiveServer whose connections get a small kernel send buffer (inherited from the
    listening socket), so a write waits after ~100 KB instead of the megabytes that Linux's
    autotuned buffers take."""

    async def _start(self) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RCVBUF)
        listener.bind(("127.0.0.1", 0))
        self.runner = make_runner(self.app, self.settings, 2.0)
        await self.runner.setup()
        await web.SockSite(self.runner, listener).start()
        return int(listener.getsockname()[1])
