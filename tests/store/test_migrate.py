"""Migrations: upgrade from the first-revision fixture, refusal, drift, Optuna sharing the file.

Tests on `db_url` run on SQLite and on PostgreSQL (tests/conftest.py); the
committed first-revision fixture is a SQLite file, so its tests are SQLite's.
"""

from __future__ import annotations

import io
import sqlite3
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError

from store import migrate
from store.db import make_engine, session_scope
from store.models import Base
from store.tenants import add_tenant
from store.versioning import VERSION_TABLE, include_object

T0 = 1_700_000_000.0  # the fixture's clock (tests/fixtures/make_telemetry_rev1.py)


def _sql(url: str, query: str) -> list[tuple]:
    con = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        return con.execute(query).fetchall()
    finally:
        con.close()


def _names(url: str) -> tuple[set[str], set[str]]:
    """The database's table names and view names (any backend)."""
    engine = make_engine(url)
    try:
        found = inspect(engine)
        return set(found.get_table_names()), set(found.get_view_names())
    finally:
        engine.dispose()


def _drift(url: str) -> list:
    engine = make_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={"include_object": include_object, "compare_type": True,
                  "version_table": VERSION_TABLE},
        )  # fmt: skip
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    return diff


def test_first_revision_fixture_is_refused_then_upgraded(rev1_url: str) -> None:
    assert migrate.current_revision(rev1_url) == "0001"
    with pytest.raises(migrate.SchemaOutOfDate) as refused:
        migrate.check_schema(rev1_url)
    message = str(refused.value)
    assert f"crossover db upgrade --db {rev1_url}" in message
    assert "0001" in message and migrate.head_revision() in message

    migrate.upgrade(rev1_url)

    assert migrate.check_schema(rev1_url) == migrate.head_revision()
    assert _sql(rev1_url, "SELECT COUNT(*) FROM xo_steps") == [(4,)]
    assert _sql(rev1_url, "SELECT name, max_concurrent FROM xo_tenants") == [("acme", 4)]
    assert _sql(rev1_url, "SELECT triggered_by, status FROM xo_retunes") == [
        ("schedule", "rejected")
    ]
    # revision 0002's views see the old rows
    assert _sql(
        rev1_url,
        "SELECT technique, proposed, accepted FROM xo_v_acceptance WHERE technique = 'ngram'",
    ) == [("ngram", 24, 12)]
    assert _sql(rev1_url, "SELECT tenant, requests, accepted FROM xo_v_tenant_minute") == [
        ("acme", 1, 12)
    ]
    assert _sql(rev1_url, "PRAGMA journal_mode") == [("wal",)]
    assert _drift(rev1_url) == []


def test_upgrade_adds_per_tenant_token_and_queue_limits(rev1_url: str) -> None:
    migrate.upgrade(rev1_url, "0002")
    columns = [name for (_, name, *_) in _sql(rev1_url, "PRAGMA table_info(xo_tenants)")]
    assert "max_tokens" not in columns and "max_queued" not in columns
    migrate.upgrade(rev1_url)
    columns = {name: notnull for (_, name, _, notnull, *_) in
               _sql(rev1_url, "PRAGMA table_info(xo_tenants)")}
    assert columns["max_tokens"] == 0 and columns["max_queued"] == 0  # nullable
    # the old tenant keeps its limit and gets none of the new ones (the daemon's defaults)
    assert _sql(rev1_url, "SELECT name, max_concurrent, max_tokens, max_queued FROM xo_tenants") == [
        ("acme", 4, None, None)
    ]
    engine = make_engine(rev1_url)
    with session_scope(engine) as session:
        add_tenant(session, "globex", "xo-key", max_concurrent=2, max_tokens=64, max_queued=0)
    engine.dispose()
    assert _sql(rev1_url, "SELECT max_concurrent, max_tokens, max_queued FROM xo_tenants "
                          "WHERE name = 'globex'") == [(2, 64, 0)]
    command.downgrade(migrate.alembic_config(rev1_url), "0002")  # and back: the rows survive
    assert _sql(rev1_url, "SELECT name, max_concurrent FROM xo_tenants ORDER BY name") == [
        ("acme", 4), ("globex", 2)
    ]


def test_upgrade_gives_recorded_skips_the_skipped_status(rev1_url: str) -> None:
    migrate.upgrade(rev1_url, "0003")
    con = sqlite3.connect(rev1_url.removeprefix("sqlite:///"))
    with con:
        con.executemany(
            "INSERT INTO xo_retunes (triggered_by, started_at, status, error) VALUES (?, ?, ?, ?)",
            [("schedule", T0 + 1, "failed", "skipped: only 3 new steps since the last retune"),
             ("admin", T0 + 2, "failed", "RuntimeError: boom")],
        )  # fmt: skip
    con.close()
    statuses = "SELECT status FROM xo_retunes ORDER BY started_at"  # the fixture's is T0 + 100
    migrate.upgrade(rev1_url)
    assert _sql(rev1_url, statuses) == [("skipped",), ("failed",), ("rejected",)]
    command.downgrade(migrate.alembic_config(rev1_url), "0003")
    assert _sql(rev1_url, statuses) == [("failed",), ("failed",), ("rejected",)]


def test_upgrade_checks_retune_statuses_and_allows_interrupted(rev1_url: str) -> None:
    insert = "INSERT INTO xo_retunes (triggered_by, started_at, status) VALUES ('admin', 1.0, ?)"
    migrate.upgrade(rev1_url, "0004")
    _write(rev1_url, insert, ("bogus",))  # no constraint before 0005
    _write(rev1_url, "DELETE FROM xo_retunes WHERE status = 'bogus'")
    migrate.upgrade(rev1_url)
    _write(rev1_url, insert, ("interrupted",))
    with pytest.raises(sqlite3.IntegrityError, match="ck_xo_retunes_status"):
        _write(rev1_url, insert, ("bogus",))
    statuses = "SELECT status FROM xo_retunes ORDER BY started_at"
    assert _sql(rev1_url, statuses) == [("interrupted",), ("rejected",)]
    assert _sql(rev1_url, "SELECT COUNT(*) FROM sqlite_master WHERE name = "
                          "'ix_xo_retunes_started_at'") == [(1,)]  # the rebuilt table kept it
    command.downgrade(migrate.alembic_config(rev1_url), "0004")
    assert _sql(rev1_url, statuses) == [("failed",), ("rejected",)]
    _write(rev1_url, insert, ("bogus",))  # the constraint is gone again


def _write(url: str, query: str, params: tuple = ()) -> None:
    con = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        with con:
            con.execute(query, params)
    finally:
        con.close()


def test_models_match_the_migrations(db_url: str, rev1_url: str) -> None:
    assert _drift(db_url) == []
    missing = _drift(rev1_url)  # the check has teeth: 0001 lacks the rollups table
    assert any(d[0] == "add_table" and d[1].name == "xo_step_rollups" for d in missing)


def test_empty_database_message_and_ensure_schema(empty_db_url: str) -> None:
    url = empty_db_url
    with pytest.raises(migrate.SchemaOutOfDate, match="no crossover schema") as refused:
        migrate.check_schema(url)
    assert migrate.upgrade_command(url) in str(refused.value)  # `crossover db upgrade --db ...`
    assert migrate.ensure_schema(url) == migrate.head_revision()
    assert migrate.ensure_schema(url) == migrate.head_revision()  # idempotent


def test_newer_database_is_refused(db_url: str, run_sql: Callable[..., list]) -> None:
    run_sql("UPDATE xo_alembic_version SET version_num = '9999'")
    with pytest.raises(migrate.SchemaTooNew, match="9999"):
        migrate.check_schema(db_url)


def test_not_at_head_is_refused_not_recreated(rev1_url: str) -> None:
    with pytest.raises(migrate.SchemaOutOfDate):
        migrate.ensure_schema(rev1_url)  # an old schema is never upgraded silently
    assert migrate.current_revision(rev1_url) == "0001"


def test_downgrade_then_upgrade_again(db_url: str) -> None:
    views = {"xo_v_steps_minute", "xo_v_acceptance", "xo_v_goodput_minute", "xo_v_requests",
             "xo_v_tenant_minute", "xo_v_tenant_acceptance"}
    assert _names(db_url)[1] == views
    command.downgrade(migrate.alembic_config(db_url), "0001")
    assert migrate.current_revision(db_url) == "0001"
    tables, no_views = _names(db_url)
    assert no_views == set() and "xo_step_rollups" not in tables
    migrate.upgrade(db_url)
    assert migrate.check_schema(db_url) == migrate.head_revision()
    assert _names(db_url)[1] == views and _drift(db_url) == []


def test_every_revision_upgrades_rows_written_at_the_first(
    db_url: str, run_sql: Callable[..., list]
) -> None:
    """The first-revision fixture's story on this backend: rows written at 0001 pass
    through every migration (batch ALTERs, data updates, the CHECK constraint) and the
    views read them; downgrading to nothing and back works too."""
    cfg = migrate.alembic_config(db_url)
    command.downgrade(cfg, "0001")
    t = 1_700_000_040.0
    run_sql("INSERT INTO xo_tenants (name, api_key_hash, max_concurrent, created_at) "
            "VALUES ('acme', 'h', 4, :t)", t=t)
    run_sql("INSERT INTO xo_steps (instance, step_id, time, batch_size, prefill_tokens, "
            "decode_tokens, technique, depth, proposed, accepted, accepted_per_pos, propose_ms, "
            "verify_ms, step_ms, kv_pages_used, kv_pages_free, queue_len, policy_version, "
            "preempted, tenants) VALUES ('', 1, :t, 2, 0, 6, 'ngram', 3, 6, 4, '[3, 1, 0]', "
            "0.1, 2.0, 2.5, 1, 9, 0, 0, 0, '[\"acme\"]')", t=t + 5)
    run_sql("INSERT INTO xo_requests (instance, request_id, tenant, prompt_tokens, output_tokens, "
            "arrival_time, first_token_time, finish_time, finish_reason, status, proposed_tokens, "
            "accepted_tokens, preemptions) VALUES ('', 'r1', 'acme', 5, 6, :t, :t, :t, 'stop', "
            "'ok', 6, 4, 0)", t=t + 1)
    run_sql("INSERT INTO xo_retunes (triggered_by, started_at, status, error) "
            "VALUES ('schedule', :t, 'failed', 'skipped: too few steps')", t=t)
    migrate.upgrade(db_url)
    assert migrate.check_schema(db_url) == migrate.head_revision()
    assert run_sql("SELECT name, max_concurrent, max_tokens FROM xo_tenants") == [("acme", 4, None)]
    assert run_sql("SELECT status FROM xo_retunes") == [("skipped",)]  # 0004 rewrote it
    assert run_sql("SELECT technique, proposed, accepted FROM xo_v_acceptance") == [("ngram", 6, 4)]
    assert run_sql("SELECT tenant, requests, accepted FROM xo_v_tenant_minute") == [("acme", 1, 4)]
    with pytest.raises(IntegrityError, match="ck_xo_retunes_status"):  # 0005's constraint
        run_sql("INSERT INTO xo_retunes (triggered_by, started_at, status) "
                "VALUES ('admin', 1.0, 'bogus')")
    assert _drift(db_url) == []
    command.downgrade(cfg, "base")
    assert not any(n.startswith("xo_") for group in _names(db_url) for n in group
                   if n != VERSION_TABLE)
    migrate.upgrade(db_url)
    assert migrate.check_schema(db_url) == migrate.head_revision() and _drift(db_url) == []


def test_optuna_study_shares_the_file(db_url: str, run_sql: Callable[..., list]) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(db_url)
    study = optuna.create_study(study_name="crossover", storage=storage, direction="maximize")
    trial = study.ask()
    study.tell(trial, trial.suggest_int("depth", 1, 8) * 1.5)
    del storage, study

    assert migrate.check_schema(db_url) == migrate.head_revision()
    migrate.upgrade(db_url)  # a no-op that must not touch Optuna's tables
    loaded = optuna.load_study(study_name="crossover", storage=db_url)
    assert len(loaded.trials) == 1 and loaded.best_value == trial.params["depth"] * 1.5
    tables = _names(db_url)[0]
    assert {"alembic_version", "xo_alembic_version", "studies", "trials", "xo_steps"} <= tables
    assert run_sql("SELECT version_num FROM xo_alembic_version") == [
        (migrate.head_revision(),)
    ]
    assert _drift(db_url) == []  # Optuna's tables are not seen as drift


def test_optuna_first_then_crossover(empty_db_url: str) -> None:
    url = empty_db_url
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="s", storage=url)
    assert migrate.is_empty(url)  # Optuna's tables are not crossover's
    assert migrate.ensure_schema(url) == migrate.head_revision()
    assert optuna.load_study(study_name="s", storage=url).study_name == "s"


def test_works_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    migrate.upgrade("elsewhere.db")
    assert migrate.check_schema(str(tmp_path / "elsewhere.db")) == migrate.head_revision()
    assert (migrate.script_location() / "env.py").is_file()


@pytest.mark.parametrize("url", ["postgresql://u:secret@h/db", "mysql://u:secret@h/db"])
def test_schema_renders_for_other_databases(url: str) -> None:
    cfg = migrate.alembic_config(url)
    cfg.output_buffer = io.StringIO()
    command.upgrade(cfg, "head", sql=True)  # offline: no server needed
    sql = cfg.output_buffer.getvalue()
    assert "CREATE TABLE xo_steps" in sql and "CREATE VIEW xo_v_goodput_minute" in sql
    assert "FLOOR(time / 60)" in sql and "CAST(" not in sql  # SQLite's form stays on SQLite
    assert "CREATE TABLE xo_alembic_version" in sql


def test_upgrade_command_hides_passwords() -> None:
    assert migrate.upgrade_command("postgresql://u:secret@h/db") == (
        "crossover db upgrade --db 'postgresql://u:***@h/db'"
    )
