"""`GET /metrics`: Prometheus text format, unauthenticated like vLLM's.

1. `EngineMetrics` (daemon.metrics_sink), a Sink on the engine thread, keeps
   the spec-decode counters (vLLM's names with the `crossover_` prefix),
   requests by tenant and finish reason, prompt/generation tokens per
   tenant, and the batch-size and step-time histograms.
2. A scrape snapshots those, reads the engine's `status()` for the gauges
   (KV pages, queue, running, policy version, compile count), the tenants'
   in-flight requests, the recorder's dropped rows, and the retunes table
   (in a worker thread), and renders them (daemon.exposition).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from sqlalchemy import Engine, func, select

from daemon import state as st
from daemon.exposition import CONTENT_TYPE, Family, render, single
from daemon.metrics_sink import P
from store.db import session_scope
from store.models import RETUNE_STATUSES, Retune

ENGINE_GAUGES = (  # (status() key, metric, help)
    ("kv_pages_used", "kv_pages_used", "KV pool pages in use."),
    ("kv_pages_free", "kv_pages_free", "KV pool pages free."),
    ("kv_pages_total", "kv_pages_total", "KV pool pages in all."),
    ("waiting", "num_requests_waiting", "Requests queued in the engine."),
    ("running", "num_requests_running", "Requests being decoded."),
    ("policy_version", "policy_version", "Version of the runtime policy in use."),
)


def engine_families(status: dict[str, Any]) -> list[Family]:
    """Gauges from `engine.status()`; the compile counter is a counter."""
    out = [single(P + name, "gauge", text, status.get(key) or 0)
           for key, name, text in ENGINE_GAUGES]
    compiles = status.get("compile_count") or 0
    out.append(single(P + "compiles_total", "counter", "XLA compilations since the start.", compiles))
    if status.get("compiles_since_warmup") is not None:
        out.append(single(P + "compiles_since_warmup", "gauge",
                          "XLA compilations after warmup (serving should never compile).",
                          status["compiles_since_warmup"]))
    return out


def retune_counts(db: Engine) -> dict[str, int]:
    """Retunes recorded in the database, by status (blocking: run in a thread)."""
    with session_scope(db) as session:
        rows = session.execute(select(Retune.status, func.count()).group_by(Retune.status))
        return {status: int(n) for status, n in rows}


def daemon_families(app: web.Application, retunes: dict[str, int]) -> list[Family]:
    state, gates = app[st.STATE], app[st.GATES]
    db = app.get(st.DATABASE)
    dropped = db.recorder.stats()["dropped"] if db is not None else 0
    retune_fam = Family(P + "retunes_total", "counter", "Policy retunes recorded, by status.")
    for status in RETUNE_STATUSES:
        retune_fam.add(retunes.get(status, 0), {"status": status})
    tenant_fam = Family(P + "tenant_requests_in_flight", "gauge",
                        "Requests of each tenant running in the daemon or waiting for a slot.")
    for tenant, (running, waiting) in sorted(gates.in_flight().items()):
        tenant_fam.add(running, {"tenant": tenant, "state": "running"})
        tenant_fam.add(waiting, {"tenant": tenant, "state": "waiting"})
    return [
        single(P + "http_requests_in_flight", "gauge", "Generation requests being handled.",
               state.in_flight),
        tenant_fam,
        single(P + "recorder_dropped_rows_total", "counter",
               "Telemetry rows that never reached the database.", dropped),
        retune_fam,
    ]


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    db = app.get(st.DATABASE)
    retunes = await asyncio.to_thread(retune_counts, db.engine) if db is not None else {}
    families = (app[st.METRICS].families() + engine_families(app[st.ENGINE].status())
                + daemon_families(app, retunes))
    return web.Response(body=render(families).encode(), headers={"Content-Type": CONTENT_TYPE})
