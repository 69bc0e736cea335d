"""Daemon settings: one frozen dataclass, loaded from four layers.

Precedence, highest first: command-line flags > environment variables
(`CROSSOVER_<FIELD>`, e.g. CROSSOVER_MAX_BATCH=16) > a TOML file
(`--config file.toml` or CROSSOVER_CONFIG; flat `key = value` pairs named
like the fields) > the defaults below. A bad value raises `SettingsError`
naming the key, the value and where it came from.

    >>> load_settings({"port": 9000}, env={"CROSSOVER_PORT": "9100"}).port
    9000
    >>> load_settings({}, env={"CROSSOVER_KV_BUDGET_BYTES": "2GiB"}).kv_budget_bytes
    2147483648
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    dtype: str | None = None
    """Weight/activation dtype for the engine; None is the engine's default."""
    kv_budget_bytes: int | None = field(default=None, metadata=_SIZE)
    """Bytes of accelerator memory for the KV pool; None lets the planner decide."""
    max_batch: int = 32
    """Most sequences decoded together."""
    max_context: int = 4096
    """Longest prompt + completion, in tokens."""
    speculation: bool = True
    """Compile verification and load the proposers (n-gram; MTP, early exit, draft model from the heads file)."""
    heads: str | None = None
    """Draft heads file from `crossover train-heads`; None: the one shipped for the model."""
    db_url: str | None = None
    """SQLAlchemy URL or SQLite path of the telemetry database; None: $CROSSOVER_DB, ./crossover.db."""
    tuner: bool = True
    """Run the periodic tuner and its exploration (admin retunes and pins work either way)."""
    tuner_interval_s: float = 600.0
    """Seconds between scheduled retunes."""
    tuner_min_new_steps: int = 500
    """A scheduled retune is skipped (and recorded) with fewer new steps since the last one,
    each counted once per sequence it ran (a batch-32 step counts 32)."""
    tuner_trials: int = 48
    """Optuna trials per TPE search (an exact solve, the default, tells at most two)."""
    tuner_tpot_p95_ms: float = 0.0
    """Constraint on the predicted p95 time per output token in ms (0: none)."""
    tuner_two_objective: bool = False
    """Search goodput vs p95 TPOT as two objectives (a Pareto front)."""
    tuner_fit_window_s: float = 3600.0
    """Telemetry the tuner's performance model is fitted on (seconds back from a retune)."""
    tuner_cost_window_s: float = 21600.0
    """Older telemetry whose steps fill shapes the fit window lacks in the step-time fit."""
    tuner_traffic_window_s: float = 600.0
    """Recent telemetry whose traffic (batch sizes, arrivals, tenant mix) a retune optimizes for."""
    tuner_baseline_s: float = 600.0
    """Telemetry of the previous policy that a new policy's validation compares against."""
    tuner_explore_share: float = 0.02
    """Share of decode steps that try a non-chosen depth, keeping the model fresh."""
    tuner_profile_steps: int = 200
    """Decisions at startup of which every other one measures an unmeasured (technique, depth)."""
    tuner_validation_s: float = 120.0
    """Longest validation window of a newly tuned policy."""
    tuner_validation_min_steps: int = 200
    """Validation ends once the new policy has this many steps."""
    tuner_rollback_margin: float = 0.05
    """Roll back when measured goodput drops by more than this share (or the noise, if larger)."""
    tuner_search_process: bool = True
    """Run the search in a separate process (off the engine thread's GIL)."""
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata=_SIZE)
    """Largest accepted request body; bigger ones get 413."""
    max_prompt_chars: int = 1_000_000
    """Longest prompt (or sum of chat message contents) in characters."""
    max_waiting: int = 256
    """Requests allowed to wait beyond max_batch running ones; more get 429."""
    drain_deadline_s: float = 30.0
    """On SIGTERM, how long in-flight requests may finish before being aborted."""
    log_level: str = "info"
    """One of debug, info, warning, error."""
    admin_token: str | None = None
    """Bearer token for /admin/*; None disables the admin API."""
    open_mode: bool | None = None
    """Serve without API keys as tenant "default"; None means on only for loopback hosts."""
    max_tokens: int | None = None
    """Most completion tokens one request may ask for; a tenant's own limit overrides it."""
    tenant_max_queued: int = 0
    """Requests of one tenant that may wait for a slot past its max_concurrent; more get 429."""
    tenant_cache_s: float = 5.0
    """How long an API key lookup is cached (a key revoked elsewhere works this long)."""

    def __post_init__(self) -> None:
        _check_range("port", self.port, 0, 65535)
        _check_range("max_batch", self.max_batch, 1, 1 << 16)
        _check_range("max_context", self.max_context, 2, 1 << 24)
        _check_range("max_body_bytes", self.max_body_bytes, 1024, 1 << 34)
        _check_range("max_prompt_chars", self.max_prompt_chars, 1, 1 << 34)
        _check_range("max_waiting", self.max_waiting, 0, 1 << 24)
        _check_range("drain_deadline_s", self.drain_deadline_s, 0.0, 86400.0)
        _check_range("tenant_max_queued", self.tenant_max_queued, 0, 1 << 24)
        _check_range("tenant_cache_s", self.tenant_cache_s, 0.0, 3600.0)
        _check_range("tuner_interval_s", self.tuner_interval_s, 0.01, 86400.0 * 7)
        _check_range("tuner_min_new_steps", self.tuner_min_new_steps, 0, 1 << 30)
        _check_range("tuner_trials", self.tuner_trials, 1, 2000)
        _check_range("tuner_tpot_p95_ms", self.tuner_tpot_p95_ms, 0.0, 1e6)
        _check_range("tuner_fit_window_s", self.tuner_fit_window_s, 0.01, 86400.0 * 30)
        _check_range("tuner_cost_window_s", self.tuner_cost_window_s, 0.0, 86400.0 * 30)
        _check_range("tuner_traffic_window_s", self.tuner_traffic_window_s, 0.01, 86400.0 * 30)
        _check_range("tuner_baseline_s", self.tuner_baseline_s, 0.01, 86400.0 * 30)
        _check_range("tuner_explore_share", self.tuner_explore_share, 0.0, 0.5)
        _check_range("tuner_profile_steps", self.tuner_profile_steps, 0, 1 << 30)
        _check_range("tuner_validation_s", self.tuner_validation_s, 0.0, 86400.0)
        _check_range("tuner_validation_min_steps", self.tuner_validation_min_steps, 1, 1 << 30)
        _check_range("tuner_rollback_margin", self.tuner_rollback_margin, 0.0, 1.0)
        if self.max_tokens is not None:
            _check_range("max_tokens", self.max_tokens, 1, 1 << 24)
        if self.kv_budget_bytes is not None:
            _check_range("kv_budget_bytes", self.kv_budget_bytes, 1, 1 << 50)
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not self.host:
            raise SettingsError("host must not be empty")

    @property
    def is_open(self) -> bool:
        """Whether requests without an API key are served as tenant "default"."""
        return self.open_mode if self.open_mode is not None else is_loopback(self.host)

    @property
    def max_in_flight(self) -> int:
        """Running plus waiting requests the daemon admits before answering 429."""
        return self.max_batch + self.max_waiting


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_range(key: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        raise SettingsError(f"{key} must be in [{lo}, {hi}], got {value!r}")


def load_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> Settings:
    """Merge flags > env > TOML file > defaults (flags that are None are unset)."""
    flags = dict(flags or {})
    env = os.environ if env is None else env
    flag_path = flags.pop("config", None)
    path = config_path or flag_path or env.get(ENV_PREFIX + "CONFIG")
    values: dict[str, Any] = {}
    if path:
        for key, raw in _read_toml(path).items():
            values[key] = _coerce(key, raw, source=path)
    for key in _FIELDS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            values[key] = _coerce(key, env[name], source=name)
    for key, raw in flags.items():
        if raw is not None:
            if key not in _FIELDS:
                raise SettingsError(f"unknown setting {key!r}")
            values[key] = _coerce(key, raw, source="--" + key.replace("_", "-"))
    return Settings(**values)


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path!r} is not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise SettingsError(f"config file {path!r}: unknown setting {unknown[0]!r}")
    return data


def _coerce(key: str, raw: Any, source: str) -> Any:
    """Convert `raw` (a string from env, or a TOML/flag value) to the field's type."""
    kind, optional = _FIELDS[key]
    bad = SettingsError(f"{key} = {raw!r} (from {source}) is not a valid {_describe(key)}")
    if optional and (raw is None or (isinstance(raw, str) and raw.lower() in ("", "none"))):
        return None
    if isinstance(raw, str) and kind is not str:
        return _parse_str(key, kind, raw, bad)
    if kind is bool and isinstance(raw, bool):
        return raw
    if kind is int and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if kind is str and isinstance(raw, str):
        return raw
    raise bad


def _parse_str(key: str, kind: type, raw: str, bad: SettingsError) -> Any:
    text = raw.strip().lower()
    if kind is bool:
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise bad
    if kind is int and _is_size(key):
        return _parse_size(text, bad)
    try:
        return kind(text)
    except ValueError:
        raise bad from None


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _parse_size(text: str, bad: SettingsError) -> int:
    """Bytes from "4096", "512MiB", "2GiB", "1.5GB"."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", text.replace("_", ""))
    if m is None or m.group(2) not in _UNITS:
        raise bad
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _is_size(key: str) -> bool:
    return bool(_FIELD_META[key].get("size"))


def _describe(key: str) -> str:
    kind, optional = _FIELDS[key]
    name = "size (bytes, or e.g. 2GiB)" if _is_size(key) else kind.__name__
    return f"{name}{' or none' if optional else ''}"


def _field_kinds() -> dict[str, tuple[type, bool]]:
    """field name -> (base type, whether None is allowed)."""
    hints = typing.get_type_hints(Settings)
    kinds: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(Settings):
        args = typing.get_args(hints[f.name])
        base = next((a for a in args if a is not type(None)), hints[f.name])
        kinds[f.name] = (base, type(None) in args)
    return kinds


_FIELDS = _field_kinds()
_FIELD_META = {f.name: dict(f.metadata) for f in dataclasses.fields(Settings)}
