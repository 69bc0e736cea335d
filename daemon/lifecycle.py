"""The daemon's lifecycle, from settings to exit code (`crossover serve` calls `run_daemon`):

1. bind the listening socket(s) first, so a port in use costs no model load
   (one line on stderr, exit 2);
2. open the telemetry database (settings.db_url, else $CROSSOVER_DB or ./crossover.db):
   an empty one gets the schema; one at an older schema revision is refused
   (exit 2) with the `crossover db upgrade --db URL` command to run;
3. load the engine (progress on stderr: a bar on a terminal, else JSON log
   events; a load error is one line on stderr, exit 2), build the app,
   start serving on the bound socket(s);
   the engine thread warms up meanwhile (/ready is 503 until plain decoding's
   and prefill's shapes are compiled or loaded); speculation's shapes then
   compile on a background thread, and each technique runs once its shapes are
   ready (/ready's engine.techniques: "compiling", then "ready"; engine/warmup/warm.py);
4. on SIGTERM or SIGINT: stop admitting (new requests get 503), let
   in-flight requests finish until the drain deadline, abort the rest;
   a second signal aborts at once;
5. shut the server down, stop the engine thread, flush telemetry, stop a
   background warmup still compiling (after the compile under way), exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

SHUTDOWN_GRACE_S = 2.0
"""Runner shutdown timeout once draining is over (idle connections only)."""
MALLOC_ARENAS = 2
"""glibc malloc arenas of the serving process (engine.runtime.compiles.limit_malloc_arenas): fewer
arenas keep less freed memory resident; the engine's steps run on one thread."""

log = logging.getLogger("crossover.serve")


@dataclass(frozen=True)
class FakeEngineOptions:
    """Serve engine.fake's FakeEngine instead of loading a model (tests and benches)."""

    step_ms: float = 0.0
    """Delay of each step."""
    warmup_s: float = 0.0
    """Delay of warmup."""
    speculation: bool = False
    """Give it fake n-gram and MTP proposers."""


def run_daemon(settings: Any, fake: FakeEngineOptions | None = None) -> int:
    """Steps 1 to 5 above; the exit code (2: the daemon could not start)."""
    sockets = bind(settings.host, settings.port)
    if sockets is None:
        return 2
    if fake is None:  # before XLA starts its threads
        from engine.runtime.compiles import limit_malloc_arenas

        limit_malloc_arenas(MALLOC_ARENAS)
    database = connect_database(settings, sockets[0].getsockname()[1])
    engine = None if database is None else _load_or_report(settings, fake)
    if engine is None:
        for sock in sockets:
            sock.close()
        if database is not None:
            database.engine.dispose()
        return 2
    return asyncio.run(serve(settings, engine, database=database, sockets=sockets))


def bind(host: str, port: int) -> list[socket.socket] | None:
    """Sockets bound to every address of host:port (as asyncio's server would bind them), or
    None after printing why not: checked before the model loads, then served from."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        print(f"crossover serve: error: cannot resolve host {host!r}: {exc.strerror}", file=sys.stderr)
        return None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        print(f"crossover serve: error: cannot listen on {host}:{port}: {exc.strerror or exc}",
              file=sys.stderr)
        return None
    return sockets


def _load_or_report(settings: Any, fake: FakeEngineOptions | None) -> Any:
    """The engine, or None after printing one line on why it could not be loaded."""
    try:
        return load_engine(settings, fake)
    except Exception as exc:  # any loader failure: missing file, bad weights, out of memory, ...
        log.debug("model load failed", exc_info=True)
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"crossover serve: error: cannot load the model {settings.model or '(the default)'}: "
              f"{type(exc).__name__}: {first}", file=sys.stderr)
        return None


def connect_database(settings: Any, port: int) -> Any:
    """The daemon's Database (instance: `settings.instance`, else host name:`port`, the port
    bound), or None after printing why it cannot be used."""
    from sqlalchemy.exc import SQLAlchemyError

    from daemon.database import default_instance, open_database
    from daemon.user_error import first_line
    from store.db import default_url
    from store.migrate import SchemaError

    url = settings.db_url or default_url()
    try:
        return open_database(url, instance=settings.instance or default_instance(port))
    except SchemaError as exc:
        print(f"crossover serve: error: {exc}", file=sys.stderr)
    except SQLAlchemyError as exc:
        print(f"crossover serve: error: cannot open the database: {first_line(exc)}",
              file=sys.stderr)
    return None


def load_engine(settings: Any, fake: FakeEngineOptions | None = None) -> Any:
    """The engine the settings name, or the fake engine `fake` describes."""
    from daemon.jsonlog import log_event

    if fake is not None:
        from engine import fake as fakes

        log_event(log, "using the fake engine", speculation=fake.speculation)
        spec = {"proposers": {"ngram": fakes.FakeProposer("ngram"),
                              "mtp": fakes.FakeProposer("mtp", (0.7, 0.6, 0.5, 0.4))},
                "cost": fakes.FakeCost()} if fake.speculation else {}
        return fakes.FakeEngine(max_batch=settings.max_batch, max_context=settings.max_context,
                                step_delay_s=fake.step_ms / 1000.0, warmup_delay_s=fake.warmup_s, **spec)
    from daemon.progress import reporter
    from engine.loader import load_engine  # heavy (jax): only here

    start = time.monotonic()
    log_event(log, "loading model", model=settings.model, dtype=settings.dtype, weights=settings.weights)
    engine = load_engine(model=settings.model, dtype=settings.dtype, weights=settings.weights,
                         kv_budget_bytes=settings.kv_budget_bytes,
                         memory_budget_bytes=settings.memory_budget_bytes, max_batch=settings.max_batch,
                         max_context=settings.max_context, token_budget=settings.token_budget,
                         progress=reporter(json_events=True),
                         speculation=settings.speculation, heads=settings.heads,
                         prefix_cache=settings.prefix_cache,
                         background_warmup=True,
                         **({"tensor_parallel": settings.tensor_parallel} if settings.tensor_parallel > 1
                            else {}))
    log_event(log, "model loaded", model=engine.model_name, seconds=round(time.monotonic() - start, 1))
    return engine


async def serve(settings: Any, engine: Any, sink: Any = None, database: Any = None,
                sockets: list[socket.socket] | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return the exit code.

    `sockets` (from `bind`) are served from; without them it binds settings.host:port itself.
    """
    from aiohttp import web

    from daemon.app import drain, make_app
    from daemon.connections import make_runner
    from daemon.jsonlog import log_event
    from daemon.progress import reporter
    from daemon.state import ENGINE_THREAD

    # warmup's progress: a terminal bar, else JSON log events (stderr stays one object per line)
    app = make_app(settings, engine, sink, database=database, warmup_progress=reporter(json_events=True))
    runner = make_runner(app, settings, SHUTDOWN_GRACE_S, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    exit_code = 0
    watcher = asyncio.create_task(_watch_engine(app[ENGINE_THREAD], stop))
    try:
        sites = ([web.SockSite(runner, sock) for sock in sockets] if sockets
                 else [web.TCPSite(runner, settings.host, settings.port)])
        for site in sites:
            await site.start()
        host, port = runner.addresses[0][:2]
        log_event(log, "listening", url=f"http://{host}:{port}", port=port, open_mode=settings.is_open)
        if settings.is_open and not _loopback(settings.host):
            log_event(log, "open mode on a non-loopback address: anyone who can reach it may use it",
                      level=logging.WARNING)
        _on_signals(lambda: stop.set())
        await stop.wait()
        exit_code = 1 if app[ENGINE_THREAD].failed is not None else 0
        _on_signals(lambda: app[ENGINE_THREAD].abort_all())  # a second signal aborts now
        await drain(app, settings.drain_deadline_s)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await runner.cleanup()
        await asyncio.to_thread(close_engine, engine)
    log_event(log, "stopped", exit_code=exit_code)
    return exit_code


async def _watch_engine(thread: Any, stop: asyncio.Event) -> None:
    """Log when the engine is ready; stop the daemon if the engine thread dies."""
    from daemon.jsonlog import log_event

    start = time.monotonic()
    while not thread.ready and thread.failed is None:
        await asyncio.sleep(0.05)
    if thread.ready:
        log_event(log, "ready", warmup_seconds=round(time.monotonic() - start, 2))
    while thread.failed is None:
        await asyncio.sleep(0.5)
    log_event(log, "engine thread failed; shutting down", level=logging.ERROR)
    stop.set()


def close_engine(engine: Any) -> None:
    """Stop the engine's background warmup (engine/warmup/warm.py), if one is still compiling."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _on_signals(callback: Any) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback)


def _loopback(host: str) -> bool:
    from daemon.settings import is_loopback

    return is_loopback(host)
