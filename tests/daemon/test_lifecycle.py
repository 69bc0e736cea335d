"""Health, readiness, draining, and SIGTERM on a real `crossover serve` process."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from daemon.app import drain
from daemon.state import ENGINE_THREAD, STATE
from engine.fake import FakeEngine
from engine.types import StepOutput
from tests.daemon.helpers import (
    MODEL,
    REPO,
    SERVE,
    LiveServer,
    daemon_env,
    http_request,
    parse_sse,
    read_response,
    stop_process,
    wait_for,
)

SLOW_BODY = {"model": MODEL, "prompt": "s" * 40, "max_tokens": 40, "stream": True}


def test_health_and_ready_follow_warmup() -> None:
    server = LiveServer(FakeEngine(warmup_delay_s=0.6)).start(wait_ready=False)
    try:
        assert server.get("/health").status == 200
        assert server.get("/ready").status == 503
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "a"})
        assert r.status == 503 and r.json()["error"]["code"] == "warming_up"
        assert "retry-after" in r.headers
        wait_for(lambda: server.get("/ready").status == 200, what="ready")
        assert server.get("/ready").json()["engine"]["kv_pages_total"] == 4096
        assert server.post("/v1/completions", {"model": MODEL, "prompt": "a"}).status == 200
    finally:
        server.close()


class BrokenEngine(FakeEngine):
    def step(self) -> StepOutput:
        if self.has_work():
            raise RuntimeError("boom")
        return super().step()


def test_engine_failure_turns_health_red(live: Callable[..., LiveServer]) -> None:
    server = live(BrokenEngine(), engine_max_restarts=0)  # no restart: the first fault is final
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "a"})
    assert r.status == 500 and r.json()["error"]["code"] == "engine_error"
    assert server.get("/health").status == 503
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "a"})
    assert r.status == 503 and r.json()["error"]["code"] == "engine_failed"


class OpenStream:
    """A streamed completion whose first event has been read."""

    def __init__(self, response: aiohttp.ClientResponse, head: bytes) -> None:
        self.response, self.head = response, head

    async def read(self) -> bytes:
        return self.head + await self.response.read()


async def _open_streams(url: str, n: int) -> tuple[aiohttp.ClientSession, list[OpenStream]]:
    session = aiohttp.ClientSession()
    streams = []
    for _ in range(n):
        response = await session.post(url + "/v1/completions", json=SLOW_BODY)
        assert response.status == 200
        head = await response.content.readline() + await response.content.readline()
        assert head.startswith(b"data: ") and head.endswith(b"\n\n")  # the first token is out
        streams.append(OpenStream(response, head))
    return session, streams


def test_a_request_still_reading_its_body_does_not_hold_the_drain(live: Callable[..., LiveServer]) -> None:
    """A client stalling its body is not admitted yet: the drain answers it 503 shutting_down at
    once instead of waiting out the body deadline (30 s)."""
    import json
    import socket
    import time

    server = live()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 200\r\n\r\n{\"model\": ")
    wait_for(lambda: server.app[STATE].in_flight == 1, what="the request in its handler")
    start = time.monotonic()
    assert asyncio.run_coroutine_threadsafe(drain(server.app, 20.0), server.loop).result(25) is True
    assert time.monotonic() - start < 5
    head, body = read_response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "shutting_down"


def test_drain_past_deadline_aborts_streams_cleanly(live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=0.05))

    async def main() -> list[list[Any]]:
        session, streams = await _open_streams(server.url, 2)
        future = asyncio.run_coroutine_threadsafe(drain(server.app, 0.2), server.loop)
        await asyncio.sleep(0.05)
        async with session.post(server.url + "/v1/completions", json=SLOW_BODY) as late:
            assert late.status == 503
            assert (await late.json())["error"]["code"] == "shutting_down"
        async with session.get(server.url + "/ready") as ready:
            assert ready.status == 503
        bodies = [parse_sse(await s.read()) for s in streams]
        assert future.result(5) is False  # it had to abort
        await session.close()
        return bodies

    for events in asyncio.run(main()):
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "aborted"
    wait_for(lambda: len(server.sink.results) == 2)
    assert {r.finish_reason for r in server.sink.results} == {"abort"}
    assert server.engine.pages_used == 0


def _start_daemon(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    log_path = tmp_path / "serve.log"
    db = f"sqlite:///{tmp_path / 'telemetry.db'}"
    cmd = [*SERVE, "--fake-engine", "--port", "0", "--db", db, *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=daemon_env(), stdout=log, stderr=subprocess.STDOUT)
    port = 0

    def listening() -> bool:
        nonlocal port
        assert proc.poll() is None, log_path.read_text()
        for line in _json_lines(log_path):
            if line.get("msg") == "listening":
                port = line["port"]
        return port > 0

    wait_for(listening, 60, "the daemon to listen")  # a ceiling for loaded CI machines
    wait_for(lambda: http_request(port, "GET", "/ready").status == 200, 30, "ready")
    return proc, port, log_path


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _sigterm_then_probe(proc: subprocess.Popen[bytes], port: int, n: int) -> list[bytes]:
    """Open n slow streams, SIGTERM, check a new request gets 503, return the stream bodies."""

    async def main() -> list[bytes]:
        session, streams = await _open_streams(f"http://127.0.0.1:{port}", n)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=SLOW_BODY) as late:
            assert late.status == 503
        bodies = [await s.read() for s in streams]
        await session.close()
        return bodies

    return asyncio.run(main())


def _serve_then_sigterm(tmp_path: Path, n: int, within_s: float, *flags: str) -> tuple[list[bytes], Path]:
    """Start `crossover serve --fake-engine` with `flags`, open n slow streams, SIGTERM it and probe
    once more (_sigterm_then_probe); require exit status 0 within `within_s` of the signal (a
    ceiling against a hang: the stream bodies show whether the drain finished or was cut). The
    stream bodies and the log file; the process is killed if anything fails on the way."""
    proc, port, log_path = _start_daemon(tmp_path, *flags)
    try:
        signalled = time.monotonic()
        bodies = _sigterm_then_probe(proc, port, n)
        assert proc.wait(timeout=within_s) == 0
        assert time.monotonic() - signalled < within_s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return bodies, log_path


def test_sigterm_lets_in_flight_streams_finish_and_exits_zero(tmp_path: Path) -> None:
    bodies, log_path = _serve_then_sigterm(tmp_path, 3, 30, "--fake-step-ms", "20", "--drain-deadline", "10")
    for body in bodies:
        events = parse_sse(body)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == "s" * 40 and events[-2]["choices"][0]["finish_reason"] == "length"
    msgs = [line.get("msg") for line in _json_lines(log_path)]
    assert "draining" in msgs and "telemetry recorder closed" in msgs and msgs[-1] == "stopped"
    statuses = [line["status"] for line in _json_lines(log_path) if line.get("msg") == "request"]
    assert statuses.count(200) == 3 and statuses.count(503) == 1
    con = sqlite3.connect(tmp_path / "telemetry.db")  # written at shutdown at the latest
    rows = con.execute("SELECT finish_reason, output_tokens FROM xo_requests").fetchall()
    n_steps = con.execute("SELECT COUNT(*) FROM xo_steps").fetchone()[0]
    con.close()
    assert rows == [("length", 40)] * 3 and n_steps >= 40


def test_serve_refuses_an_old_schema_and_names_the_upgrade(tmp_path: Path, rev1_url: str) -> None:
    cmd = [*SERVE, "--fake-engine", "--port", "0", "--db", rev1_url]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=daemon_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "0001" in proc.stderr and f"crossover db upgrade --db {rev1_url}" in proc.stderr
    assert "listening" not in proc.stderr
    con = sqlite3.connect(rev1_url.removeprefix("sqlite:///"))
    assert con.execute("SELECT version_num FROM xo_alembic_version").fetchall() == [("0001",)]
    con.close()


def test_sigterm_past_the_deadline_aborts_and_still_exits_zero(tmp_path: Path) -> None:
    bodies, _ = _serve_then_sigterm(tmp_path, 2, 30, "--fake-step-ms", "200", "--drain-deadline", "0.3")
    for body in bodies:
        events = parse_sse(body)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "aborted"


def test_engine_thread_exposed_on_app(live: Callable[..., LiveServer]) -> None:
    server = live()
    thread = server.app[ENGINE_THREAD]
    assert thread.ready and thread.active == 0 and thread.engine is server.engine


def _serve_once(tmp_path: Path, *flags: str, env: dict[str, str] | None = None,
                preload: str = "") -> subprocess.CompletedProcess[str]:
    """Run `crossover serve` (with `preload` Python run first in the process) until it exits."""
    db = f"sqlite:///{tmp_path / 'telemetry.db'}"
    code = f"import sys\n{preload}\nfrom cli.main import main\nsys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "serve", "--db", db, *flags]
    return subprocess.run(cmd, check=False, cwd=REPO, env=daemon_env(**(env or {})),
                          capture_output=True, text=True, timeout=60)


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused start prints (JSON log lines aside); asserts exit 2, no traceback."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("crossover serve: error: ")
    return lines[0]


def test_a_port_in_use_is_one_line_and_exit_2_before_the_model_loads(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve_once(tmp_path, "--fake-engine", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in _error_line(done)
    assert "using the fake engine" not in done.stderr and "loading model" not in done.stderr
    assert not (tmp_path / "telemetry.db").exists()  # refused before the database too


def test_a_model_load_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    stub = ("import types\nloader = types.ModuleType('engine.loader')\n"
            "def load_engine(**kw):\n    raise FileNotFoundError('no config.json in /models/nope')\n"
            "loader.load_engine = load_engine\nsys.modules['engine.loader'] = loader")
    done = _serve_once(tmp_path, "--port", "0", "--model", "/models/nope", preload=stub)
    line = _error_line(done)
    assert "cannot load the model /models/nope" in line
    assert "FileNotFoundError: no config.json in /models/nope" in line


def test_open_on_a_public_host_is_refused_without_the_second_flag(tmp_path: Path) -> None:
    done = _serve_once(tmp_path, "--fake-engine", "--host", "0.0.0.0", "--port", "0", "--open")
    assert "--open-non-loopback" in _error_line(done)


def test_an_admin_token_on_the_command_line_is_warned_about(tmp_path: Path) -> None:
    proc, port, log_path = _start_daemon(tmp_path, "--admin-token", "s3cret",
                                         "--metrics-require-admin")
    try:
        assert http_request(port, "GET", "/metrics").status == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert http_request(port, "GET", "/metrics", headers=auth).status == 200
    finally:
        stop_process(proc, 10)
    warnings = [line["msg"] for line in _json_lines(log_path) if line.get("level") == "warning"]
    assert any("admin token was given on the command line" in msg for msg in warnings)
    assert "s3cret" not in log_path.read_text()


def test_the_admin_token_file_works_without_a_warning(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    proc, port, log_path = _start_daemon(tmp_path, "--admin-token-file", str(token_file))
    try:
        auth = {"Authorization": "Bearer from-a-file"}
        assert http_request(port, "GET", "/admin/status", headers=auth).status == 200
        assert http_request(port, "GET", "/admin/status").status == 401
    finally:
        stop_process(proc, 10)
    assert "command line" not in log_path.read_text()
