"""Prefix-cache hits reach /metrics (vLLM's token counters), /ready and the telemetry database
(the fake engine counts hits as the real one does)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from tests.daemon.helpers import MODEL, LiveServer
from tests.daemon.test_metrics import scrape, value

SYSTEM = "You are the bakery's assistant; answer in one line. "  # 52 bytes: with BOS 3 blocks of 16


def test_hits_in_metrics_ready_and_database(db_url: str, live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url)
    for question in ("When do you open?", "Is there rye bread?"):
        body = {"model": MODEL, "prompt": SYSTEM + question, "max_tokens": 2}
        assert server.post("/v1/completions", body).status == 200
        server.wait_idle()
    queried = 2 * (1 + len(SYSTEM)) + len("When do you open?") + len("Is there rye bread?")  # BOS each
    samples = scrape(server)
    assert value(samples, "crossover_prefix_cache_hits_total", model_name=MODEL) == 48
    assert value(samples, "crossover_prefix_cache_queries_total", model_name=MODEL) == queried
    ready = server.get("/ready").json()["engine"]["prefix_cache"]
    assert ready["hit_tokens"] == 48 and ready["hit_rate"] == round(48 / queried, 4)
    assert server.database is not None and server.database.recorder.flush(10.0)
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    try:
        row = con.execute("SELECT SUM(prefix_hit_tokens), SUM(prefix_query_tokens) FROM xo_steps").fetchone()
    finally:
        con.close()
    assert row == (48, queried)


def test_the_prefix_cache_setting_reaches_the_engine(monkeypatch) -> None:
    # the flag and CROSSOVER_PREFIX_CACHE reach the setting: tests/cli/test_serve.py
    import engine.loader
    from daemon import lifecycle
    from daemon.settings import Settings

    seen = {}
    monkeypatch.setattr(engine.loader, "load_engine", lambda **kw: seen.update(kw) or type(
        "E", (), {"model_name": "m"})())
    lifecycle.load_engine(Settings(prefix_cache=False))
    assert seen["prefix_cache"] is False
