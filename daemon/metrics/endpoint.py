"""The app's metrics registry and the `GET /metrics` route.

1. `install(app, model_name)` (from `make_app`) builds one `CollectorRegistry` for the
   app: the engine thread's `EngineMetrics` (returned, to be wired in as a Sink), the app's
   `DaemonCollector`, and prometheus_client's process and platform collectors
   (CPU seconds, resident memory, open fds, start time; Python version).
2. A scrape reads the retune counts from the database in a worker thread (when
   that fails, the last counts stand and `crossover_database_up` reads 0), then
   renders the registry on the event loop with the encoder that
   `prometheus_client.exposition.choose_encoder` picks from the Accept header:
   OpenMetrics (`application/openmetrics-text`) when the scraper asks for it,
   else the Prometheus text format (version 0.0.4). With the setting
   `metrics_require_admin` a scrape must carry the admin token as its bearer.
3. Tenant names show only to a scrape carrying the admin token: any other sees each
   `tenant` label as a pseudonym (a hash of the name; "default" as itself), so
   anyone who can reach the port learns how much traffic there is, not who sends it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from daemon import state as st
from daemon.admin import bearer_is_admin, check_admin
from daemon.metrics.collector import DaemonCollector, retune_counts
from daemon.metrics.sink import EngineMetrics

REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)
COLLECTOR = web.AppKey("metrics_collector", DaemonCollector)
log = logging.getLogger("crossover.metrics")


def install(app: web.Application, model_name: str) -> EngineMetrics:
    """Give `app` its registry (serve it with `metrics`); return the engine-thread sink, whose
    request histograms carry `model_name` (the engine's) as their `model_name` label."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    sink = EngineMetrics(registry, model_name)
    app[COLLECTOR] = DaemonCollector(app)
    registry.register(app[COLLECTOR])
    app[REGISTRY] = registry
    return sink


async def metrics(request: web.Request) -> web.Response:
    """The registry in the scraper's format; with `metrics_require_admin`, only for the admin token."""
    app = request.app
    if app[st.SETTINGS].metrics_require_admin:
        check_admin(request)  # 401 without a bearer, 403 with another one
    db = app.get(st.DATABASE)
    if db is not None:
        collector = app[COLLECTOR]
        try:
            collector.retunes = await asyncio.to_thread(retune_counts, db.engine, db.instance)
        except Exception as exc:  # down, locked, gone: the last counts stand
            if collector.database_up is not False:
                log.warning("/metrics cannot read the telemetry database (%s); serving the last retune "
                            "counts", type(exc).__name__)
            collector.database_up = False
        else:
            collector.database_up = True
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    registry = app[REGISTRY] if bearer_is_admin(request) else _Pseudonymous(app[REGISTRY])
    return web.Response(body=encode(registry), headers={"Content-Type": content_type})


def pseudonym(tenant: str) -> str:
    """How a scrape without the admin token names a tenant: "default" as itself, any other
    by a hash of its name, so its series stay apart without the name showing.

    >>> pseudonym("default"), pseudonym("acme-corp")
    ('default', 'tenant-f13fa37c')
    """
    if tenant == "default":
        return tenant
    return "tenant-" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:8]


class _Pseudonymous:
    """A registry's metrics with every `tenant` label value replaced by its pseudonym (what the
    encoders read: `collect()`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if not any("tenant" in sample.labels for sample in family.samples):
                yield family
                continue
            renamed = Metric(family.name, family.documentation, family.type, family.unit)
            renamed.samples = [sample._replace(labels={**sample.labels,
                                                       "tenant": pseudonym(sample.labels["tenant"])})
                               if "tenant" in sample.labels else sample for sample in family.samples]
            yield renamed
