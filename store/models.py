"""SQLAlchemy 2 models of the telemetry database — a public interface.

Dashboards read these tables (and the `xo_v_*` views made by the migrations)
directly, so every change here goes through an Alembic revision in
`migrations/versions`; a test compares the migrated database with this file.

Conventions:
- every table is prefixed `xo_` so that Optuna's own tables (`studies`,
  `trials`, ..., and its `alembic_version`) share the file without colliding;
- types are portable (no SQLite-only or PostgreSQL-only types);
- timestamps are unix seconds in double precision (`*_time`, `*_at`);
- the columns of `xo_steps` are exactly the fields of the engine's `StepStats`
  and those of `xo_requests` the stored fields of its `RequestResult` (all but
  `scheduled_time`) plus `status`; the telemetry writer reads the columns off
  these models (tests/telemetry/test_recorder.py checks the mirror).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

TABLE_PREFIX = "xo_"
VIEW_PREFIX = "xo_v_"

# A 64-bit surrogate key everywhere except SQLite, where only INTEGER PRIMARY
# KEY aliases the rowid (and so autoincrements).
RowId = BigInteger().with_variant(Integer(), "sqlite")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

POLICY_SOURCES = ("default", "tuner", "admin")
RETUNE_TRIGGERS = ("schedule", "admin")
RETUNE_STATUSES = ("running", "applied", "rejected", "failed", "skipped", "interrupted")
""""interrupted": left running by a daemon that stopped, closed at its next start."""
REQUEST_STATUSES = ("ok", "aborted", "error")


class Base(DeclarativeBase):
    """Declarative base: constraint naming (batch ALTER on SQLite needs names)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {float: Double(), dict[str, Any]: JSON(), list[Any]: JSON()}  # noqa: RUF012


class Tenant(Base):
    """A client of the daemon: its API key (hashed) and its limits (NULL = none)."""

    __tablename__ = "xo_tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    api_key_hash: Mapped[str] = mapped_column(String(200))
    """`store.apikeys.hash_api_key` output; the key itself is never stored."""
    max_concurrent: Mapped[int | None]
    """Requests in flight at once."""
    max_tokens: Mapped[int | None]
    """Most completion tokens one request may ask for (NULL: the daemon's `max_tokens`)."""
    max_queued: Mapped[int | None]
    """Requests that may wait for a slot past max_concurrent (NULL: `tenant_max_queued`)."""
    requests_per_minute: Mapped[int | None]
    tokens_per_minute: Mapped[int | None]
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]


class Request(Base):
    """One finished request (the engine's `RequestResult` plus status)."""

    __tablename__ = "xo_requests"
    __table_args__ = (Index("ix_xo_requests_tenant_finish_time", "tenant", "finish_time"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    instance: Mapped[str] = mapped_column(String(64), default="")
    """Which daemon recorded it ("" for a single daemon)."""
    request_id: Mapped[str] = mapped_column(String(128), index=True)
    tenant: Mapped[str] = mapped_column(String(128))
    prompt_tokens: Mapped[int]
    output_tokens: Mapped[int]
    arrival_time: Mapped[float]
    """Queued (unix seconds)."""
    first_token_time: Mapped[float | None]
    finish_time: Mapped[float] = mapped_column(index=True)
    finish_reason: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    """One of REQUEST_STATUSES."""
    proposed_tokens: Mapped[int] = mapped_column(default=0)
    accepted_tokens: Mapped[int] = mapped_column(default=0)
    preemptions: Mapped[int] = mapped_column(default=0)


class Step(Base):
    """One engine step (the engine's `StepStats`); raw rows age into rollups."""

    __tablename__ = "xo_steps"

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    instance: Mapped[str] = mapped_column(String(64), default="")
    step_id: Mapped[int] = mapped_column(BigInteger)
    time: Mapped[float] = mapped_column(index=True)
    batch_size: Mapped[int]
    prefill_tokens: Mapped[int]
    decode_tokens: Mapped[int]
    """Output tokens delivered to requests (StepStats.decode_tokens); before revision 0013 it also
    counted accepted drafts past a request's end."""
    technique: Mapped[str] = mapped_column(String(64))
    depth: Mapped[int]
    proposed: Mapped[int]
    accepted: Mapped[int]
    """Drafts delivered (StepStats.accepted); before revision 0013, drafts accepted by verification."""
    accepted_per_pos: Mapped[list[Any]]
    """JSON list: `accepted` at each draft position (len == depth)."""
    propose_ms: Mapped[float]
    verify_ms: Mapped[float]
    step_ms: Mapped[float]
    kv_pages_used: Mapped[int]
    kv_pages_free: Mapped[int]
    queue_len: Mapped[int]
    policy_version: Mapped[int]
    preempted: Mapped[int] = mapped_column(default=0)
    sampled_rows: Mapped[int] = mapped_column(default=0, server_default="0")
    """Rows of the batch that sample (temperature > 0); 0 on rows before revision 0007."""
    prefix_hit_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    """Tokens of the sequences admitted in the step found in the prefix cache; 0 before revision 0008."""
    prefix_query_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    """Tokens of the sequences admitted in the step (0 with the cache off, and before revision 0008)."""
    tenants: Mapped[list[Any]]
    """JSON list of the tenants in the batch."""
    row_classes: Mapped[list[Any] | None]
    """JSON list of objects, one per (tenant, technique, depth) of the decode rows (the engine's
    RowClass fields); NULL on rows before revision 0009."""
    grammar_ms: Mapped[float] = mapped_column(default=0.0, server_default="0")
    """Host time the step spent on constrained rows' grammars; 0 on rows before revision 0012."""
    constrained_rows: Mapped[int] = mapped_column(default=0, server_default="0")
    """Rows of the batch whose output follows a grammar; 0 on rows before revision 0012."""
    plain_rows: Mapped[int] = mapped_column(default=0, server_default="0")
    """Decode rows that ran in a segmented verify's plain segment (the others at the verify
    depth); 0 for one padded verify or none, and on rows before revision 0011."""
    cut_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    """Tokens the decode rows computed past their requests' ends (a stop, max_tokens, the
    context), not in decode_tokens; 0 on rows before revision 0013."""


class StepRowClass(Base):
    """One row class of one raw step (an object of its `row_classes`), as a table for SQL readers.

    Written with its step, in the same transaction; deleted with it (retention, or ON DELETE
    CASCADE on a server). Since revision 0010; the columns after `time` mirror the engine's
    `RowClass` (a test checks)."""

    __tablename__ = "xo_step_row_classes"

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    step: Mapped[int] = mapped_column(RowId, ForeignKey("xo_steps.id", ondelete="CASCADE"), index=True)
    """`xo_steps.id` of its step (not the engine's `step_id`)."""
    instance: Mapped[str] = mapped_column(String(64), default="")
    time: Mapped[float] = mapped_column(index=True)
    """Its step's time."""
    tenant: Mapped[str] = mapped_column(String(128))
    technique: Mapped[str] = mapped_column(String(64))
    """"none" (depth 0) for rows that did not draft."""
    depth: Mapped[int]
    rows: Mapped[int]
    """Decode rows of the class in the step."""
    proposed: Mapped[int] = mapped_column(default=0)
    accepted: Mapped[int] = mapped_column(default=0)
    accepted_per_pos: Mapped[list[Any]]
    """JSON list: drafts accepted at each draft position (len == depth)."""


class StepRollup(Base):
    """Per-minute aggregate of raw steps for one (instance, technique, depth)."""

    __tablename__ = "xo_step_rollups"
    __table_args__ = (UniqueConstraint("minute_start", "instance", "technique", "depth"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    minute_start: Mapped[int] = mapped_column(BigInteger, index=True)
    """Unix seconds at the start of the minute (a multiple of 60)."""
    instance: Mapped[str] = mapped_column(String(64), default="")
    technique: Mapped[str] = mapped_column(String(64))
    depth: Mapped[int]
    steps: Mapped[int]
    batch_size_sum: Mapped[int]
    batch_size_max: Mapped[int]
    prefill_tokens: Mapped[int]
    decode_tokens: Mapped[int]
    proposed: Mapped[int]
    accepted: Mapped[int]
    accepted_per_pos: Mapped[list[Any]]
    """JSON list: sum of accepted_per_pos over the minute's steps."""
    step_ms_sum: Mapped[float]
    step_ms_max: Mapped[float]
    propose_ms_sum: Mapped[float]
    verify_ms_sum: Mapped[float]
    preempted: Mapped[int]
    batch_hist: Mapped[dict[str, Any]]
    """JSON object: batch size (as a string) -> number of steps."""


class Policy(Base):
    """A runtime policy version: its full body and its life cycle."""

    __tablename__ = "xo_policies"
    __table_args__ = (
        CheckConstraint("source IN ('default', 'tuner', 'admin')", name="source"),
        UniqueConstraint("instance", "version"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance: Mapped[str] = mapped_column(String(64), default="", server_default="")
    """The daemon whose policy it is ("" for a single daemon); versions count per instance."""
    version: Mapped[int]
    body: Mapped[dict[str, Any]]
    """The whole `TunedPolicy` as JSON."""
    source: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float]
    applied_at: Mapped[float | None]
    rolled_back_at: Mapped[float | None]
    rollback_reason: Mapped[str | None] = mapped_column(Text)


class Retune(Base):
    """One tuner run: trigger, timings, Optuna trial, predicted vs measured goodput."""

    __tablename__ = "xo_retunes"
    __table_args__ = (
        CheckConstraint("triggered_by IN ('schedule', 'admin')", name="triggered_by"),
        CheckConstraint("status IN ('running', 'applied', 'rejected', 'failed', 'skipped', "
                        "'interrupted')", name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance: Mapped[str] = mapped_column(String(64), default="", server_default="")
    """The daemon that ran it ("" for a single daemon)."""
    triggered_by: Mapped[str] = mapped_column(String(16))
    """One of RETUNE_TRIGGERS: the periodic schedule or an admin request."""
    started_at: Mapped[float] = mapped_column(index=True)
    finished_at: Mapped[float | None]
    status: Mapped[str] = mapped_column(String(16))
    """One of RETUNE_STATUSES."""
    study_name: Mapped[str | None] = mapped_column(String(255))
    trial_number: Mapped[int | None]
    predicted_goodput: Mapped[float | None]
    """Output tokens/s the performance model predicted for the chosen policy."""
    measured_goodput: Mapped[float | None]
    """Output tokens/s measured while validating it online."""
    chosen_policy_version: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None]
    """Free-form JSON for the tuner (fit quality, trials run, ...)."""
