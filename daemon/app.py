"""The aiohttp application: `make_app(settings, engine, database=...)` and its lifecycle.

Routes: the OpenAI-compatible API (daemon.openai_api; vLLM's /tokenize, /detokenize and
/tokenizer_info in daemon.tokenize_api), /health (the process
and its engine thread are alive), /ready (warmed up and not draining),
/metrics (daemon.metrics), /admin/* (daemon.admin) and /dashboard
(daemon.dashboard).

The engine thread's telemetry fans out (daemon.telemetry_sink) to the
/metrics counters, to the database's Recorder when there is a database, and
to the caller's sink if any. Resources are aiohttp cleanup contexts,
started in order and closed in reverse: the database (its recorder) first,
then the engine thread, which at shutdown drains and flushes into the
still-open recorder before the recorder writes its last rows and closes,
then the tuner (daemon.tuning: policy restore, periodic retune job), which
closes first.
`drain(app, deadline_s)` is what SIGTERM runs before the runner shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler

from daemon import dashboard, jsonlog, openai_api, tokenize_api, tuning
from daemon import state as st
from daemon.admin import GUESSES_KEY, GuessThrottle, admin_middleware
from daemon.admin import routes as admin_routes
from daemon.bridge import EngineThread
from daemon.connections import origin_middleware, quiet_malformed_requests
from daemon.database import Database
from daemon.engine_surface import Engine, Sink
from daemon.errors import error_middleware
from daemon.metrics import endpoint as metrics_endpoint
from daemon.settings import Settings
from daemon.telemetry_sink import FanoutSink, RecorderSink
from daemon.tenants.auth import AUTH, Authenticator, TenantDirectory
from daemon.tenants.gate import TenantGates
from daemon.tenants.limits import default_limits
from engine.runtime.progress import Reporter

log = logging.getLogger("crossover.daemon")
request_log = logging.getLogger("crossover.request")

ABORT_WAIT_S = 5.0
"""After aborting at the drain deadline, how long handlers get to finish."""


def make_app(
    settings: Settings,
    engine: Engine,
    sink: Sink | None = None,
    *,
    database: Database | None = None,
    warmup: bool = True,
    warmup_progress: Reporter = False,
) -> web.Application:
    """The daemon's application; the engine thread (and the recorder) start with the app.

    Without `database` there is no telemetry in SQL, no tenant keys (a closed
    daemon then refuses every key) and the tenant and dashboard data routes
    answer 503.
    """
    quiet_malformed_requests()
    app = web.Application(
        middlewares=[_log_middleware, error_middleware, origin_middleware, admin_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[st.SETTINGS] = settings
    app[st.METRICS] = metrics_endpoint.install(app, engine.model_name)
    sinks: list[Sink] = [app[st.METRICS], *_attach_database(app, database)]
    thread = EngineThread(engine, FanoutSink([*sinks, *([sink] if sink else [])]),
                          warmup=warmup, warmup_progress=warmup_progress,
                          max_restarts=settings.engine_max_restarts,
                          restart_backoff_s=settings.engine_restart_backoff_s)
    app[st.ENGINE] = engine
    app[st.ENGINE_THREAD] = thread
    app[st.SINK] = thread.sink
    app[st.GATES] = TenantGates()
    app[GUESSES_KEY] = GuessThrottle()
    app[st.STATE] = st.ServerState()
    app[AUTH] = Authenticator(settings.is_open, default_limits(settings), app.get(st.TENANTS))
    app.cleanup_ctx.append(_engine_thread_ctx)
    if database is not None:
        tuning.install(app, database)  # after the engine thread's context: it closes first
    _add_routes(app)
    return app


def _attach_database(app: web.Application, database: Database | None) -> list[Sink]:
    """Install the database, its tenant directory and its lifecycle; return its sinks."""
    if database is None:
        return []
    app[st.DATABASE] = database
    app[st.TENANTS] = TenantDirectory(database.engine, app[st.SETTINGS])
    app.cleanup_ctx.append(_database_ctx)  # before the engine thread's: it closes after it
    return [RecorderSink(database.recorder)]


def _add_routes(app: web.Application) -> None:
    app.add_routes(openai_api.routes)
    app.add_routes(tokenize_api.routes)
    app.add_routes(admin_routes)
    dashboard.add_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_endpoint.metrics)


async def _database_ctx(app: web.Application) -> AsyncIterator[None]:
    database = app[st.DATABASE]
    database.start()
    yield
    await asyncio.to_thread(database.close)


async def _engine_thread_ctx(app: web.Application) -> AsyncIterator[None]:
    thread = app[st.ENGINE_THREAD]
    thread.start()
    yield
    await thread.stop(drain_deadline_s=0.0 if app[st.STATE].draining else app[st.SETTINGS].drain_deadline_s)


async def health(request: web.Request) -> web.Response:
    """200 while the engine thread is alive ("restarting" while it waits out a fault's backoff);
    503 once it has failed for good, and 503 "stalled" while one engine step (or idle first
    run) has been under way longer than `step_deadline_s`: a hung device call, which leaves
    the thread alive. `engine_restarts` counts the loop's restarts after faults."""
    thread = request.app[st.ENGINE_THREAD]
    if thread.failed is not None:
        return web.json_response({"status": "failed", "error": "the engine thread failed; see the server log",
                                  "engine_restarts": thread.restarts}, status=503)
    busy = thread.busy_for
    if busy > request.app[st.SETTINGS].step_deadline_s:
        return web.json_response({"status": "stalled", "error": f"an engine step has run for {busy:.0f} s",
                                  "step_seconds": round(busy, 1), "engine_restarts": thread.restarts},
                                 status=503)
    status = "restarting" if thread.restarting else "ok"
    return web.json_response({"status": status, "engine_restarts": thread.restarts})


async def ready(request: web.Request) -> web.Response:
    """200 once warmed up and while admitting requests, else 503."""
    app = request.app
    thread, state = app[st.ENGINE_THREAD], app[st.STATE]
    is_ready = thread.ready and not state.draining
    status = "ready" if is_ready else ("draining" if state.draining else "starting")
    body = {"status": status, "in_flight": state.in_flight, "engine": app[st.ENGINE].status()}
    return web.json_response(body, status=200 if is_ready else 503)


@web.middleware
async def _log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count in-flight generation requests; log one JSON line per API request."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    state = request.app[st.STATE]
    start = time.monotonic()
    status = 499  # the client went away first
    state.in_flight += 1
    try:
        response = await handler(request)
        status = 499 if st.request_record(request).get("client_gone") else response.status
        return response
    finally:
        state.in_flight -= 1
        record = st.request_record(request)
        jsonlog.log_event(request_log, "request", method=request.method, path=request.path,
                          status=status, duration_ms=jsonlog.ms_since(start), **record)


async def drain(app: web.Application, deadline_s: float) -> bool:
    """Stop admitting, let in-flight requests finish until the deadline, abort the rest.

    Returns True when everything finished without aborting.
    """
    state, thread = app[st.STATE], app[st.ENGINE_THREAD]
    state.draining = True
    state.drain_started.set()
    jsonlog.log_event(log, "draining", in_flight=state.in_flight, deadline_s=deadline_s)
    if await _wait_idle(state, deadline_s):
        return True
    aborted = thread.abort_all()
    jsonlog.log_event(log, "drain deadline passed", level=logging.WARNING, aborted=aborted)
    await _wait_idle(state, ABORT_WAIT_S)
    return False


async def _wait_idle(state: st.ServerState, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while state.in_flight and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return state.in_flight == 0
