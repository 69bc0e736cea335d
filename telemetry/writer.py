"""Turning records into rows and writing a batch of them in one transaction.

Runs on the recorder's thread (never on the caller's): records may be
`StepRecord`/`RequestRecord` or any object with the same attributes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import JSON, Connection, Table, insert

from store.models import Request, Step
from telemetry.records import request_status

Row = dict[str, Any]


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


# (field, converter): numpy scalars and other number-likes become plain Python
# values here, on the writer's thread, so any driver accepts them.
_STEP_SCALARS = (
    ("step_id", int), ("time", float), ("batch_size", int), ("prefill_tokens", int),
    ("decode_tokens", int), ("technique", str), ("depth", int), ("proposed", int),
    ("accepted", int), ("propose_ms", float), ("verify_ms", float), ("step_ms", float),
    ("kv_pages_used", int), ("kv_pages_free", int), ("queue_len", int),
    ("policy_version", int),
)  # fmt: skip
_REQUEST_SCALARS = (
    ("request_id", str), ("tenant", str), ("prompt_tokens", int), ("output_tokens", int),
    ("arrival_time", float), ("first_token_time", _opt_float), ("finish_time", float),
    ("finish_reason", str),
)  # fmt: skip

STEP_TABLE = Step.__table__
REQUEST_TABLE = Request.__table__


def step_row(rec: Any, instance: str = "") -> Row:
    """The `xo_steps` row for a step record (raises AttributeError if one is missing)."""
    row = {name: conv(getattr(rec, name)) for name, conv in _STEP_SCALARS}
    row["accepted_per_pos"] = [int(a) for a in rec.accepted_per_pos]
    row["preempted"] = int(getattr(rec, "preempted", 0))
    row["tenants"] = [str(t) for t in getattr(rec, "tenants", ())]
    row["instance"] = instance
    return row


def request_row(rec: Any, instance: str = "") -> Row:
    """The `xo_requests` row for a request record."""
    row = {name: conv(getattr(rec, name)) for name, conv in _REQUEST_SCALARS}
    row["proposed_tokens"] = int(getattr(rec, "proposed_tokens", 0))
    row["accepted_tokens"] = int(getattr(rec, "accepted_tokens", 0))
    row["preemptions"] = int(getattr(rec, "preemptions", 0))
    row["status"] = request_status(rec.finish_reason, getattr(rec, "status", None))
    row["instance"] = instance
    return row


def write_rows(conn: Connection, steps: Sequence[Row], requests: Sequence[Row]) -> None:
    """Insert both batches (executemany); the caller owns the transaction."""
    for table, rows in ((STEP_TABLE, steps), (REQUEST_TABLE, requests)):
        if not rows:
            continue
        if conn.dialect.name == "sqlite":
            _insert_sqlite(conn, table, rows)
        else:
            conn.execute(insert(table), list(rows))


def _insert_sqlite(conn: Connection, table: Table, rows: Sequence[Row]) -> None:
    """The same INSERT through the driver: ~3x fewer CPU cycles (and GIL) per row.

    SQLAlchemy's per-row parameter processing dominates the writer's time;
    here JSON columns are serialized as SQLAlchemy would (json.dumps) and the
    rows go to sqlite3's executemany as tuples.
    """
    sql, columns, json_columns = _sqlite_statement(table)
    dumps = json.dumps
    params = [
        tuple(dumps(row[c]) if c in json_columns else row[c] for c in columns) for row in rows
    ]
    conn.exec_driver_sql(sql, params)


@functools.cache
def _sqlite_statement(table: Table) -> tuple[str, tuple[str, ...], frozenset[str]]:
    columns = tuple(c.name for c in table.columns if not c.primary_key)
    json_columns = frozenset(c.name for c in table.columns if isinstance(c.type, JSON))
    names = ", ".join(f'"{c}"' for c in columns)
    marks = ", ".join("?" for _ in columns)
    return f"INSERT INTO {table.name} ({names}) VALUES ({marks})", columns, json_columns
