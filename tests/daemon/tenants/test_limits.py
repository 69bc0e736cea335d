"""Per-tenant limits over HTTP: 429 past max_concurrent and max_queued, 400 past max_tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import aiohttp
import pytest

from daemon.settings import Settings
from daemon.state import GATES
from daemon.tenants.limits import TenantLimits, default_limits, limits_for
from engine.fake import FakeEngine
from tests.daemon.helpers import MODEL, LiveServer, http_request
from tests.daemon.tenants.helpers import SLOW, C, add_tenant, bearer, complete


def test_a_rows_own_limits_override_the_defaults() -> None:
    settings = Settings(max_tokens=100, tenant_max_queued=2)
    plain = SimpleNamespace(max_concurrent=3, max_queued=None, max_tokens=None)
    assert limits_for(plain, settings) == TenantLimits(3, 2, 100)
    own = SimpleNamespace(max_concurrent=None, max_queued=0, max_tokens=10)
    assert limits_for(own, settings) == TenantLimits(16, 0, 10)  # half of max_batch 32


def test_a_tenant_without_its_own_max_concurrent_gets_a_share_of_the_batch() -> None:
    row = SimpleNamespace(max_concurrent=None, max_queued=None, max_tokens=None)
    assert limits_for(row, Settings(max_batch=8)).max_concurrent == 4
    assert limits_for(row, Settings(max_batch=8, tenant_max_concurrent_share=0.3)).max_concurrent == 2
    assert limits_for(row, Settings(max_batch=1)).max_concurrent == 1
    assert limits_for(row, Settings(tenant_max_concurrent_share=None)).max_concurrent is None
    assert default_limits(Settings(max_batch=8)).max_concurrent is None  # open mode: every caller


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


def test_a_tenants_own_max_tokens_overrides_the_daemons(
        db_url: str, capsys: pytest.CaptureFixture[str], live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url, open_mode=False, max_tokens=100)
    small = add_tenant(db_url, "small", "--max-tokens", "8", capsys=capsys)
    big = add_tenant(db_url, "big", capsys=capsys)
    status, body = complete(server, small, max_tokens=9)
    assert status == 400
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "max_tokens_exceeded", "max_tokens")
    assert "max_tokens limit of 8" in error["message"]
    status, body = complete(server, small, prompt="x" * 40, max_tokens=8)
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 40}]}
    r = http_request(server.port, "POST", "/v1/chat/completions", chat, bearer(small))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 8  # unset: clamped
    status, body = complete(server, big, prompt="x" * 40, max_tokens=9)  # the daemon's 100
    assert status == 200 and body["usage"]["completion_tokens"] == 9
    assert complete(server, big, max_tokens=101)[0] == 400


def test_a_tenants_own_max_queued_overrides_the_daemons(
        db_url: str, capsys: pytest.CaptureFixture[str], live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=0.005), db_url=db_url, open_mode=False,
                  tenant_max_queued=0)
    queued = add_tenant(db_url, "queued", "--max-concurrent", "1", "--max-queued", "2",
                        capsys=capsys)
    plain = add_tenant(db_url, "plain", "--max-concurrent", "1", capsys=capsys)
    gates = server.app[GATES]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            async def post(key: str, **fields: object) -> aiohttp.ClientResponse:
                return await session.post(server.url + C, json={**SLOW, **fields},
                                          headers=bearer(key))

            running = await post(queued)
            await running.content.readline()
            waiting = [asyncio.create_task(post(queued, stream=False)) for _ in range(2)]
            while gates.in_flight().get("queued") != (1, 2):
                await asyncio.sleep(0.01)
            async with await post(queued) as refused:  # 1 runs, its 2 wait: the queue is full
                assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1
                error = (await refused.json())["error"]
                assert error["code"] == "tenant_concurrency_limit"
                assert "2 waiting" in error["message"]
            other = await post(plain)
            await other.content.readline()
            async with await post(plain) as no_queue:  # the daemon's tenant_max_queued=0
                assert no_queue.status == 429
            other.close()
            running.close()  # hands its slot to the first waiter, then the second
            for task in waiting:
                response = await task
                assert response.status == 200
                assert (await response.json())["usage"]["completion_tokens"] == 30

    asyncio.run(main())
    server.wait_idle()
    assert gates.in_flight() == {}
