"""`/dashboard`: one page (daemon/static) drawn with plotly.js, and its JSON.

The charts are plotly.js, the bundle that the `plotly` Python package ships;
the daemon serves it from the installed package, so the page needs no CDN
and works offline.

Who may look:
- with `admin_token` set: whoever shows it — open `/dashboard?token=TOKEN`
  once; the daemon answers with a cookie (HttpOnly, SameSite=Strict, 12 hours'
  Max-Age, Secure over HTTPS; it holds its expiry and an HMAC derived from the
  token and that expiry, not the token itself, so the cookie stops working when
  it expires and cannot call /admin/) and redirects to `/dashboard`. The JSON
  also accepts the token as a bearer. Wrong tokens count toward the admin
  API's per-address throttle (daemon/admin.py).
- without `admin_token`: only a daemon in open mode bound to a loopback
  address shows it (to whoever can reach localhost); otherwise 403.

    GET /dashboard                       the page
    GET /dashboard/static/*              its script and style (no data, no check)
    GET /dashboard/lib/plotly.min.js     plotly.js from the installed `plotly` package (no check)
    GET /dashboard/api/status            as /admin/status, plus each technique's readiness
                                         (engine.techniques) and the speculation cap
    GET /dashboard/api/acceptance        acceptance over time by technique, tenant; by position
    GET /dashboard/api/batch             batch-size histogram
    GET /dashboard/api/goodput           goodput against batch size, crossover marked
    GET /dashboard/api/retunes           retune history with each chosen policy
The api routes take `?window_s=` (default 3600, at most 30 days) and
`?instance=NAME`: the daemon whose rows to show when several share the
database (default: this daemon's own; `all`: every instance's).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import importlib.resources
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from daemon import dashboard_data as data
from daemon import state as st
from daemon.admin import bearer_is_admin, guessed, status_body, token_matches
from daemon.errors import ApiError, bad_request
from daemon.settings import is_loopback
from store.db import session_scope

STATIC_DIR = Path(__file__).resolve().parent / "static"
PLOTLY_JS = "/dashboard/lib/plotly.min.js"
COOKIE = "crossover_dashboard"
SESSION_S = 12 * 3600
"""How long a dashboard cookie works (it is sent with Max-Age, and Secure over HTTPS)."""
DEFAULT_WINDOW_S = 3600.0
MAX_WINDOW_S = 30 * 86400.0
Reader = Callable[..., dict[str, Any]]
"""(session, since, until, instance=...) -> the JSON."""
ALL_INSTANCES = "all"

routes = web.RouteTableDef()


def cookie_value(admin_token: str, expires: int | None = None) -> str:
    """What the dashboard cookie holds: when it expires (Unix seconds, default SESSION_S from
    now) and HMAC-SHA256(admin token, a label and that time), so a copied cookie stops
    working then, and changing the token ends every session."""
    expires = int(time.time()) + SESSION_S if expires is None else expires
    mac = hmac.new(admin_token.encode("utf-8", "surrogatepass"), f"crossover-dashboard-v2:{expires}".encode(),
                   hashlib.sha256).hexdigest()
    return f"{expires}.{mac}"


def _cookie_ok(cookie: str, admin_token: str) -> bool:
    expires, _, _ = cookie.partition(".")
    if not expires.isdigit() or int(expires) <= time.time():
        return False
    return token_matches(cookie, cookie_value(admin_token, int(expires)))


def may_view(request: web.Request) -> bool:
    settings = request.app[st.SETTINGS]
    token = settings.admin_token
    if not token:
        return settings.is_open and is_loopback(settings.host)
    if bearer_is_admin(request):
        return True
    cookie = request.cookies.get(COOKIE)
    return cookie is not None and _cookie_ok(cookie, token)


@routes.get("/dashboard")
async def page(request: web.Request) -> web.StreamResponse:
    token = request.query.get("token")
    admin_token = request.app[st.SETTINGS].admin_token
    if token is not None:
        right = bool(admin_token) and token_matches(token, admin_token)
        guessed(request, right)
        if not right:
            return _refusal(403, "That is not the admin token.")
        # redirect, so the token leaves the address bar and the history
        response = web.Response(status=303, headers={"Location": "/dashboard"})
        response.set_cookie(COOKIE, cookie_value(admin_token), httponly=True, samesite="Strict",
                            path="/dashboard", max_age=SESSION_S, secure=request.secure)
        return response
    if not may_view(request):
        hint = ("Open /dashboard?token=ADMIN_TOKEN once." if admin_token else
                "Set admin_token, or run in open mode on a loopback address.")
        return _refusal(401 if admin_token else 403, hint)
    return web.FileResponse(STATIC_DIR / "dashboard.html",
                            headers={"Cache-Control": "no-store"})


def _refusal(status: int, message: str) -> web.Response:
    html = (f"<!doctype html><title>crossover dashboard</title>"
            f"<p>crossover dashboard: {message}</p>")
    return web.Response(status=status, text=html, content_type="text/html")


@functools.cache
def plotly_js_path() -> Path:
    """Where the installed `plotly` package keeps its plotly.js bundle."""
    path = Path(str(importlib.resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise FileNotFoundError(f"the plotly package has no plotly.js bundle at {path}")
    return path


@routes.get(PLOTLY_JS)
async def plotly_js(request: web.Request) -> web.StreamResponse:
    """The chart library (code, no data: no check); revalidated by ETag on each load."""
    return web.FileResponse(plotly_js_path(), headers={"Cache-Control": "no-cache"})


@routes.get("/dashboard/api/status")
async def api_status(request: web.Request) -> web.Response:
    _require_view(request)
    return web.json_response(status_with_techniques(request.app))


def status_with_techniques(app: web.Application) -> dict[str, Any]:
    """`status_body` plus "techniques" (technique -> "compiling", "ready", ...: engine/warmup/warm.py)
    and "speculation" ({"max_batch", "clamped"}) from the engine's status, where it has them."""
    engine = app[st.ENGINE].status()
    return {**status_body(app), "techniques": engine.get("techniques", {}),
            "speculation": engine.get("speculation")}


@routes.get("/dashboard/api/acceptance")
async def api_acceptance(request: web.Request) -> web.Response:
    return await _read(request, data.acceptance_over_time)


@routes.get("/dashboard/api/batch")
async def api_batch(request: web.Request) -> web.Response:
    return await _read(request, data.batch_histogram)


@routes.get("/dashboard/api/goodput")
async def api_goodput(request: web.Request) -> web.Response:
    return await _read(request, data.goodput_by_batch)


@routes.get("/dashboard/api/retunes")
async def api_retunes(request: web.Request) -> web.Response:
    return await _read(request, lambda session, _since, _until, instance: data.retunes(
        session, instance=instance))


def _require_view(request: web.Request) -> None:
    if not may_view(request):
        if request.app[st.SETTINGS].admin_token:
            raise ApiError(401, "the dashboard needs the admin token", code="dashboard_forbidden")
        raise ApiError(403, "the dashboard is off: no admin_token and not open on loopback",
                       code="dashboard_forbidden")


async def _read(request: web.Request, reader: Reader) -> web.Response:
    _require_view(request)
    db = request.app.get(st.DATABASE)
    if db is None:
        raise ApiError(503, "this daemon runs without a database", code="no_database")
    until = time.time()
    since = until - _window(request)
    instance = request.query.get("instance", db.instance)
    if instance == ALL_INSTANCES:
        instance = None

    def run() -> dict[str, Any]:
        with session_scope(db.engine) as session:
            return reader(session, since, until, instance=instance)

    return web.json_response(await asyncio.to_thread(run), headers={"Cache-Control": "no-store"})


def _window(request: web.Request) -> float:
    raw = request.query.get("window_s")
    if raw is None:
        return DEFAULT_WINDOW_S
    try:
        window = float(raw)
    except ValueError:
        window = float("nan")
    if not 60.0 <= window <= MAX_WINDOW_S:
        raise bad_request(f"window_s must be a number of seconds in [60, {MAX_WINDOW_S:.0f}], "
                          f"got {raw!r}", "window_s", "invalid_value")
    return window


def add_routes(app: web.Application) -> None:
    app.add_routes(routes)
    app.router.add_static("/dashboard/static/", STATIC_DIR)
