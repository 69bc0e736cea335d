"""Three daemons (FakeEngine, in one process) sharing one PostgreSQL database: traffic to
all, concurrent retunes on each, then the checks of issue 20 item 3 — no lost or duplicated
request rows, no policy version conflicts, each daemon serving only its own policies, the
acceptance pooled over all three, and a retune on one leaving the others alone.

Skipped, with the reason, when no PostgreSQL server is reachable (tests/conftest.py's
`pg_url`: $CROSSOVER_TEST_PG_URL or the local defaults).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import select

from store.db import make_engine, session_scope
from store.history import active_policy, policy_history, retune_history
from store.models import Request
from tests.daemon.helpers import MODEL, LiveServer, wait_for
from tests.daemon.test_tuning import ADMIN, TOKEN, speculating_engine
from tuner.config import TunerConfig

NAMES = ("r1", "r2", "r3")
CONFIG = TunerConfig(enabled=False, search_process=False, trials=8, validation_s=3.0,
                     validation_min_steps=30)


@contextmanager
def traffic(servers: dict[str, LiveServer], threads: int = 2
            ) -> Iterator[dict[str, list[tuple[int, str]]]]:
    """Completions to every server from `threads` clients each until the block ends;
    yields server name -> [(status, response id)]."""
    stop = threading.Event()
    sent: dict[str, list[tuple[int, str]]] = {name: [] for name in servers}

    def client(name: str, k: int) -> None:
        server, i = servers[name], 0
        while not stop.is_set():
            prompt = "abcdefghijklmnopqrstuvwxyz"[: 6 + (i * 7 + k) % 20]
            r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 24})
            sent[name].append((r.status, r.json().get("id", "") if r.status == 200 else ""))
            i += 1

    workers = [threading.Thread(target=client, args=(name, k), daemon=True)
               for name in servers for k in range(threads)]
    for w in workers:
        w.start()
    try:
        yield sent
    finally:
        stop.set()
        for w in workers:
            w.join(30)


def finished(server: LiveServer, retune_id: int, timeout: float = 120.0) -> dict[str, Any]:
    def view() -> dict[str, Any]:
        return server.get(f"/admin/retunes/{retune_id}", ADMIN).json()

    wait_for(lambda: view()["status"] != "running", timeout, f"retune {retune_id}")
    return view()


def test_three_daemons_share_one_postgresql_database(pg_url: str) -> None:
    servers: dict[str, LiveServer] = {}
    db = make_engine(pg_url)
    try:
        for name in NAMES:
            servers[name] = LiveServer(speculating_engine(), db_url=pg_url, instance=name,
                                       admin_token=TOKEN, tuner=CONFIG).start()
        _run(servers, db)
    finally:
        for server in servers.values():
            server.close()
        db.dispose()


def _run(servers: dict[str, LiveServer], db: Any) -> None:
    policy = {n: s.get("/admin/policy", ADMIN).json() for n, s in servers.items()}
    assert {n: (p["instance"], p["policy"]["version"]) for n, p in policy.items()} == {
        n: (n, 0) for n in NAMES}  # each recorded its own version 0
    with traffic(servers) as sent:
        wait_for(lambda: all(s.engine.step_count > 300 for s in servers.values()), 60, "steps")
        # concurrent retunes, one per daemon
        started: dict[str, dict] = {}
        barrier = threading.Barrier(len(servers))

        def trigger(name: str) -> None:
            barrier.wait()
            started[name] = servers[name].post("/admin/retune", None, ADMIN).json()

        threads = [threading.Thread(target=trigger, args=(n,)) for n in NAMES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(started[n]["started"] for n in NAMES), started
        first = {n: finished(servers[n], started[n]["retune"]["id"]) for n in NAMES}
        # a retune on r1 alone leaves r2 and r3 serving what they served
        before = {n: servers[n].get("/admin/policy", ADMIN).json() for n in NAMES}
        counts_before = {n: len(sent[n]) for n in NAMES}
        lone = servers["r1"].post("/admin/retune", None, ADMIN).json()
        assert lone["started"]
        second = finished(servers["r1"], lone["retune"]["id"])
        after = {n: servers[n].get("/admin/policy", ADMIN).json() for n in NAMES}
        assert all(len(sent[n]) > counts_before[n] for n in ("r2", "r3"))  # they kept serving
    for name in ("r2", "r3"):
        assert after[name]["policy"] == before[name]["policy"]
        assert servers[name].get("/admin/tuner", ADMIN).json()["running"] is None
        assert [r["id"] for r in servers[name].get("/admin/retunes", ADMIN).json()["data"]] == [
            first[name]["id"]]

    # every retune ran on its own instance and pooled acceptance over all three
    for name, view in [*first.items(), ("r1", second)]:
        assert view["instance"] == name
        assert view["status"] in ("applied", "rejected"), view
        pooled = view["details"]["model"]["acceptance_from"]
        assert set(pooled) == set(NAMES) and all(n > 0 for n in pooled.values()), pooled

    for server in servers.values():
        server.wait_idle()
    # no lost or duplicated request rows: every 200 once, under the daemon that served it
    ok = {n: [rid for status, rid in sent[n] if status == 200] for n in NAMES}
    assert all(len(ok[n]) == len(sent[n]) > 20 for n in NAMES), {n: len(sent[n]) for n in NAMES}

    def rows() -> list[tuple[str, str]]:
        with session_scope(db) as s:
            return [tuple(r) for r in s.execute(select(Request.instance, Request.request_id))]

    expected = sorted((n, rid) for n in NAMES for rid in ok[n])
    wait_for(lambda: len(rows()) >= len(expected), 20, "every request row")
    assert sorted(rows()) == expected

    # versions: per instance 0..k with no gaps or repeats; each daemon serves its own newest
    with session_scope(db) as s:
        for name, server in servers.items():
            versions = sorted(p.version for p in policy_history(s, 100, instance=name))
            assert versions == list(range(len(versions))), (name, versions)
            active = active_policy(s, instance=name)
            served = server.get("/admin/policy", ADMIN).json()
            assert served["engine_version"] == served["policy"]["version"] == active.version
            assert served["policy"]["rules"] == [r for r in active.body["rules"]]
            own = {r.id for r in retune_history(s, 100, instance=name)}
            for p in policy_history(s, 100, instance=name):
                retune_id = (p.body.get("extra") or {}).get("retune_id")
                assert retune_id is None or retune_id in own, (name, p.version, retune_id)
    print("\nthree daemons:", {n: f"{len(ok[n])} requests" for n in NAMES},
          f"{len(expected)} request rows", {n: first[n]["status"] for n in NAMES},
          f"r1 again: {second['status']}")
