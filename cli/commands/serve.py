"""`crossover serve`: its flags, read into the daemon's settings; the daemon's lifecycle
(bind, open the database, load the engine, serve, drain) is daemon/lifecycle.py.

Settings come from flags > CROSSOVER_* environment > --config TOML >
defaults (daemon.settings).

/metrics is unauthenticated, as in vLLM, unless --metrics-require-admin puts
it behind the admin token. The admin token is best given by
--admin-token-file or CROSSOVER_ADMIN_TOKEN: on the command line it is
visible in the process list (a warning is logged).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import TYPE_CHECKING

from daemon.settings import SECTION_KEYS, add_section_flags
from engine.config import WEIGHT_FORMS

if TYPE_CHECKING:
    from daemon.lifecycle import FakeEngineOptions

SETTING_FLAGS = (
    "host", "port", "model", "served_model_name", "dtype", "weights", "kv_budget_bytes",
    "memory_budget_bytes", "max_batch", "max_context", "token_budget", "db_url", "instance",
    "tensor_parallel", "prefix_cache",
    "max_body_bytes", "max_prompt_chars", "max_waiting", "drain_deadline_s",
    "log_level", "admin_token", "open_mode", "max_tokens", "tenant_max_queued", "tenant_cache_s",
    "speculation", "heads", "stream_write_timeout_s", "stream_idle_timeout_s", "admin_token_file",
    "metrics_require_admin", "open_non_loopback", "tenant_max_concurrent_share",
    "engine_max_restarts", "engine_restart_backoff_s", *SECTION_KEYS,
)

log = logging.getLogger("crossover.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--config", metavar="FILE",
        help="TOML file of settings (key = value, named like the fields; a [tuner] table)")
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="TCP port (default 8000; 0 picks a free one)")
    add("model_arg", nargs="?", metavar="MODEL",
        help="model id or path, as vLLM's positional (same as --model)")
    add("--model", help="model id or path (default: the engine's)")
    add("--served-model-name", nargs="+", metavar="NAME",
        help="names clients may send as `model`; answers carry the first (default: the model's own)")
    add("--dtype", help="weight/activation dtype (default: the engine's)")
    add("--weights", choices=WEIGHT_FORMS, help="weights as served: gguf (the file's own quantized blocks "
        "through the quantized-matmul kernel), int8, bfloat16 or float32 (default: --dtype's; without "
        "--dtype, gguf for a GGUF model on the CPU)")
    add("--kv-budget", dest="kv_budget_bytes", metavar="BYTES",
        help="KV pool and speculation size, e.g. 4GiB, whatever the weights take")
    add("--memory-budget", dest="memory_budget_bytes", metavar="BYTES",
        help="weights + speculation + KV pool, e.g. 6GiB: the pool gets what the served weights leave "
             "(default: a 2GiB pool on the CPU beside float32 weights, 4GiB elsewhere beside bfloat16)")
    add("--max-batch", "--max-num-seqs", dest="max_batch", type=int, help="most sequences decoded together")
    add("--max-context", "--max-model-len", dest="max_context", type=int,
        help="longest prompt + completion in tokens")
    add("--token-budget", "--max-num-batched-tokens", dest="token_budget", type=int, metavar="N",
        help="most new tokens (decode + prefill) one engine step computes")
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

    defaults = {f.name: f.default for f in dataclasses.fields(Settings)
                if f.default is not dataclasses.MISSING}
    for action in p._actions:
        value = defaults.get(action.dest, None)
        if (action.help and action.help != argparse.SUPPRESS and "default" not in action.help
                and value is not None):
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
            return (f"--served-model-name {args.served_model_name!r}: names must be distinct, non-empty, "
                    "without commas")
        args.served_model_name = ",".join(names)
    return None


def run(args: argparse.Namespace) -> int:
    from daemon import jsonlog
    from daemon.lifecycle import run_daemon
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
    return run_daemon(settings, fake_engine(args))


def fake_engine(args: argparse.Namespace) -> FakeEngineOptions | None:
    """The hidden --fake-* flags (tests and benches serve the fake engine), or None."""
    from daemon.lifecycle import FakeEngineOptions

    if not args.fake_engine:
        return None
    return FakeEngineOptions(step_ms=args.fake_step_ms, warmup_s=args.fake_warmup_s,
                      speculation=args.fake_speculation)
