"""Tenants: keys from the CLI, 401s, per-tenant 429 and 400, every request recorded per tenant."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from types import SimpleNamespace

import aiohttp
import pytest

from daemon.cli import main as cli
from daemon.settings import Settings
from daemon.state import GATES, TENANTS
from daemon.tenant_limits import TenantLimits, limits_for
from engine.fake import FakeEngine
from tests.daemon.daemon_helpers import MODEL, LiveServer, http_request

C = "/v1/completions"
SLOW = {"model": MODEL, "prompt": "s" * 30, "max_tokens": 30, "stream": True}


def add_tenant(db_url: str, name: str, *flags: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli(["tenants", "add", name, "--db", db_url, *flags]) == 0
    out = capsys.readouterr()
    assert "shown only now" in out.err
    return out.out.strip()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(server: LiveServer, key: str | None, **fields: object) -> tuple[int, dict]:
    headers = bearer(key) if key is not None else None
    r = http_request(server.port, "POST", C, {"model": MODEL, "prompt": "abc", **fields}, headers)
    return r.status, r.json()


def test_cli_add_list_revoke(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["db", "upgrade", "--db", db_url]) == 0
    capsys.readouterr()
    key = add_tenant(db_url, "team-a", "--max-concurrent", "4", capsys=capsys)
    assert key.startswith("xo-") and len(key) > 40
    assert cli(["tenants", "add", "team-a", "--db", db_url]) == 2  # names are unique
    assert "already exists" in capsys.readouterr().err
    assert cli(["tenants", "add", "default", "--db", db_url]) == 2  # the open-mode tenant
    assert cli(["tenants", "list", "--db", db_url]) == 0
    listing = capsys.readouterr().out
    assert "team-a" in listing and " 4 " in listing and key not in listing
    assert cli(["tenants", "revoke", "team-a", "--db", db_url]) == 0
    assert cli(["tenants", "revoke", "nobody", "--db", db_url]) == 2
    capsys.readouterr()
    assert cli(["tenants", "list", "--json", "--db", db_url]) == 0
    assert '"active": false' in capsys.readouterr().out


def test_cli_refuses_a_database_without_the_schema(db_url: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["tenants", "list", "--db", db_url]) == 2
    assert f"crossover db upgrade --db {db_url}" in capsys.readouterr().err


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


def test_tenant_over_its_concurrency_gets_429_others_do_not(
        db_url: str, capsys: pytest.CaptureFixture[str], live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=0.01), db_url=db_url, open_mode=False)
    small = add_tenant(db_url, "small", "--max-concurrent", "1", capsys=capsys)
    other = add_tenant(db_url, "other", capsys=capsys)

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            first = await session.post(server.url + C, json=SLOW, headers=bearer(small))
            assert first.status == 200
            await first.content.readline()  # it is running
            async with session.post(server.url + C, json=SLOW, headers=bearer(small)) as second:
                assert second.status == 429 and int(second.headers["Retry-After"]) >= 1
                error = (await second.json())["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error",
                                                          "tenant_concurrency_limit")
            async with session.post(server.url + C, json=SLOW, headers=bearer(other)) as third:
                assert third.status == 200
                await third.read()
            first.close()

    asyncio.run(main())
    server.wait_idle()
    assert complete(server, small)[0] == 200  # the slot came back


def test_tenant_requests_queue_up_to_max_queued(
        db_url: str, capsys: pytest.CaptureFixture[str], live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=0.005), db_url=db_url, open_mode=False,
                  tenant_max_queued=1)
    key = add_tenant(db_url, "small", "--max-concurrent", "1", capsys=capsys)
    gates = server.app[GATES]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            first = await session.post(server.url + C, json=SLOW, headers=bearer(key))
            await first.content.readline()  # running
            waiting = asyncio.create_task(
                session.post(server.url + C, json={**SLOW, "stream": False}, headers=bearer(key)))
            while gates.in_flight().get("small") != (1, 1):
                await asyncio.sleep(0.01)
            async with session.post(server.url + C, json=SLOW, headers=bearer(key)) as third:
                assert third.status == 429  # one runs, one waits: the queue is full
            first.close()  # its slot goes to the waiting request
            second = await waiting
            assert second.status == 200
            assert (await second.json())["choices"][0]["text"] == "s" * 30

    asyncio.run(main())
    server.wait_idle()
    assert [r.finish_reason for r in server.sink.results] == ["abort", "length"]


def test_over_the_tenant_max_tokens_is_400(db_url: str, capsys: pytest.CaptureFixture[str],
                                           live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url, open_mode=False, max_tokens=8)
    key = add_tenant(db_url, "team-a", capsys=capsys)
    status, body = complete(server, key, max_tokens=9)
    assert status == 400 and body["error"]["code"] == "max_tokens_exceeded"
    assert body["error"]["param"] == "max_tokens"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 40}]}
    r = http_request(server.port, "POST", "/v1/chat/completions", chat, bearer(key))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 8  # unset: clamped
    assert server.sink.results and all(res.tenant == "team-a" for res in server.sink.results)


def test_a_rows_own_limits_override_the_defaults() -> None:
    settings = Settings(max_tokens=100, tenant_max_queued=2)
    plain = SimpleNamespace(max_concurrent=3)
    assert limits_for(plain, settings) == TenantLimits(3, 2, 100)
    own = SimpleNamespace(max_concurrent=None, max_queued=0, max_tokens=10)
    assert limits_for(own, settings) == TenantLimits(None, 0, 10)
