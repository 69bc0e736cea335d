"""The daemon's instance name: the setting and flag, the default (host name:port), and what
it scopes when two daemons share a database: telemetry rows, /metrics' retune counts, the
admin API and the dashboard's `?instance=` (SQLite; tests/daemon/test_replicas.py runs three
daemons on PostgreSQL)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from sqlalchemy import select

from daemon.database import default_instance
from daemon.lifecycle import connect_database
from daemon.settings import Settings, SettingsError
from store.db import make_engine, session_scope
from store.history import finish_retune, start_retune
from store.models import Request
from tests.daemon.helpers import MODEL, LiveServer, wait_for
from tests.daemon.test_metrics import scrape, value
from tuner.config import TunerConfig

TOKEN = "instances-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def test_reserved_and_overlong_instance_names_are_refused() -> None:
    # the flag and CROSSOVER_INSTANCE: tests/cli/test_serve.py
    with pytest.raises(SettingsError, match="reserved"):
        Settings(instance="all")
    with pytest.raises(SettingsError, match="1 to 64"):
        Settings(instance="x" * 65)


def test_serve_names_the_instance_host_and_port_unless_told(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    database = connect_database(Settings(db_url=url), 8123)
    assert database.instance == default_instance(8123) == f"{socket.gethostname()}:8123"
    assert database.recorder.config.instance == database.instance
    database.engine.dispose()
    database = connect_database(Settings(db_url=url, instance="east-1"), 8123)
    assert database.instance == "east-1" and database.recorder.config.instance == "east-1"
    database.engine.dispose()


def test_two_daemons_on_one_database_keep_to_their_own_rows(
        db_url: str, live: Callable[..., LiveServer]) -> None:
    quiet = TunerConfig(enabled=False, search_process=False)
    servers = {name: live(db_url=db_url, instance=name, admin_token=TOKEN, tuner=quiet)
               for name in ("a", "b")}
    for name, server in servers.items():
        for i in range(3 if name == "a" else 2):
            r = server.post("/v1/completions", {"model": MODEL, "prompt": f"{name} {i}",
                                                "max_tokens": 4})
            assert r.status == 200
    engine = make_engine(db_url)

    def rows() -> list[tuple[str, str]]:
        with session_scope(engine) as s:
            return list(s.execute(select(Request.instance, Request.request_id)))

    wait_for(lambda: len(rows()) == 5, what="5 request rows")
    assert sorted(i for i, _ in rows()) == ["a", "a", "a", "b", "b"]
    with session_scope(engine) as s:
        finish_retune(s, start_retune(s, "admin", instance="b").id, "rejected")
        finish_retune(s, start_retune(s, "admin", instance="b").id, "rejected")
        finish_retune(s, start_retune(s, "admin", instance="a").id, "rejected")
    engine.dispose()
    a, b = servers["a"], servers["b"]
    assert value(scrape(a), "crossover_retunes_total", status="rejected") == 1
    assert value(scrape(b), "crossover_retunes_total", status="rejected") == 2
    assert a.get("/admin/status", ADMIN).json()["instance"] == "a"
    assert b.get("/admin/policy", ADMIN).json()["instance"] == "b"
    assert [r["instance"] for r in b.get("/admin/retunes", ADMIN).json()["data"]] == ["b"] * 2

    def dashboard(server: LiveServer, path: str) -> dict:
        response = server.get(f"/dashboard/api/{path}", ADMIN)
        assert response.status == 200, response.data
        return response.json()

    assert {r["instance"] for r in dashboard(a, "retunes")["retunes"]} == {"a"}
    assert {r["instance"] for r in dashboard(a, "retunes?instance=b")["retunes"]} == {"b"}
    every = dashboard(a, "retunes?instance=all")
    assert sorted(r["instance"] for r in every["retunes"]) == ["a", "b", "b"]
    assert {(p["instance"], p["version"]) for p in every["policies"]} == {("a", 0), ("b", 0)}
    steps_a = sum(x["steps"] for x in dashboard(a, "batch")["bins"])
    steps_all = sum(x["steps"] for x in dashboard(a, "batch?instance=all")["bins"])
    assert 0 < steps_a < steps_all
    assert dashboard(a, "goodput")["crossover"]["policy_version"] == 0
