"""Clients that stop reading a stream: the write and idle timeouts abort them and free their pages;
a tenant without its own max_concurrent cannot take every slot."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from daemon.state import ENGINE_THREAD, GATES
from engine.fake import FakeEngine
from tests.daemon.helpers import (
    MODEL,
    RCVBUF,
    LiveServer,
    SmallBufferServer,
    http_request,
    parse_sse,
    wait_for,
)

"""The stalled clients' receive buffer: small, so the daemon's writes back up quickly."""


@contextmanager
def stalled_stream(port: int, body: dict[str, object],
                   headers: dict[str, str] | None = None) -> Iterator[socket.socket]:
    """A raw socket that sends one streaming request and then never reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # before connect: sets the window
    try:
        sock.connect(("127.0.0.1", port))
        data = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n{head}\r\n"
                     .encode() + data)
        yield sock
    finally:
        sock.close()


@pytest.fixture
def servers() -> Iterator[list[LiveServer]]:
    """Servers a test started itself; closed after it."""
    started: list[LiveServer] = []
    yield started
    for server in started:
        server.close()


def long_stream(max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": "abcdefgh", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}


def stream_timeouts(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.crossover_fields["reason"] for r in caplog.records  # type: ignore[attr-defined]
            if r.getMessage() == "client stopped reading; request aborted"]


def test_two_clients_that_stop_reading_are_aborted_by_the_write_timeout(
        servers: list[LiveServer], caplog: pytest.LogCaptureFixture) -> None:
    # two slots in all (max_batch 2, nothing may wait): two stalled streams took every one
    server = SmallBufferServer(FakeEngine(max_batch=2, step_delay_s=0.002), max_waiting=0,
                               stream_write_timeout_s=0.3, stream_idle_timeout_s=600.0).start()
    servers.append(server)
    caplog.set_level(logging.WARNING, logger="crossover.api")
    with stalled_stream(server.port, long_stream(4000)), stalled_stream(server.port, long_stream(4000)):
        wait_for(lambda: len(server.sink.results) == 2, 20, "both stalled streams aborted")
        assert [r.finish_reason for r in server.sink.results] == ["abort", "abort"]
        assert all(r.output_tokens < 4000 for r in server.sink.results)
        server.wait_idle()
        assert server.engine.pages_used == 0  # the pool is full again
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 5})
        assert r.status == 200 and r.json()["choices"][0]["text"] == "cba"  # served, not 429
    assert stream_timeouts(caplog) == ["write_timeout", "write_timeout"]


def test_a_slow_stream_whose_client_stopped_reading_trips_the_idle_timeout(
        live: Callable[..., LiveServer], caplog: pytest.LogCaptureFixture) -> None:
    # 20 ms a token: the daemon's buffers would take minutes to fill, so no write ever waits
    server = live(FakeEngine(max_batch=1, step_delay_s=0.02), max_waiting=0,
                  stream_write_timeout_s=600.0, stream_idle_timeout_s=0.5)
    caplog.set_level(logging.WARNING, logger="crossover.api")
    with stalled_stream(server.port, long_stream(1500)):
        wait_for(lambda: len(server.sink.results) == 1, 20, "the stalled stream aborted")
        result = server.sink.results[0]
        assert result.finish_reason == "abort" and result.output_tokens < 1000
        server.wait_idle()
        assert server.engine.pages_used == 0
        assert server.post("/v1/completions", {"model": MODEL, "prompt": "ab"}).status == 200
    assert stream_timeouts(caplog) == ["idle_timeout"]


def test_a_client_that_reads_a_slow_stream_is_not_cut_off(live: Callable[..., LiveServer]) -> None:
    # generation takes ~8 idle timeouts; nothing waits for the client, so nothing trips
    server = live(FakeEngine(step_delay_s=0.05), stream_write_timeout_s=0.2,
                  stream_idle_timeout_s=0.25)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "q" * 40, "max_tokens": 40,
                                        "stream": True})
    events = parse_sse(r.data)
    assert r.status == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "q" * 40
    assert [res.finish_reason for res in server.sink.results] == ["length"]


def test_a_tenant_without_its_own_limit_cannot_take_every_slot(
        db_url: str, capsys: pytest.CaptureFixture[str], live: Callable[..., LiveServer]) -> None:
    from tests.daemon.tenants.helpers import add_tenant, bearer

    server = live(FakeEngine(max_batch=4, step_delay_s=0.005), db_url=db_url, open_mode=False,
                  max_waiting=0)  # default share 0.5: each tenant may have 2 in flight
    greedy = add_tenant(db_url, "greedy", capsys=capsys)
    other = add_tenant(db_url, "other", capsys=capsys)
    auth = {"Authorization": f"Bearer {greedy}"}
    with stalled_stream(server.port, long_stream(4000), auth), \
            stalled_stream(server.port, long_stream(4000), auth):
        wait_for(lambda: server.engine.status()["running"] == 2, 10, "two greedy streams running")
        r = http_request(server.port, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": "abc", "max_tokens": 3}, auth)
        assert r.status == 429 and r.json()["error"]["code"] == "tenant_concurrency_limit"
        r = http_request(server.port, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": "abc", "max_tokens": 3}, bearer(other))
        assert r.status == 200 and r.json()["choices"][0]["text"] == "cba"


def test_a_stream_the_engine_finished_holds_no_slot_while_its_client_reads_slowly(
        servers: list[LiveServer]) -> None:
    """One engine slot in all (max_batch 1, nothing waits) and the tenant limited to one: a
    stream whose tokens are all generated but not yet read by its (stalled) client frees both,
    so the next request is served instead of 429; the stalled stream still ends by the guard."""
    server = SmallBufferServer(FakeEngine(max_batch=1), max_waiting=0, max_batch=1,
                               stream_write_timeout_s=600.0, stream_idle_timeout_s=600.0).start()
    servers.append(server)
    with stalled_stream(server.port, long_stream(3000)):  # ~3000 SSE events: far more than the buffers
        wait_for(lambda: len(server.sink.results) == 1, 20, "the engine finished the stalled stream")
        assert server.sink.results[0].finish_reason == "length"
        assert server.app[ENGINE_THREAD].active == 1  # its response is still being written
        wait_for(lambda: server.app[GATES].in_flight().get("default", (0, 0))[0] == 0, 10,
                 "the tenant slot given back")
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 5})
        assert r.status == 200 and r.json()["choices"][0]["text"] == "cba"  # served, not 429

