"""Connection limits (daemon/connections.py): a header deadline, a body deadline and a cap on
open connections, each answered or closed without holding a handler."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import pytest

from tests.daemon.helpers import MODEL, LiveServer, http_request, read_response, wait_for


@pytest.fixture
def server() -> Iterator[LiveServer]:
    srv = LiveServer(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=4).start()
    yield srv
    srv.close()


def connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or 10 s pass)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_client_trickling_its_headers_is_closed_at_the_deadline(server: LiveServer) -> None:
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    start, closed = time.monotonic(), False
    while time.monotonic() - start < 8:
        try:
            sock.sendall(b"X-Slow: a\r\n")  # a header line every 0.1 s, never the blank line
        except OSError:
            closed = True
            break
        sock.settimeout(0.1)
        try:
            if sock.recv(1024) == b"":
                closed = True
                break
        except TimeoutError:
            pass
    sock.close()
    assert closed and time.monotonic() - start < 5, "the trickling connection stayed open"


def test_a_stalled_body_gets_408_at_the_deadline(server: LiveServer) -> None:
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 200\r\n\r\n{\"model\": ")
    start = time.monotonic()
    head, body = read_response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 5
    assert http_request(server.port, "POST", "/v1/completions",
                        {"model": MODEL, "prompt": "abc", "max_tokens": 2}).status == 200


def test_connections_past_the_cap_get_503_and_the_next_after_one_closes_is_served(server: LiveServer) -> None:
    held = [connect(server) for _ in range(4)]
    wait_for(lambda: len(server.runner.server.connections) == 4, what="4 connections open")
    extra = connect(server)
    reply = read_all(extra)
    extra.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), reply[:200]
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert server.runner.refused == 1
    held.pop().close()
    wait_for(lambda: len(server.runner.server.connections) == 3, what="one connection closed")
    r = http_request(server.port, "POST", "/v1/completions",
                     {"model": MODEL, "prompt": "abc", "max_tokens": 2})
    assert r.status == 200
    for sock in held:
        sock.close()


def test_idle_connections_are_closed_at_the_header_deadline_and_free_their_slots(server: LiveServer) -> None:
    held = [connect(server) for _ in range(4)]  # connect and send nothing
    wait_for(lambda: len(server.runner.server.connections) == 0, timeout=10, what="idle connections closed")
    assert all(read_all(sock) == b"" for sock in held)
    for sock in held:
        sock.close()
    r = http_request(server.port, "POST", "/v1/completions",
                     {"model": MODEL, "prompt": "abc", "max_tokens": 2})
    assert r.status == 200 and server.runner.refused == 0


@pytest.mark.parametrize("headers,status", [
    ({}, 200),
    ({"Host": "localhost:8000"}, 200),
    ({"Host": "127.0.0.2"}, 200),
    ({"Host": "[::1]:8000"}, 200),
    ({"Origin": "http://localhost:3000"}, 200),
    ({"Origin": "https://127.0.0.1"}, 200),
    ({"Host": "attacker.example:8000"}, 403),  # DNS rebinding: the page's own name
    ({"Host": "localhost.attacker.example"}, 403),
    ({"Origin": "https://attacker.example"}, 403),  # a cross-site "simple" POST
    ({"Origin": "null"}, 403),  # a sandboxed frame or a file:// page
    ({"Origin": "http://localhost.attacker.example"}, 403),
])
def test_a_loopback_daemon_serves_only_loopback_hosts_and_origins(
        server: LiveServer, headers: dict[str, str], status: int) -> None:
    r = http_request(server.port, "POST", "/v1/completions",
                     {"model": MODEL, "prompt": "abc", "max_tokens": 2}, headers)
    assert r.status == status, r.data
    if status == 403:
        assert r.json()["error"]["code"] == "forbidden_origin"
        assert server.get("/health").status == 200  # and GET routes alike: only what it is asked
        assert http_request(server.port, "GET", "/health", None, headers).status == 403


def test_a_daemon_bound_elsewhere_checks_no_host() -> None:
    srv = LiveServer(host="0.0.0.0", open_mode=True, open_non_loopback=True).start()
    try:
        r = http_request(srv.port, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": "abc", "max_tokens": 2},
                         {"Host": "api.example.com", "Origin": "https://app.example.com"})
        assert r.status == 200
    finally:
        srv.close()


def test_check_origin_off_serves_any_host_on_loopback() -> None:
    srv = LiveServer(check_origin=False).start()
    try:
        r = http_request(srv.port, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": "abc", "max_tokens": 2},
                         {"Host": "gpu-box.example:8000"})
        assert r.status == 200
    finally:
        srv.close()


def test_a_request_aiohttp_cannot_parse_is_one_warning_line(server: LiveServer,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer xo-\x7f\r\n\r\n")
    reply = read_all(sock)
    sock.close()
    assert reply.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400"))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "malformed_request" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("malformed HTTP request: ")
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
    assert "malformed HTTP request refused (400)" in records[0].getMessage()
    assert server.get("/health").status == 200

