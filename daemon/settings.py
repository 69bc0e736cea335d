"""Daemon settings: one frozen dataclass, loaded from four layers.

Precedence, highest first: command-line flags > environment variables
(`CROSSOVER_<FIELD>`, e.g. CROSSOVER_MAX_BATCH=16) > a TOML file
(`--config file.toml` or CROSSOVER_CONFIG; `key = value` pairs named like
the fields) > the defaults below. A bad value raises `SettingsError`
naming the key, the value and where it came from.

A section nests another package's config as one field: `Settings.tuner` is
`tuner.config.TunerConfig`, defined once there. Its fields load through the
same layers as `--tuner-<field>` flags (generated from the dataclass, help
from each field's docstring), `CROSSOVER_TUNER_<FIELD>` variables and a
`[tuner]` table in the TOML file; the tuner's switch is `enabled`
(`--tuner/--no-tuner`, CROSSOVER_TUNER_ENABLED).

    >>> load_settings({"port": 9000}, env={"CROSSOVER_PORT": "9100"}).port
    9000
    >>> load_settings({}, env={"CROSSOVER_KV_BUDGET_BYTES": "2GiB"}).kv_budget_bytes
    2147483648
    >>> load_settings({"tuner_trials": "8"}, env={"CROSSOVER_TUNER_ENABLED": "off"}).tuner.trials
    8
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from daemon.setting_values import as_text, int_tuple, is_loopback, parse_size
from engine.config import WEIGHT_FORMS
from tuner.config import TunerConfig

ENV_PREFIX = "CROSSOVER_"
LOG_LEVELS = ("debug", "info", "warning", "error")
_SIZE = {"size": True}  # field metadata: accepts "4GiB"-style strings


class SettingsError(ValueError):
    """A setting with a bad value; the message names the key and value."""


@dataclass(frozen=True)
class Settings:
    """Everything `crossover serve` can be told."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8000
    """TCP port to bind (0 picks a free one and logs it)."""
    model: str | None = None
    """Model id or path for the engine; None is the engine's default."""
    served_model_name: str | None = None
    """Names clients may send as `model`, comma-separated (answers carry the first); None: the engine's."""
    dtype: str | None = None
    """Weight/activation dtype for the engine; None is the engine's default."""
    weights: str | None = None
    """Weights as served: gguf (a GGUF's own blocks), int8, bfloat16, float32; None: engine.loader's."""
    kv_budget_bytes: int | None = field(default=None, metadata=_SIZE)
    """Bytes for the KV pool and speculation, whatever the weights take; None: memory_budget_bytes's."""
    memory_budget_bytes: int | None = field(default=None, metadata=_SIZE)
    """Bytes for weights, speculation and KV pool (the pool gets what the served weights leave)."""
    max_batch: int = 32
    """Most sequences decoded together."""
    max_context: int = 4096
    """Longest prompt + completion, in tokens."""
    token_budget: int = 512
    """Most new tokens one engine step computes: decode rows plus prefill chunks (verify drafts on top)."""
    tensor_parallel: int = 1
    """Devices the model and KV pool are split over (engine/model/sharding.py); 1: one device."""
    speculation: bool = True
    """Compile verification and load the proposers (n-gram; MTP, early exit, draft model: heads file)."""
    prefix_cache: bool = True
    """Share the KV pages of common prompt prefixes between requests (engine/memory/prefix_cache.py)."""
    heads: str | None = None
    """Draft heads file from `crossover train-heads`; None: the one shipped for the model."""
    db_url: str | None = None
    """SQLAlchemy URL or SQLite path of the telemetry database; None: $CROSSOVER_DB, ./crossover.db."""
    instance: str | None = None
    """This daemon's name among those sharing the database (rows, policies, retunes); None: host name:port."""
    tuner: TunerConfig = field(default_factory=TunerConfig)
    """The tuner and its periodic job: the `[tuner]` section (tuner.config.TunerConfig)."""
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata=_SIZE)
    """Largest accepted request body; bigger ones get 413."""
    check_origin: bool = True
    """On a loopback address, refuse (403) requests naming another Host or from another Origin's page."""
    max_connections: int = 512
    """Most client connections open at once; one more is answered 503 and closed (daemon/connections.py)."""
    header_timeout_s: float = 30.0
    """Longest a connection may take to send a request's headers, or stay idle between requests; then it
    is closed."""
    body_timeout_s: float = 30.0
    """Longest a request's body may take to arrive once its headers are in; then 408."""
    max_prompt_chars: int = 1_000_000
    """Longest prompt (or sum of chat message contents) in characters."""
    max_waiting: int = 256
    """Requests allowed to wait beyond max_batch running ones; more get 429."""
    drain_deadline_s: float = 30.0
    """On SIGTERM, how long in-flight requests may finish before being aborted."""
    step_deadline_s: float = 60.0
    """An engine step under way longer than this turns /health to 503 "stalled" until it returns."""
    engine_max_restarts: int = 3
    """Engine-loop restarts in a row after faults no request owns (device errors) before the daemon exits."""
    engine_restart_backoff_s: float = 0.5
    """Wait before restarting the engine loop after such a fault; doubles with each restart in a row."""
    stream_write_timeout_s: float = 30.0
    """Longest one write of a streamed response may wait for a client that is not reading; then the
    request is aborted."""
    stream_idle_timeout_s: float = 60.0
    """Longest a stream's client may take none of the bytes waiting for it; then the request is aborted."""
    log_level: str = "info"
    """One of debug, info, warning, error."""
    admin_token: str | None = None
    """Bearer token for /admin/*; None disables the admin API."""
    admin_token_file: str | None = None
    """File holding the admin token (its first line); keeps the token out of the process list."""
    metrics_require_admin: bool = False
    """Serve /metrics only to the admin token (bearer), not to anyone."""
    open_mode: bool | None = None
    """Serve without API keys as tenant "default"; None means on only for loopback hosts."""
    open_non_loopback: bool = False
    """Accept open mode on a non-loopback host (anyone who reaches the port may use it)."""
    max_tokens: int | None = None
    """Most completion tokens one request may ask for; a tenant's own limit overrides it."""
    tenant_max_queued: int = 0
    """Requests of one tenant that may wait for a slot past its max_concurrent; more get 429."""
    tenant_max_concurrent_share: float | None = 0.5
    """Share of max_batch a keyed tenant without its own max_concurrent may have in flight (at least 1);
    None: no limit."""
    tenant_cache_s: float = 5.0
    """How long an API key lookup is cached (a key revoked elsewhere works this long)."""

    def served_names(self, engine_name: str) -> tuple[str, ...]:
        """The names `model` may take: `served_model_name`'s, else the engine's own."""
        return tuple(n.strip() for n in (self.served_model_name or "").split(",")
                     if n.strip()) or (engine_name,)

    def __post_init__(self) -> None:
        _check_range("port", self.port, 0, 65535)
        _check_range("max_batch", self.max_batch, 1, 1 << 16)
        _check_range("max_context", self.max_context, 2, 1 << 24)
        _check_range("token_budget", self.token_budget, 1, 1 << 20)
        _check_range("tensor_parallel", self.tensor_parallel, 1, 4096)
        _check_range("max_body_bytes", self.max_body_bytes, 1024, 1 << 34)
        _check_range("max_connections", self.max_connections, 1, 1 << 20)
        _check_range("header_timeout_s", self.header_timeout_s, 0.001, 86400.0)
        _check_range("body_timeout_s", self.body_timeout_s, 0.001, 86400.0)
        _check_range("step_deadline_s", self.step_deadline_s, 0.001, 86400.0)
        _check_range("max_prompt_chars", self.max_prompt_chars, 1, 1 << 34)
        _check_range("max_waiting", self.max_waiting, 0, 1 << 24)
        _check_range("drain_deadline_s", self.drain_deadline_s, 0.0, 86400.0)
        _check_range("engine_max_restarts", self.engine_max_restarts, 0, 1000)
        _check_range("engine_restart_backoff_s", self.engine_restart_backoff_s, 0.0, 3600.0)
        _check_range("tenant_max_queued", self.tenant_max_queued, 0, 1 << 24)
        _check_range("tenant_cache_s", self.tenant_cache_s, 0.0, 3600.0)
        _check_range("stream_write_timeout_s", self.stream_write_timeout_s, 0.001, 86400.0)
        _check_range("stream_idle_timeout_s", self.stream_idle_timeout_s, 0.001, 86400.0)
        if self.tenant_max_concurrent_share is not None:
            _check_range("tenant_max_concurrent_share", self.tenant_max_concurrent_share, 0.001, 1.0)
        if self.max_tokens is not None:
            _check_range("max_tokens", self.max_tokens, 1, 1 << 24)
        for key in ("kv_budget_bytes", "memory_budget_bytes"):
            if getattr(self, key) is not None:
                _check_range(key, getattr(self, key), 1, 1 << 50)
        if None not in (self.kv_budget_bytes, self.memory_budget_bytes):
            raise SettingsError("give kv_budget_bytes or memory_budget_bytes, not both")
        if self.weights is not None and self.weights not in WEIGHT_FORMS:
            raise SettingsError(f"weights must be one of {WEIGHT_FORMS}, got {self.weights!r}")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not self.host:
            raise SettingsError("host must not be empty")
        if self.instance is not None and not 1 <= len(self.instance) <= 64:
            raise SettingsError(f"instance must be 1 to 64 characters, got {self.instance!r}")
        if self.instance == "all":
            raise SettingsError('instance "all" is reserved (the dashboard\'s every instance)')
        if self.open_mode and not self.open_non_loopback and not is_loopback(self.host):
            raise SettingsError(f"open_mode on the non-loopback host {self.host!r} lets anyone who can "
                                f"reach it use the daemon; bind to 127.0.0.1, or accept the risk with "
                                f"--open-non-loopback (open_non_loopback = true)")
        if self.metrics_require_admin and not self.admin_token:
            raise SettingsError("metrics_require_admin = true needs an admin_token (or admin_token_file)")

    @property
    def is_open(self) -> bool:
        """Whether requests without an API key are served as tenant "default"."""
        return self.open_mode if self.open_mode is not None else is_loopback(self.host)

    @property
    def tenant_default_max_concurrent(self) -> int | None:
        """max_concurrent of a keyed tenant without its own: the share of max_batch, at least 1.

        >>> (Settings(max_batch=32).tenant_default_max_concurrent,
        ...  Settings(max_batch=1).tenant_default_max_concurrent)
        (16, 1)
        """
        share = self.tenant_max_concurrent_share
        return None if share is None else max(1, int(share * self.max_batch))

    @property
    def max_in_flight(self) -> int:
        """Running plus waiting requests the daemon admits before answering 429."""
        return self.max_batch + self.max_waiting


def _check_range(key: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        raise SettingsError(f"{key} must be in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class _Key:
    """One setting as flags and the environment name it: `tuner_trials` is [tuner] trials."""

    section: str | None
    """The nested section holding it (a field of Settings), or None for a top-level field."""
    name: str
    """The field's name in Settings or in its section."""
    kind: type
    optional: bool
    """Whether None is allowed."""
    size: bool
    """Whether "4GiB"-style strings are accepted."""

    @property
    def label(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name


def load_settings(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                  config_path: str | None = None) -> Settings:
    """Merge flags > env > TOML file > defaults (flags that are None are unset).

    `flags` and the environment name a section's field `<section>_<field>`
    (`tuner_trials`, CROSSOVER_TUNER_TRIALS); the TOML file puts it in a table
    (`[tuner]` then `trials = 8`).
    """
    flags = dict(flags or {})
    env = os.environ if env is None else env
    flag_path = flags.pop("config", None)
    path = config_path or flag_path or env.get(ENV_PREFIX + "CONFIG")
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}

    def put(flat: str, raw: Any, source: str) -> None:
        key = _KEYS[flat]
        (nested[key.section] if key.section else top)[key.name] = _coerce(key, raw, source)

    if path:
        for flat, raw in _read_toml(path).items():
            put(flat, raw, source=path)
    for old, new in _RENAMED_ENV.items():
        if ENV_PREFIX + old in env:
            raise SettingsError(f"{ENV_PREFIX + old} is now {ENV_PREFIX + new}")
    for flat in _KEYS:
        if (name := ENV_PREFIX + flat.upper()) in env:
            put(flat, env[name], source=name)
    for flat, raw in flags.items():
        if raw is not None:
            if flat not in _KEYS:
                raise SettingsError(f"unknown setting {flat!r}")
            put(flat, raw, source="--" + flat.replace("_", "-"))
    for name, cls in SECTIONS.items():
        try:
            top[name] = cls(**nested[name])
        except ValueError as exc:
            raise SettingsError(f"[{name}] {exc}") from None
    if top.get("admin_token_file"):
        top["admin_token"] = _token_from_file(top["admin_token_file"], top.get("admin_token"))
    return Settings(**top)


def _token_from_file(path: str, given: str | None) -> str:
    """The first line of `path`, stripped: the admin token (an error if one is also given)."""
    if given:
        raise SettingsError("give admin_token or admin_token_file, not both")
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"cannot read admin_token_file {path!r}: {exc}") from None
    if not token:
        raise SettingsError(f"admin_token_file {path!r} is empty")
    return token


def add_section_flags(parser: Any) -> None:
    """Add a flag to `parser` (or an argument group) for every field of every section
    (`--tuner-trials N`, `--tuner-two-objective` / `--no-tuner-two-objective`), help from the
    field's docstring; their dests are SECTION_KEYS."""
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flat = f"{section}_{f.name}"
            key, default = _KEYS[flat], getattr(cls(), f.name)
            names = _FLAG_NAMES.get(flat, ("--" + flat.replace("_", "-"),))
            text = f"{docs.get(f.name, f.name)} (default {as_text(default)})".replace("%", "%%")
            if key.kind is bool:
                parser.add_argument(*names, dest=flat, action=argparse.BooleanOptionalAction,
                                    default=None, help=text)
            else:
                parser.add_argument(*names, dest=flat, metavar=_metavar(key), help=text)


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the first sentence of its docstring (the string right after it).

    >>> field_docs(TunerConfig)["trials"]
    'New trials asked and told per TPE search (an exact solve tells at most two)'
    """
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[node.target.id] = _first_sentence(" ".join(str(after.value.value).split()))
    return docs


def _first_sentence(text: str) -> str:
    """`text` up to its first ". ", "; " or ": " outside parentheses, without the stop."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ".;:" and text[i + 1 : i + 2] in (" ", ""):
            return text[:i]
    return text


def _metavar(key: _Key) -> str:
    if key.name.endswith("_s"):
        return "SECONDS"
    return {int: "N", float: "X", tuple: "N,N,..."}.get(key.kind, key.name.upper())


def _read_toml(path: str) -> dict[str, Any]:
    """The file's settings by flat key (a section's table flattened to `<section>_<field>`)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path!r} is not valid TOML: {exc}") from exc
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise SettingsError(f"config file {path!r}: {key} = {value!r} must be a [{key}] "
                                    f"table (the on/off switch is `enabled` in it)")
            for name, raw in value.items():
                if f"{key}_{name}" not in _KEYS:
                    raise SettingsError(f"config file {path!r}: unknown setting {name!r} in [{key}]")
                flat[f"{key}_{name}"] = raw
        elif key in _KEYS and _KEYS[key].section is None:
            flat[key] = value
        else:
            hint = next((f" (put {key[len(s) + 1:]!r} in a [{s}] table)" for s in SECTIONS
                         if key in _KEYS and key.startswith(s + "_")), "")
            raise SettingsError(f"config file {path!r}: unknown setting {key!r}{hint}")
    return flat


def _coerce(key: _Key, raw: Any, source: str) -> Any:
    """Convert `raw` (a string from env or a flag, or a TOML value) to the field's type."""
    bad = SettingsError(f"{key.label} = {raw!r} (from {source}) is not a valid {_describe(key)}")
    kind = key.kind
    if key.optional and (raw is None or (isinstance(raw, str) and raw.lower() in ("", "none"))):
        return None
    if isinstance(raw, str) and kind is not str:
        return _parse_str(key, raw, bad)
    if kind is tuple and isinstance(raw, (list, tuple)):
        return _checked(int_tuple, [str(v) for v in raw], bad)
    if kind is bool and isinstance(raw, bool):
        return raw
    if kind is int and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if kind is str and isinstance(raw, str):
        return raw
    raise bad


def _parse_str(key: _Key, raw: str, bad: SettingsError) -> Any:
    text = raw.strip().lower()
    if key.kind is bool:
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise bad
    if key.kind is tuple:
        return _checked(int_tuple, text.split(","), bad)
    if key.kind is int and key.size:
        return _checked(parse_size, text, bad)
    try:
        return key.kind(text)
    except ValueError:
        raise bad from None


def _checked(parse: Any, raw: Any, bad: SettingsError) -> Any:
    try:
        return parse(raw)
    except ValueError:
        raise bad from None


def _describe(key: _Key) -> str:
    names = {tuple: "comma-separated list of integers"}
    name = "size (bytes, or e.g. 2GiB)" if key.size else names.get(key.kind, key.kind.__name__)
    return f"{name}{' or none' if key.optional else ''}"


def _keys(cls: type, section: str | None = None) -> dict[str, _Key]:
    """Flat key -> _Key for the fields of `cls` (a section's fields prefixed with its name)."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, _Key] = {}
    for f in dataclasses.fields(cls):
        if section is None and f.name in SECTIONS:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        kind = next(a for a in args if a is not type(None)) if optional else hint
        kind = typing.get_origin(kind) or kind  # tuple[int, ...] -> tuple
        flat = f"{section}_{f.name}" if section else f.name
        keys[flat] = _Key(section, f.name, kind, optional, bool(f.metadata.get("size")))
    return keys


SECTIONS: dict[str, type] = {"tuner": TunerConfig}
"""Nested sections: a field of Settings, a TOML table, CROSSOVER_<SECTION>_<FIELD>, --<section>-<field>."""
_KEYS = {**_keys(Settings), **{k: v for s, cls in SECTIONS.items() for k, v in _keys(cls, s).items()}}
SECTION_KEYS = tuple(flat for flat, key in _KEYS.items() if key.section)
"""The flat keys of every section's fields: the dests of add_section_flags."""
_FLAG_NAMES = {"tuner_enabled": ("--tuner",), "tuner_interval_s": ("--tuner-interval", "--tuner-interval-s")}
"""Flags whose names are not `--<flat key>`: the tuner's switch and its interval keep their names."""
_RENAMED_ENV = {"TUNER": "TUNER_ENABLED"}
"""Environment variables that moved (an old one set is an error, not silently ignored)."""
