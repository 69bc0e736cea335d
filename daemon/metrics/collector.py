"""`DaemonCollector`: the /metrics values read from the app when it is scraped.

The engine's `status()` gives the gauges (KV pages, KV usage as a fraction
labelled with the model name, queue, running, policy version) and the compile
counters; the app's state gives the requests in flight, per tenant from the
tenant gates; the recorder gives its dropped rows; `daemon.admin.threads` whether each worker
thread runs.
Retunes by status come from the database (`store.history.retune_counts`,
this daemon's instance only: several daemons may share the database, and
each counts its own retunes), which is blocking: the /metrics route refreshes `retunes` in a worker thread
before each scrape, and `collect()` reports the last counts it was given.
`collect()` runs on the event loop, which owns the state it reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from daemon import state as st
from daemon.admin import threads
from daemon.metrics.sink import MODEL_LABEL, P
from store import history
from store.db import session_scope
from store.models import RETUNE_STATUSES

ENGINE_GAUGES = (  # (status() key, metric, help)
    ("kv_pages_used", "kv_pages_used", "KV pool pages in use."),
    ("kv_pages_free", "kv_pages_free", "KV pool pages free."),
    ("kv_pages_total", "kv_pages_total", "KV pool pages in all."),
    ("waiting", "num_requests_waiting", "Requests queued in the engine."),
    ("running", "num_requests_running", "Requests being decoded."),
    ("policy_version", "policy_version", "Version of the runtime policy in use."),
)


def kv_usage(status: dict[str, Any]) -> float:
    """KV pages in use over the pages tenants may use, within [0, 1] (0 with no pool).

    >>> kv_usage({"kv_pages_used": 3, "kv_pages_total": 12}), kv_usage({"kv_pages_total": 0})
    (0.25, 0.0)
    """
    total = status.get("kv_pages_total") or 0
    return min(1.0, max(0.0, (status.get("kv_pages_used") or 0) / total)) if total > 0 else 0.0


def retune_counts(db: Engine, instance: str = "") -> dict[str, int]:
    """The instance's retunes recorded in the database, by status (blocking: run in a
    thread)."""
    with session_scope(db) as session:
        return history.retune_counts(session, instance=instance)


def engine_metrics(status: dict[str, Any], model_name: str) -> list[Metric]:
    """Gauges from `engine.status()`; the compile count is a counter."""
    out: list[Metric] = [GaugeMetricFamily(P + name, text, value=status.get(key) or 0)
                         for key, name, text in ENGINE_GAUGES]
    usage = GaugeMetricFamily(P + "kv_cache_usage_perc",
                              "Fraction of the tenants' KV pages in use (1 means all).",
                              labels=[MODEL_LABEL])
    usage.add_metric([model_name], kv_usage(status))
    out.append(usage)
    out.append(CounterMetricFamily(P + "compiles", "XLA compilations since the start.",
                                   value=status.get("compile_count") or 0))
    if status.get("compiles_since_warmup") is not None:
        out.append(GaugeMetricFamily(
            P + "compiles_since_warmup",
            "XLA compilations after warmup (serving should never compile).",
            value=status["compiles_since_warmup"]))
    return out


class DaemonCollector(Collector):
    """Scrape-time values of one app (register it in that app's registry)."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self.retunes: dict[str, int] = {}
        """Retunes by status, as last read from the database by the /metrics route."""
        self.database_up: bool | None = None
        """Whether the route's last read of the database succeeded (None: none yet)."""

    def collect(self) -> Iterator[Metric]:
        app = self._app
        engine = app[st.ENGINE]
        yield from engine_metrics(engine.status(), engine.model_name)
        yield GaugeMetricFamily(P + "http_requests_in_flight", "Generation requests being handled.",
                                value=app[st.STATE].in_flight)
        yield CounterMetricFamily(P + "engine_restarts",
                                  "Engine-loop restarts after faults no request owned (device errors).",
                                  value=app[st.ENGINE_THREAD].restarts)
        tenants = GaugeMetricFamily(
            P + "tenant_requests_in_flight",
            "Requests of each tenant running in the daemon or waiting for a slot.",
            labels=["tenant", "state"])
        for tenant, (running, waiting) in sorted(app[st.GATES].in_flight().items()):
            tenants.add_metric([tenant, "running"], running)
            tenants.add_metric([tenant, "waiting"], waiting)
        yield tenants
        db = app.get(st.DATABASE)
        yield CounterMetricFamily(P + "recorder_dropped_rows",
                                  "Telemetry rows that never reached the database.",
                                  value=db.recorder.stats()["dropped"] if db is not None else 0)
        if self.database_up is not None:
            yield GaugeMetricFamily(P + "database_up", "1 when /metrics last read the telemetry database, "
                                    "0 when that read failed (the retune counts are then the last read).",
                                    value=int(self.database_up))
        up = GaugeMetricFamily(P + "thread_up", "1 while the daemon's worker runs, 0 once it has died.",
                               labels=["thread"])
        for name, alive in threads(app).items():
            if alive is not None:
                up.add_metric([name], int(alive))
        yield up
        retunes = CounterMetricFamily(P + "retunes", "Policy retunes recorded, by status.",
                                      labels=["status"])
        for status in RETUNE_STATUSES:
            retunes.add_metric([status], self.retunes.get(status, 0))
        yield retunes
