"""The admin API: only the admin token passes (compared in constant time); tenants over HTTP."""

from __future__ import annotations

import hmac
from collections.abc import Callable

import pytest

import daemon.admin
from tests.daemon.helpers import MODEL, LiveServer, http_request

TOKEN = "admin-secret-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def as_bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def add(server: LiveServer, body: object) -> tuple[int, dict]:
    r = server.post("/admin/tenants", body, ADMIN)
    return r.status, r.json()


def complete(server: LiveServer, key: str) -> int:
    return server.post("/v1/completions", {"model": MODEL, "prompt": "ab"}, as_bearer(key)).status


@pytest.fixture
def server(db_url: str, live: Callable[..., LiveServer]) -> LiveServer:
    return live(db_url=db_url, open_mode=False, admin_token=TOKEN)


def test_only_the_admin_token_passes(server: LiveServer) -> None:
    status, created = add(server, {"name": "team-a"})
    assert status == 201
    tenant_key = created["api_key"]
    assert complete(server, tenant_key) == 200
    for headers, want, code in [
        (None, 401, "missing_admin_token"),
        (as_bearer("wrong"), 403, "invalid_admin_token"),
        (as_bearer(tenant_key), 403, "invalid_admin_token"),
        (as_bearer(TOKEN + "x"), 403, "invalid_admin_token"),
        ({"Authorization": f"Basic {TOKEN}"}, 401, "missing_admin_token"),
    ]:
        for method, path in [("GET", "/admin/status"), ("GET", "/admin/tenants"),
                             ("DELETE", "/admin/tenants/team-a")]:
            r = http_request(server.port, method, path, None, headers)
            assert (r.status, r.json()["error"]["code"]) == (want, code), (method, path, headers)
    assert complete(server, tenant_key) == 200  # the DELETE attempts did nothing
    assert complete(server, TOKEN) == 401  # and the admin token is no tenant key


def test_the_admin_api_is_off_without_a_token(db_url: str, live: Callable[..., LiveServer]) -> None:
    server = live(db_url=db_url)
    r = server.get("/admin/status", ADMIN)
    assert r.status == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_tokens_are_compared_in_constant_time(server: LiveServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(daemon.admin.hmac, "compare_digest", spy)
    assert server.get("/admin/status", as_bearer("nope")).status == 403
    assert server.get("/admin/status", ADMIN).status == 200
    assert calls == [(b"nope", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


def test_status_reports_model_pool_queue_policy_and_recorder(server: LiveServer) -> None:
    assert complete(server, "unknown") == 401
    body = server.get("/admin/status", ADMIN).json()
    assert body["model"] == MODEL and body["ready"] is True and body["uptime_s"] >= 0
    assert body["pool"]["pages_total"] == 4096 and body["pool"]["pages_used"] == 0
    assert body["queue"] == {"waiting": 0, "running": 0, "http_in_flight": 0, "engine_active": 0}
    assert body["compiles"]["total"] == 0 and body["policy_version"] == 0
    recorder = body["recorder"]
    assert recorder["running"] is True and recorder["dropped"] == 0
    assert {"written_steps", "written_requests", "pending", "write_errors"} <= set(recorder)


def test_tenants_add_list_revoke_over_http(server: LiveServer) -> None:
    status, created = add(server, {"name": "team-a", "max_concurrent": 2})
    assert status == 201 and created["api_key"].startswith("xo-")
    assert created["max_concurrent"] == 2 and created["active"] is True
    assert add(server, {"name": "team-a"})[0] == 409
    assert add(server, {"name": "bad name"})[0] == 400
    assert add(server, {"name": "team-b", "max_concurrent": 0})[0] == 400
    assert add(server, {"name": "team-b", "max_tokens": 0})[0] == 400
    assert add(server, {"name": "team-b", "max_queued": -1})[0] == 400
    assert add(server, {"name": "team-b", "max_queued": True})[0] == 400
    for key in ("max_concurrent", "max_queued", "max_tokens"):  # past the INTEGER columns: 400, not 500
        assert add(server, {"name": "team-b", key: 2**31})[0] == 400
        assert add(server, {"name": "team-b", key: 10**400})[0] == 400
    assert add(server, {"name": "team-b", "flavour": 1})[0] == 400
    assert add(server, {"name": "default"})[0] == 400
    listing = server.get("/admin/tenants", ADMIN).json()["data"]
    assert [t["name"] for t in listing] == ["team-a"]
    assert (listing[0]["max_tokens"], listing[0]["max_queued"]) == (None, None)
    assert "api_key" not in listing[0] and "api_key_hash" not in listing[0]
    assert complete(server, created["api_key"]) == 200  # cached as valid now
    r = server.delete("/admin/tenants/team-a", ADMIN)
    assert r.status == 200 and r.json()["active"] is False
    assert complete(server, created["api_key"]) == 401  # at once, not after the cache's TTL
    assert server.delete("/admin/tenants/nobody", ADMIN).status == 404


def test_tenant_limits_set_over_http_apply_at_once(server: LiveServer) -> None:
    status, created = add(server, {"name": "team-c", "max_concurrent": 1, "max_queued": 0,
                                   "max_tokens": 4})
    assert status == 201
    assert [created[k] for k in ("max_concurrent", "max_queued", "max_tokens")] == [1, 0, 4]
    body = {"model": MODEL, "prompt": "abcdef", "max_tokens": 5}
    r = server.post("/v1/completions", body, as_bearer(created["api_key"]))
    assert r.status == 400 and r.json()["error"]["code"] == "max_tokens_exceeded"
    r = server.post("/v1/completions", {**body, "max_tokens": 4}, as_bearer(created["api_key"]))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_wrong_admin_tokens_are_throttled_per_address(live: Callable[..., LiveServer]) -> None:
    """GUESSES wrong tokens within the window: from then on that address gets 429 for every
    admin check, the right token included, so guessing on learns nothing; the dashboard's
    token and bearer and a /metrics bearer count the same."""
    from daemon.admin import GUESSES

    server = live(admin_token="right-token")
    wrong = {"Authorization": "Bearer not-it"}
    for i in range(GUESSES - 2):
        assert server.get("/admin/status", wrong).status == 403
    assert server.get("/metrics",
                      wrong).status == 200  # a guess too: its answer would show in the tenant names
    assert server.get("/dashboard?token=not-it").status == 403  # the last guess, by the dashboard
    r = server.get("/admin/status", {"Authorization": "Bearer right-token"})
    assert r.status == 429 and r.json()["error"]["code"] == "too_many_attempts"
    assert int(r.headers["retry-after"]) >= 1
    assert server.get("/dashboard/api/status", wrong).status == 429
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 2}).status == 200


def test_the_guess_window_slides() -> None:
    from daemon.admin import GUESS_WINDOW_S, GUESSES, GuessThrottle
    from daemon.errors import ApiError

    now = [0.0]
    throttle = GuessThrottle(clock=lambda: now[0])
    for _ in range(GUESSES):
        throttle.check("a")
        throttle.wrong("a")
    with pytest.raises(ApiError) as refused:
        throttle.check("a")
    assert refused.value.status == 429
    throttle.check("b")  # another address is not held up
    now[0] = GUESS_WINDOW_S + 0.1
    throttle.check("a")  # the window passed: guesses again

