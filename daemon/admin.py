"""The admin API under /admin/, behind `settings.admin_token`.

Every /admin/ path goes through `admin_middleware`, so a route cannot forget
the check: no admin token configured -> 403 `admin_disabled`; no bearer ->
401; any other bearer (a tenant's API key included) -> 403. The comparison is
`hmac.compare_digest` on bytes (constant time). Bodies are OpenAI-style
errors like the rest of the API. Wrong tokens are throttled per client address
(`GuessThrottle`): after GUESSES wrong ones within GUESS_WINDOW_S, that address
gets 429 `too_many_attempts` (Retry-After) for every admin check, right or
wrong, until the window has passed.

    GET    /admin/status           model, pool, queue, compiles, uptime, policy, recorder
    GET    /admin/tenants          every tenant (revoked ones too), never key hashes
    POST   /admin/tenants          {"name": ..., "max_concurrent": N, "max_queued": N,
                                    "max_tokens": N} (limits optional) -> 201, with the new api_key
    DELETE /admin/tenants/{name}   revoke
    POST   /admin/retune           start a retune, or get the running one (202, single-flight)
    GET    /admin/retunes          recent retunes;  GET /admin/retunes/{id}: one, with its phase
    GET    /admin/tuner            tuner config, serving policy, last search (fit error, Pareto)
    GET    /admin/policy           the serving policy and whether it is pinned
    PUT    /admin/policy/pin       serve this TunedPolicy dict over the tuner (400 invalid_policy
                                    naming the field in `param`: every type and range is checked)
    DELETE /admin/policy/pin       hand control back to the tuner (409 when nothing is pinned)
    POST   /admin/reset_prefix_cache  empty the prefix cache of the blocks no running request
                                    holds, between two steps -> {"dropped_blocks": n, "freed_pages":
                                    n, "enabled": bool} (503 while the engine is not serving)
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler
from sqlalchemy.orm import Session

from daemon import state as st
from daemon.bridge import EngineError
from daemon.database import Database
from daemon.errors import ApiError, bad_request
from daemon.request_body import decode_json_object, read_body
from daemon.tenants import admin_ops
from daemon.tenants.auth import bearer_token
from daemon.tuning import SCHEDULER, TUNER
from store.db import session_scope
from tuner.service import Tuner

PREFIX = "/admin/"
MAX_ADMIN_BODY = 64 * 1024
T = TypeVar("T")
GUESSES = 10
"""Wrong admin tokens one client address may send within GUESS_WINDOW_S."""
GUESS_WINDOW_S = 60.0
MAX_TRACKED = 10_000
"""Client addresses whose wrong guesses are remembered (the oldest go first)."""


class GuessThrottle:
    """Wrong admin-token guesses per client address, over a sliding window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._wrong: dict[str, list[float]] = {}

    def check(self, who: str) -> None:
        """429 while `who` has used up its guesses."""
        recent = self._recent(who)
        if len(recent) >= GUESSES:
            wait = max(1, int(recent[0] + GUESS_WINDOW_S - self._clock()) + 1)
            raise ApiError(429, f"too many wrong admin tokens from this address; retry in {wait} s",
                           code="too_many_attempts", headers={"Retry-After": str(wait)})

    def wrong(self, who: str) -> None:
        recent = self._recent(who)
        recent.append(self._clock())
        self._wrong[who] = recent
        while len(self._wrong) > MAX_TRACKED:
            del self._wrong[next(iter(self._wrong))]

    def _recent(self, who: str) -> list[float]:
        since = self._clock() - GUESS_WINDOW_S
        recent = [t for t in self._wrong.pop(who, []) if t > since]
        if recent:
            self._wrong[who] = recent  # most recently seen last, for the eviction above
        return recent


GUESSES_KEY = web.AppKey("admin_guesses", GuessThrottle)


def guessed(request: web.Request, right: bool) -> None:
    """Count a token check of this request's client: 429 while it has used up its guesses
    (before the answer to a right token too, so guessing on cannot find it), else note a
    wrong one."""
    throttle = request.app.get(GUESSES_KEY)
    if throttle is None:
        return
    who = request.remote or "?"
    throttle.check(who)
    if not right:
        throttle.wrong(who)

routes = web.RouteTableDef()


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison of two tokens (any characters)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))


def bearer_is_admin(request: web.Request) -> bool | None:
    """Whether the request's bearer is the admin token, the answer counted by the guess
    throttle (429 once an address has used up its wrong guesses); None when no admin token is
    set or the request carries no bearer. Every admin-token check goes through here."""
    expected, given = request.app[st.SETTINGS].admin_token, bearer_token(request)
    if not expected or given is None:
        return None
    right = token_matches(given, expected)
    guessed(request, right)
    return right


def check_admin(request: web.Request) -> None:
    """Raise 403/401 unless the request carries the admin token as its bearer."""
    if not request.app[st.SETTINGS].admin_token:
        raise ApiError(403, "the admin API is disabled (set admin_token)", code="admin_disabled")
    right = bearer_is_admin(request)
    if right is None:
        raise ApiError(401, "missing admin token (Authorization: Bearer ...)",
                       code="missing_admin_token")
    if not right:
        raise ApiError(403, "not the admin token", code="invalid_admin_token")


async def admin_body(request: web.Request) -> dict[str, Any]:
    """An admin route's JSON object body (at most MAX_ADMIN_BODY bytes, within body_timeout_s)."""
    return decode_json_object(await read_body(request, MAX_ADMIN_BODY,
                                              request.app[st.SETTINGS].body_timeout_s))


@web.middleware
async def admin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(PREFIX) or request.path == PREFIX.rstrip("/"):
        check_admin(request)
    return await handler(request)


def status_body(app: web.Application) -> dict[str, Any]:
    """What /admin/status (and the dashboard's header) shows."""
    engine, state, thread = app[st.ENGINE], app[st.STATE], app[st.ENGINE_THREAD]
    status = dict(engine.status())
    used, total = status.get("kv_pages_used", 0), status.get("kv_pages_total", 0)
    db = app.get(st.DATABASE)
    return {
        "model": engine.model_name,
        "instance": db.instance if db is not None else None,
        "uptime_s": round(time.time() - state.started_at, 3),
        "started_at": state.started_at,
        "ready": thread.ready, "draining": state.draining,
        "pool": {"pages_used": used, "pages_free": status.get("kv_pages_free", 0),
                 "pages_total": total, "used_fraction": round(used / total, 4) if total else None},
        "queue": {"waiting": status.get("waiting", 0), "running": status.get("running", 0),
                  "http_in_flight": state.in_flight, "engine_active": thread.active},
        "compiles": {"total": status.get("compile_count"),
                     "since_warmup": status.get("compiles_since_warmup")},
        "policy_version": status.get("policy_version"),
        "tenants_in_flight": {name: {"running": r, "waiting": w}
                              for name, (r, w) in app[st.GATES].in_flight().items()},
        "recorder": db.recorder.stats() if db is not None else None,
        "threads": threads(app),
    }


def threads(app: web.Application) -> dict[str, bool | None]:
    """Whether each long-lived worker of the daemon is running (None: this daemon has none)."""
    db, scheduler = app.get(st.DATABASE), app.get(SCHEDULER)
    return {"engine": app[st.ENGINE_THREAD].alive,
            "telemetry_recorder": db.recorder.running if db is not None else None,
            "tuner_scheduler": scheduler.running if scheduler is not None else None}


@routes.get("/admin/status")
async def admin_status(request: web.Request) -> web.Response:
    return web.json_response(status_body(request.app))


@routes.get("/admin/tenants")
async def list_tenants(request: web.Request) -> web.Response:
    def work(session: Session) -> list[dict[str, Any]]:
        return [admin_ops.describe(t) for t in admin_ops.list_tenants(session)]

    return web.json_response({"object": "list", "data": await _in_session(request, work)})


@routes.post("/admin/tenants")
async def add_tenant(request: web.Request) -> web.Response:
    body = await admin_body(request)
    name = body.pop("name", None)
    try:
        admin_ops.check_name(name)
        admin_ops.check_limits(body)
    except ValueError as exc:
        raise bad_request(str(exc), None, "invalid_value") from None

    def work(session: Session) -> dict[str, Any]:
        tenant, key = admin_ops.create_tenant(session, name, body)
        return {**admin_ops.describe(tenant), "api_key": key}

    try:
        created = await _in_session(request, work)
    except admin_ops.TenantExists as exc:
        raise ApiError(409, str(exc), param="name", code="tenant_exists") from None
    request.app[st.TENANTS].invalidate()
    return web.json_response(created, status=201)


@routes.delete("/admin/tenants/{name}")
async def revoke_tenant(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        revoked = await _in_session(
            request, lambda session: admin_ops.describe(admin_ops.revoke(session, name)))
    except LookupError as exc:
        raise ApiError(404, str(exc), code="tenant_not_found") from None
    request.app[st.TENANTS].invalidate()  # the key stops working now, not at the cache's TTL
    return web.json_response(revoked)


async def _in_session(request: web.Request, work: Callable[[Session], T]) -> T:
    """Run `work(session)` in a worker thread, committing on success."""
    db = _database(request)

    def run() -> T:
        with session_scope(db.engine) as session:
            return work(session)

    return await asyncio.to_thread(run)


def _database(request: web.Request) -> Database:
    db = request.app.get(st.DATABASE)
    if db is None:
        raise ApiError(503, "this daemon runs without a database", code="no_database")
    return db


# ---- the tuner: retunes and the policy (daemon.tuning) -------------------------
def _tuner(request: web.Request) -> Tuner:
    tuner = request.app.get(TUNER)
    if tuner is None:
        raise ApiError(503, "the tuner needs a telemetry database",
                       code="tuner_unavailable")
    return tuner


@routes.post("/admin/retune")
async def retune(request: web.Request) -> web.Response:
    """Start a retune, or return the running one (single-flight): 202 either way."""
    tuner = _tuner(request)
    view, started = await asyncio.to_thread(tuner.trigger, "admin")
    return web.json_response({"retune": view, "started": started}, status=202)


@routes.get("/admin/retunes")
async def list_retunes(request: web.Request) -> web.Response:
    tuner = _tuner(request)
    return web.json_response({"object": "list", "data": await asyncio.to_thread(tuner.recent)})


@routes.get("/admin/retunes/{id}")
async def get_retune(request: web.Request) -> web.Response:
    tuner = _tuner(request)
    try:
        retune_id = int(request.match_info["id"])
    except ValueError:
        raise ApiError(404, "retune ids are integers", code="retune_not_found") from None
    view = await asyncio.to_thread(tuner.get, retune_id)
    if view is None:
        raise ApiError(404, f"no retune {retune_id}", code="retune_not_found")
    return web.json_response(view)


@routes.get("/admin/tuner")
async def tuner_status(request: web.Request) -> web.Response:
    return web.json_response(_tuner(request).describe())


@routes.get("/admin/policy")
async def get_policy(request: web.Request) -> web.Response:
    keeper = _tuner(request).keeper
    serving = request.app[st.ENGINE].status().get("policy_version")
    return web.json_response({"policy": keeper.current.to_dict(), "pinned": keeper.pinned,
                              "engine_version": serving, "instance": keeper.instance})


@routes.put("/admin/policy/pin")
async def pin_policy(request: web.Request) -> web.Response:
    """Serve the body (a TunedPolicy dict) until unpinned; 400 when invalid or refused."""
    keeper = _tuner(request).keeper
    body = await admin_body(request)
    try:
        policy = await asyncio.to_thread(keeper.pin, body)
    except ValueError as exc:  # engine.policy.PolicyError names the field (e.g. rules[0].depth)
        raise bad_request(str(exc), getattr(exc, "field", None), "invalid_policy") from None
    return web.json_response({"policy": policy.to_dict(), "pinned": True})


@routes.delete("/admin/policy/pin")
async def unpin_policy(request: web.Request) -> web.Response:
    keeper = _tuner(request).keeper
    try:
        policy = await asyncio.to_thread(keeper.unpin)
    except LookupError as exc:
        raise ApiError(409, str(exc), code="not_pinned") from None
    return web.json_response({"policy": policy.to_dict(), "pinned": False})


# ---- the engine's prefix cache ----------------------------------------------------------
@routes.post("/admin/reset_prefix_cache")
async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Empty the prefix cache (as vLLM's POST /reset_prefix_cache), so that the next requests
    compute their prompts in full (a benchmark's cold-cache yardstick); blocks that running
    requests hold stay. Answers once the engine thread did it, between two steps."""
    thread = request.app[st.ENGINE_THREAD]
    try:
        dropped = await thread.reset_prefix_cache()
    except EngineError:
        raise ApiError(503, "the engine is not serving (warming up, failed or stopping)",
                       code="engine_unavailable") from None
    except TimeoutError:
        raise ApiError(503, "the engine reached no step boundary in time; the reset runs at the next one",
                       code="engine_busy") from None
    return web.json_response(dropped)
