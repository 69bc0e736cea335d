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


def test_no_prefix_cache_flag_and_variable_reach_the_engine(monkeypatch) -> None:
    import argparse

    import engine.loader
    from cli.commands import serve
    from daemon import lifecycle
    from daemon.settings import load_settings

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--no-prefix-cache"])
    settings = load_settings({k: getattr(args, k) for k in serve.SETTING_FLAGS}, {})
    assert settings.prefix_cache is False
    assert load_settings({}, env={"CROSSOVER_PREFIX_CACHE": "off"}).prefix_cache is False
    assert load_settings({}, env={}).prefix_cache is True
    seen = {}
    monkeypatch.setattr(engine.loader, "load_engine", lambda **kw: seen.update(kw) or type(
        "E", (), {"model_name": "m"})())
    lifecycle.load_engine(settings, serve.fake_engine(args))
    assert seen["prefix_cache"] is False
