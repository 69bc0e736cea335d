"""The fast start as the daemon shows it: /ready turns 200 once plain decoding is compiled, and
says per technique whether its speculation shapes are ready (engine/warmup/warm.py); so does the
dashboard's status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daemon.lifecycle import close_engine
from engine.fake import FakeEngine, FakeProposer
from tests.daemon.helpers import MODEL, LiveServer

PROPOSERS = {"ngram": FakeProposer("ngram"), "mtp": FakeProposer("mtp")}


class WarmingEngine(FakeEngine):
    """A fake whose MTP shapes are still compiling in the background, serving a clamped policy."""

    def status(self) -> dict[str, Any]:
        return {**super().status(), "techniques": {"ngram": "ready", "mtp": "compiling"},
                "speculation": {"max_batch": 16, "clamped": {"policy_version": 3, "speculates_up_to": 64,
                                                             "served_up_to": 16}}}


def test_ready_names_each_technique_ready(live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(proposers=dict(PROPOSERS)))
    r = server.get("/ready")
    assert r.status == 200 and r.json()["engine"]["techniques"] == {"ngram": "ready", "mtp": "ready"}
    assert server.get("/dashboard/api/status").json()["techniques"] == {"ngram": "ready", "mtp": "ready"}


def test_ready_while_speculation_still_compiles(live: Callable[..., LiveServer]) -> None:
    """Plain serving is ready: /ready is 200 and requests are served while MTP compiles."""
    server = live(WarmingEngine(proposers=dict(PROPOSERS)))
    r = server.get("/ready")
    assert r.status == 200 and r.json()["status"] == "ready"
    assert r.json()["engine"]["techniques"] == {"ngram": "ready", "mtp": "compiling"}
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2}).status == 200
    status = server.get("/dashboard/api/status").json()
    assert status["techniques"]["mtp"] == "compiling"
    assert (status["speculation"]["clamped"]["speculates_up_to"] == 64
            and status["speculation"]["max_batch"] == 16)


def test_shutdown_stops_a_background_warmup() -> None:
    class Closing(FakeEngine):
        closed = 0

        def close(self) -> None:
            self.closed += 1

    engine = Closing()
    close_engine(engine)
    close_engine(FakeEngine())  # an engine without close() is fine
    assert engine.closed == 1
