"""Closed mode: missing, unknown and revoked keys get 401; lookups are cached; tenants recorded."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable

import pytest

from cli.main import main as cli
from daemon.state import TENANTS
from tests.daemon.helpers import LiveServer
from tests.daemon.tenants.helpers import add_tenant, complete


def test_keys_missing_unknown_and_revoked_get_401(db_url: str, capsys: pytest.CaptureFixture[str],
                                                  live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url, open_mode=False, tenant_cache_s=0.0)
    key = add_tenant(db_url, "team-a", capsys=capsys)
    status, body = complete(server, None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == "invalid_api_key" and "missing" in body["error"]["message"]
    assert complete(server, "xo-not-a-key")[0] == 401
    assert complete(server, key)[0] == 200
    assert cli(["tenants", "revoke", "team-a", "--db", db_url]) == 0  # from another "process"
    status, body = complete(server, key)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_key_lookups_are_cached(db_url: str, capsys: pytest.CaptureFixture[str],
                                live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url, open_mode=False)
    key = add_tenant(db_url, "team-a", capsys=capsys)
    for _ in range(3):
        assert complete(server, key)[0] == 200
        assert complete(server, "xo-wrong")[0] == 401
    assert server.app[TENANTS].db_lookups == 2  # one per distinct key


def test_requests_and_steps_are_recorded_with_their_tenant(
        db_url: str, capsys: pytest.CaptureFixture[str], live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url, open_mode=False)
    keys = {name: add_tenant(db_url, name, capsys=capsys) for name in ("team-a", "team-b")}
    for name, key in keys.items():
        for _ in range(2 if name == "team-a" else 1):
            assert complete(server, key, prompt=name)[0] == 200
    server.wait_idle()
    assert server.database is not None and server.database.recorder.flush(5.0)
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    rows = con.execute("SELECT tenant, COUNT(*) FROM xo_requests GROUP BY tenant").fetchall()
    tenants_in_steps = {t for (j,) in con.execute("SELECT tenants FROM xo_steps")
                        for t in json.loads(j)}
    con.close()
    assert dict(rows) == {"team-a": 2, "team-b": 1}
    assert tenants_in_steps == {"team-a", "team-b"}


def test_a_key_with_bytes_no_issued_key_holds_is_a_401_without_a_lookup(
        db_url: str, capsys: pytest.CaptureFixture[str], live: Callable[..., LiveServer]) -> None:
    """A \\xff byte (or any other non-ASCII character) in the bearer key: 401 invalid_api_key,
    not the 503 of a failed lookup, and the database is not asked."""
    server = live(db_url=db_url, open_mode=False, tenant_cache_s=0.0)
    key = add_tenant(db_url, "team-a", capsys=capsys)
    for bad in ("xo-\xff", key + "\xe9"):
        status, body = complete(server, bad)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    assert server.app[TENANTS].db_lookups == 0
    assert complete(server, key)[0] == 200 and server.app[TENANTS].db_lookups == 1

