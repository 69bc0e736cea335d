"""`crossover serve`: load the engine, serve HTTP, drain on SIGTERM.

Settings come from flags > CROSSOVER_* environment > --config TOML >
defaults (daemon.settings). Lifecycle:

1. bind the listening socket(s) first, so a port in use costs no model load
   (one line on stderr, exit 2);
2. open the telemetry database (--db, else $CROSSOVER_DB or ./crossover.db):
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
   in-flight requests finish until --drain-deadline, abort the rest;
   a second signal aborts at once;
5. shut the server down, stop the engine thread, flush telemetry, stop a
   background warmup still compiling (after the compile under way), exit 0.

/metrics is unauthenticated, as in vLLM, unless --metrics-require-admin puts
it behind the admin token. The admin token is best given by
--admin-token-file or CROSSOVER_ADMIN_TOKEN: on the command line it is
visible in the process list (a warning is logged).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from daemon.settings import SECTION_KEYS, add_section_flags

SETTING_FLAGS = (
    "host", "port", "model", "served_model_name", "dtype", "kv_budget_bytes", "max_batch", "max_context", "db_url",
    "instance", "tensor_parallel", "prefix_cache",
    "max_body_bytes", "max_prompt_chars", "max_waiting", "drain_deadline_s",
    "log_level", "admin_token", "open_mode", "max_tokens", "tenant_max_queued", "tenant_cache_s",
    "speculation", "heads", "stream_write_timeout_s", "stream_idle_timeout_s", "admin_token_file",
    "metrics_require_admin", "open_non_loopback", "tenant_max_concurrent_share",
    "engine_max_restarts", "engine_restart_backoff_s", *SECTION_KEYS,
)
SHUTDOWN_GRACE_S = 2.0
"""Runner shutdown timeout once draining is over (idle connections only)."""
MALLOC_ARENAS = 2
"""glibc malloc arenas of the serving process (engine.runtime.compiles.limit_malloc_arenas): fewer
arenas keep less freed memory resident; the engine's steps run on one thread."""

log = logging.getLogger("crossover.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--config", metavar="FILE",
        help="TOML file of settings (key = value, named like the fields; a [tuner] table)")
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="TCP port (default 8000; 0 picks a free one)")
    add("model_arg", nargs="?", metavar="MODEL", help="model id or path, as vLLM's positional (same as --model)")
    add("--model", help="model id or path (default: the engine's)")
    add("--served-model-name", nargs="+", metavar="NAME",
        help="names clients may send as `model`; answers carry the first (default: the model's own)")
    add("--dtype", help="weight/activation dtype (default: the engine's)")
    add("--kv-budget", dest="kv_budget_bytes", metavar="BYTES", help="KV pool size, e.g. 4GiB")
    add("--max-batch", "--max-num-seqs", dest="max_batch", type=int, help="most sequences decoded together")
    add("--max-context", "--max-model-len", dest="max_context", type=int,
        help="longest prompt + completion in tokens")
    add("--tensor-parallel", type=int, metavar="N",
        help="split the model and KV pool over N devices (default 1)")
    add("--db", "--db-url", dest="db_url", metavar="URL",
        help="SQLAlchemy URL or SQLite path of the telemetry database "
             "(default: $CROSSOVER_DB or ./crossover.db)")
    add("--instance", metavar="NAME",
        help="this daemon's name among those sharing the database: its telemetry rows, policies "
             "and retunes (default: host name:port)")
    add("--speculation", action=argparse.BooleanOptionalAction, default=None,
        help="compile verification and load the draft proposers (default on)")
    add("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
        help="share the KV pages of common prompt prefixes between requests (default on)")
    add("--heads", metavar="FILE", help="draft heads file (default: the one train-heads wrote to the user "
                                        "cache, else the one shipped for the model)")
    add("--max-body-bytes", metavar="BYTES", help="largest request body (default 4MiB)")
    add("--max-prompt-chars", type=int, help="longest prompt in characters")
    add("--max-waiting", type=int, help="queued requests beyond max-batch before 429 (default 256)")
    add("--drain-deadline", dest="drain_deadline_s", type=float, metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may finish (default 30)")
    add("--stream-write-timeout", dest="stream_write_timeout_s", type=float, metavar="SECONDS",
        help="abort a stream when one write waits this long for a client that is not reading "
             "(default 30)")
    add("--stream-idle-timeout", dest="stream_idle_timeout_s", type=float, metavar="SECONDS",
        help="abort a stream whose client takes none of the bytes waiting for it this long (default 60)")
    add("--engine-max-restarts", type=int, metavar="N",
        help="in-process restarts of the engine loop after faults no request owns, before the "
             "daemon exits (default 3)")
    add("--engine-restart-backoff", dest="engine_restart_backoff_s", type=float, metavar="SECONDS",
        help="wait before the first engine loop restart, doubling each time (default 0.5)")
    add("--log-level", choices=("debug", "info", "warning", "error"))
    add("--admin-token", help="bearer token for /admin/* (visible in the process list: prefer "
                              "--admin-token-file or CROSSOVER_ADMIN_TOKEN)")
    add("--admin-token-file", metavar="FILE", help="file whose first line is the admin token")
    add("--metrics-require-admin", action=argparse.BooleanOptionalAction, default=None,
        help="serve /metrics only to the admin token (default off: anyone, as in vLLM)")
    add("--open", dest="open_mode", action=argparse.BooleanOptionalAction, default=None,
        help="serve without API keys (default: only when bound to loopback)")
    add("--open-non-loopback", action=argparse.BooleanOptionalAction, default=None,
        help="accept --open on a non-loopback host: anyone who reaches the port may use it")
    add("--max-tokens", type=int, metavar="N",
        help="most completion tokens per request (a tenant's own limit overrides it)")
    add("--tenant-max-queued", type=int, metavar="N",
        help="requests of one tenant that may wait past its max-concurrent (default 0)")
    add("--tenant-max-concurrent-share", type=float, metavar="X",
        help="share of max-batch a keyed tenant without its own max-concurrent may have in flight "
             "(default 0.5; none: no limit)")
    add("--tenant-cache-s", type=float, metavar="SECONDS",
        help="how long API key lookups are cached (default 5)")
    add_section_flags(p.add_argument_group(
        "tuner", "the [tuner] section of the config file; also CROSSOVER_TUNER_<FIELD>"))
    add("--fake-engine", action="store_true", help=argparse.SUPPRESS)
    add("--fake-step-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    add("--fake-warmup-s", type=float, default=0.0, help=argparse.SUPPRESS)
    add("--fake-speculation", action="store_true", help=argparse.SUPPRESS)
    _show_defaults(p)


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Append each setting's default to its flag's help, unless the help names one already."""
    from daemon.settings import Settings

    defaults = {f.name: f.default for f in dataclasses.fields(Settings) if f.default is not dataclasses.MISSING}
    for action in p._actions:
        value = defaults.get(action.dest, None)
        if action.help and action.help != argparse.SUPPRESS and "default" not in action.help and value is not None:
            action.help += f" (default {value})"


def _vllm_spellings(args: argparse.Namespace) -> str | None:
    """Fold vLLM's spellings into the settings' flags; the error, when they contradict."""
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            return f"the model is given twice: {args.model_arg!r} and --model {args.model!r}"
        args.model = args.model_arg
    if args.served_model_name is not None:
        names = [n.strip() for n in args.served_model_name]
        if not all(names) or any("," in n for n in names) or len(set(names)) != len(names):
            return f"--served-model-name {args.served_model_name!r}: names must be distinct, non-empty, without commas"
        args.served_model_name = ",".join(names)
    return None


def run(args: argparse.Namespace) -> int:
    from daemon import jsonlog
    from daemon.settings import SettingsError, load_settings

    problem = _vllm_spellings(args)
    if problem is not None:
        print(f"crossover serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        settings = load_settings({k: getattr(args, k) for k in SETTING_FLAGS}, os.environ, args.config)
    except SettingsError as exc:
        print(f"crossover serve: error: {exc}", file=sys.stderr)
        return 2
    jsonlog.configure(settings.log_level)
    if args.admin_token is not None:
        jsonlog.log_event(log, "the admin token was given on the command line, where other users can "
                          "read it; use --admin-token-file or CROSSOVER_ADMIN_TOKEN",
                          level=logging.WARNING)
    sockets = bind(settings.host, settings.port)
    if sockets is None:
        return 2
    if not args.fake_engine:  # before XLA starts its threads
        from engine.runtime.compiles import limit_malloc_arenas

        limit_malloc_arenas(MALLOC_ARENAS)
    database = _open_database(settings, sockets[0].getsockname()[1])
    engine = None if database is None else _load_or_report(settings, args)
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


def _load_or_report(settings: Any, args: argparse.Namespace) -> Any:
    """The engine, or None after printing one line on why it could not be loaded."""
    try:
        return _load_engine(settings, args)
    except Exception as exc:  # any loader failure: missing file, bad weights, out of memory, ...
        log.debug("model load failed", exc_info=True)
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"crossover serve: error: cannot load the model {settings.model or '(the default)'}: "
              f"{type(exc).__name__}: {first}", file=sys.stderr)
        return None


def _open_database(settings: Any, port: int) -> Any:
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


def _load_engine(settings: Any, args: argparse.Namespace) -> Any:
    from daemon.jsonlog import log_event

    if args.fake_engine:
        from engine.fake import FakeCost, FakeEngine, FakeProposer

        log_event(log, "using the fake engine", speculation=args.fake_speculation)
        spec = {"proposers": {"ngram": FakeProposer("ngram"),
                              "mtp": FakeProposer("mtp", (0.7, 0.6, 0.5, 0.4))},
                "cost": FakeCost()} if args.fake_speculation else {}
        return FakeEngine(max_batch=settings.max_batch, max_context=settings.max_context,
                          step_delay_s=args.fake_step_ms / 1000.0,
                          warmup_delay_s=args.fake_warmup_s, **spec)
    from daemon.progress import reporter
    from engine.loader import load_engine  # heavy (jax): only here

    start = time.monotonic()
    log_event(log, "loading model", model=settings.model, dtype=settings.dtype)
    engine = load_engine(model=settings.model, dtype=settings.dtype,
                         kv_budget_bytes=settings.kv_budget_bytes, max_batch=settings.max_batch,
                         max_context=settings.max_context, progress=reporter(json_events=True),
                         speculation=settings.speculation, heads=settings.heads,
                         prefix_cache=settings.prefix_cache,
                         background_warmup=True,
                         **({"tensor_parallel": settings.tensor_parallel} if settings.tensor_parallel > 1 else {}))
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
        await asyncio.to_thread(_close_engine, engine)
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


def _close_engine(engine: Any) -> None:
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
