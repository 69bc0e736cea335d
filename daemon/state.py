"""Typed application state (`web.AppKey`s) and the admission checks that read it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from daemon.bridge import EngineThread
from daemon.database import Database
from daemon.engine_surface import Engine, Sink
from daemon.errors import ApiError
from daemon.metrics.sink import EngineMetrics
from daemon.settings import Settings
from daemon.tenants.auth import TenantDirectory
from daemon.tenants.gate import TenantGates


@dataclass
class ServerState:
    """Mutable lifecycle state, touched only on the event loop."""

    started_at: float = field(default_factory=time.time)
    draining: bool = False
    """Set at SIGTERM: new generation requests get 503, /ready turns 503."""
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set with `draining`: a request still reading its body stops there with the 503."""
    in_flight: int = 0
    """Generation requests being handled right now."""


SETTINGS = web.AppKey("settings", Settings)
ENGINE = web.AppKey("engine", Engine)
"""The EngineCore (or FakeEngine): tokenizer, model_name, max_context."""
ENGINE_THREAD = web.AppKey("engine_thread", EngineThread)
SINK = web.AppKey("sink", Sink)
STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", EngineMetrics)
"""Counters behind /metrics, fed by the engine thread."""
GATES = web.AppKey("gates", TenantGates)
DATABASE = web.AppKey("database", Database)
"""Absent when the app runs without a telemetry database (some tests)."""
TENANTS = web.AppKey("tenants", TenantDirectory)
"""API-key directory; absent without a database."""

_RECORD: Any = web.RequestKey("record", dict) if hasattr(web, "RequestKey") else "crossover.record"
RETRY_AFTER_S = "1"


def request_record(request: web.Request) -> dict[str, Any]:
    """The dict whose fields end up in this request's log line."""
    record = request.get(_RECORD)
    if record is None:
        record = request[_RECORD] = {}
    return record


def check_admission(app: web.Application) -> None:
    """503 while draining, warming up, or after the engine failed."""
    thread = app[ENGINE_THREAD]
    if app[STATE].draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    if thread.failed is not None:
        raise ApiError(503, "the engine has failed; see the server log", code="engine_failed")
    if not thread.ready:
        raise ApiError(503, "the engine is warming up", code="warming_up",
                       headers={"Retry-After": RETRY_AFTER_S})


def check_capacity(app: web.Application) -> None:
    """429 when max_batch running plus max_waiting queued requests are taken."""
    limit = app[SETTINGS].max_in_flight
    if app[ENGINE_THREAD].engine_active >= limit:
        raise ApiError(429, f"the server is at capacity ({limit} requests in flight); retry later",
                       code="queue_full", headers={"Retry-After": RETRY_AFTER_S})
