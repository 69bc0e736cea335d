"""Two real-model daemons (Gemma 3 270M) sharing one PostgreSQL database, each in its own
`crossover serve` process: a few requests and one admin retune each; rows, retunes and
policies stay per instance, and nothing compiles after warmup.

Each daemon runs in a subprocess so that its engine's memory leaves with it: two 270M
engines inside the test suite's process pushed CI past the machine's memory. Skipped, with
the reason, when no PostgreSQL server is reachable (tests/conftest.py's `pg_url`).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from store.db import make_engine, session_scope
from store.history import active_policy, policy_history, retune_history
from store.models import Request
from tests.daemon.helpers import (
    REAL_ENGINE,
    REPO,
    SERVE,
    daemon_env,
    free_port,
    http_request,
    stop_process,
    wait_for,
)
from tests.daemon.test_tuning import ADMIN, TOKEN

NAMES = ("g1", "g2")


class Daemon:
    """One `crossover serve` process with the real model at small shapes: those of
    test_real_model.py, whose compiled executables it loads from the persistent cache."""

    def __init__(self, name: str, db_url: str, workdir: Path) -> None:
        self.name, self.port = name, free_port()
        self.log = workdir / f"{name}.log"
        token = workdir / "admin-token"
        token.write_text(TOKEN)
        cmd = [*SERVE, "--port", str(self.port), "--db", db_url,
               "--instance", name, "--admin-token-file", str(token),
               "--max-batch", str(REAL_ENGINE["max_batch"]), "--max-context", str(REAL_ENGINE["max_context"]),
               "--kv-budget", f"{REAL_ENGINE['kv_budget_bytes'] >> 20}MiB", "--no-speculation",
               "--no-tuner", "--no-tuner-search-process", "--tuner-trials", "8",
               # The retune's validation window sees no traffic, so it runs its longest: 4x this.
               "--tuner-validation-s", "0.5", "--tuner-validation-min-steps", "30"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=daemon_env(), stdout=out,
                                         stderr=subprocess.STDOUT)

    def get(self, path: str) -> Any:
        r = http_request(self.port, "GET", path, headers=ADMIN)
        assert r.status == 200, (path, r.status, r.data)
        return r.json()

    def warm(self) -> bool:
        """Every shape compiled: the ragged calls (before /ready turns 200) and every technique's."""
        techniques = self.get("/ready")["engine"].get("techniques") or {}
        return all(v == "ready" for v in techniques.values())

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"
        try:
            return http_request(self.port, "GET", "/ready").status == 200
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.proc, 60)


def _retune_done(daemon: Daemon, retune_id: int) -> dict[str, Any]:
    wait_for(lambda: daemon.get(f"/admin/retunes/{retune_id}")["status"] != "running", 180,
             f"{daemon.name}'s retune {retune_id}")
    return daemon.get(f"/admin/retunes/{retune_id}")


@pytest.mark.slow
def test_two_real_model_daemons_share_one_postgresql_database(pg_url: str, tmp_path: Path) -> None:
    db = make_engine(pg_url)
    t0 = time.monotonic()
    daemons: dict[str, Daemon] = {}
    try:
        for name in NAMES:  # both warm up at once: the database is shared from the start
            daemons[name] = Daemon(name, pg_url, tmp_path)
        for d in daemons.values():
            wait_for(d.ready, 600, f"{d.name} ready")
            wait_for(d.warm, 600,
                     f"{d.name} background warmup")  # staged start: the rest compiles after ready
        warm = {n: d.get("/admin/status")["compiles"]["total"] for n, d in daemons.items()}
        ids: dict[str, list[str]] = {name: [] for name in NAMES}
        for i in range(3):
            for name, d in daemons.items():
                r = http_request(d.port, "POST", "/v1/completions", {
                    "model": "gemma3-270m", "prompt": f"Count to {i + 3}:", "max_tokens": 8,
                    "temperature": 0})
                assert r.status == 200, r.data
                assert r.json()["choices"][0]["text"], r.data
                ids[name].append(r.json()["id"])
        started = {}
        for name, d in daemons.items():
            r = http_request(d.port, "POST", "/admin/retune", None, ADMIN)
            assert r.status in (200, 202), r.data
            started[name] = r.json()
        assert all(started[n]["started"] for n in NAMES), started
        views = {n: _retune_done(daemons[n], started[n]["retune"]["id"]) for n in NAMES}
        for name, d in daemons.items():  # every request answered and its pages freed; no compiles
            wait_for(lambda d=d: d.get("/admin/status")["pool"]["pages_used"] == 0, 30, "pages freed")
            status = d.get("/admin/status")
            assert status["compiles"]["total"] == warm[name], status["compiles"]
            assert status["compiles"]["since_warmup"] == 0, status["compiles"]
        for name, view in views.items():
            assert view["instance"] == name
            assert view["status"] in ("skipped", "applied", "rejected"), view
            listed = daemons[name].get("/admin/retunes")["data"]
            assert [r["id"] for r in listed] == [view["id"]]  # the other's retune is not listed

        def rows() -> list[tuple[str, str]]:
            with session_scope(db) as s:
                return [tuple(r) for r in s.execute(select(Request.instance, Request.request_id))]

        expected = sorted((n, rid) for n in NAMES for rid in ids[n])
        assert len(set(expected)) == 6
        wait_for(lambda: len(rows()) >= len(expected), 20, "every request row")
        assert sorted(rows()) == expected  # each id once, under the daemon that served it
        with session_scope(db) as s:
            for name in NAMES:
                versions = sorted(p.version for p in policy_history(s, 100, instance=name))
                assert versions == list(range(len(versions))) and versions, (name, versions)
                assert [r.id for r in retune_history(s, 100, instance=name)] == [views[name]["id"]]
                for p in policy_history(s, 100, instance=name):  # none from the other's retune
                    assert (p.body.get("extra") or {}).get("retune_id") in (None, views[name]["id"])
                served = daemons[name].get("/admin/policy")
                assert served["instance"] == name
                assert served["policy"]["version"] == active_policy(s, instance=name).version
    finally:
        for d in daemons.values():
            d.stop()
        db.dispose()
    assert all(d.proc.returncode == 0 for d in daemons.values()), {
        n: (d.proc.returncode, d.log.read_text()[-2000:]) for n, d in daemons.items()}
    print(f"\ntwo real-model daemons: {time.monotonic() - t0:.0f}s,", {n: views[n]["status"] for n in NAMES})
