"""POST /admin/reset_prefix_cache: admin token only, answered once the engine thread emptied the
prefix cache between two steps; the same prompt then finds nothing cached."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

import daemon.bridge
from engine.fake import FakeEngine
from tests.daemon.helpers import MODEL, LiveServer, http_request
from tests.daemon.test_admin import ADMIN, TOKEN, as_bearer

PATH = "/admin/reset_prefix_cache"
PROMPT = "a system prompt long enough for a few cached blocks"  # 51 tokens with BOS: 3 blocks of 16


def hit_tokens(server: LiveServer) -> int:
    return server.engine.status()["prefix_cache"]["hit_tokens"]


def complete(server: LiveServer) -> None:
    r = server.post("/v1/completions", {"model": server.engine.model_name, "prompt": PROMPT, "max_tokens": 2})
    assert r.status == 200
    server.wait_idle(60.0)


def test_only_the_admin_token_resets(live: Callable[..., LiveServer]) -> None:
    server = live(admin_token=TOKEN)
    complete(server)
    for headers, want, code in [(None, 401, "missing_admin_token"),
                                (as_bearer("wrong"), 403, "invalid_admin_token")]:
        r = http_request(server.port, "POST", PATH, None, headers)
        assert (r.status, r.json()["error"]["code"]) == (want, code)
    complete(server)
    assert hit_tokens(server) == 48  # nothing was reset: the second request hit 3 blocks
    disabled = live()
    r = disabled.post(PATH, None, ADMIN)
    assert (r.status, r.json()["error"]["code"]) == (403, "admin_disabled")


def test_the_reset_empties_the_cache_and_says_what_went(live: Callable[..., LiveServer]) -> None:
    server = live(admin_token=TOKEN)
    complete(server)
    r = server.post(PATH, None, ADMIN)
    assert r.status == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {"enabled": True, "dropped_blocks": 3, "freed_pages": 0}  # the fake frees no pages
    complete(server)
    assert hit_tokens(server) == 0  # the same prompt computed in full
    complete(server)
    assert hit_tokens(server) == 48  # and cached again
    assert server.post(PATH, None, ADMIN).json()["dropped_blocks"] == 3


def test_an_engine_still_warming_up_answers_503() -> None:
    server = LiveServer(FakeEngine(warmup_delay_s=2.0), admin_token=TOKEN).start(wait_ready=False)
    try:
        r = server.post(PATH, None, ADMIN)
        assert (r.status, r.json()["error"]["code"]) == (503, "engine_unavailable")
    finally:
        server.close()


class Gated(FakeEngine):
    """A fake whose steps wait at a gate while it is closed: no step boundary comes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()

    def step(self):  # type: ignore[no-untyped-def]
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait(10)
        return super().step()


def test_a_reset_that_times_out_still_runs_at_the_next_step(live: Callable[..., LiveServer],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon.bridge, "RESET_WAIT_S", 0.05)
    engine = Gated()
    server = live(engine, admin_token=TOKEN)
    complete(server)  # PROMPT's blocks cached
    engine.gate.clear()
    other = threading.Thread(target=server.post, args=("/v1/completions", {"model": MODEL, "prompt": "x"}))
    other.start()  # its step waits at the gate, before the inbox is read
    assert engine.held.wait(10)
    r = server.post(PATH, None, ADMIN)
    assert (r.status, r.json()["error"]["code"]) == (503, "engine_busy")
    engine.gate.set()
    other.join(10)
    server.wait_idle()
    complete(server)
    assert hit_tokens(server) == 0  # the queued reset ran once the step went on: PROMPT missed


def test_the_route_resets_the_real_engines_prefix_cache() -> None:
    """The same route over the real engine (the tiny model): the reset frees the cached pages, the
    same prompt then hits nothing, and every page is back in the pool once idle."""
    from tests.daemon.test_bad_input import tiny_engine

    engine = tiny_engine()
    server = LiveServer(engine, admin_token=TOKEN).start()
    try:
        complete(server)
        complete(server)
        hits = hit_tokens(server)
        assert hits > 0  # the second request found the first's blocks
        r = server.post(PATH, None, ADMIN)
        assert r.status == 200
        body = r.json()
        assert body["enabled"] and body["dropped_blocks"] > 0 and body["freed_pages"] > 0
        status = engine.status()["prefix_cache"]
        assert (status["blocks"], status["cached_pages"]) == (0, 0)
        complete(server)
        assert hit_tokens(server) == hits  # this request computed its prompt in full
        complete(server)
        assert hit_tokens(server) > hits  # and cached it again
        assert engine.pool.used == 0
    finally:
        server.close()
