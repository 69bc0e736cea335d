"""Policies and retunes per instance: migration 0006 and store.history's instance argument
(SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from alembic import command
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError

from store import migrate
from store.db import session_scope
from store.history import (
    active_policy,
    draft_vocab_by_instance,
    draft_vocab_by_version,
    finish_retune,
    get_policy,
    get_retune,
    instances,
    last_real_retune_start,
    mark_applied,
    max_policy_version,
    policy_history,
    retune_counts,
    retune_history,
    running_retunes,
    save_policy,
    start_retune,
)

INSERT_POLICY = ("INSERT INTO xo_policies (instance, version, body, source, created_at) "
                 "VALUES (:i, :v, '{}', 'tuner', 1.0)")


def test_0006_makes_versions_unique_per_instance(db_url: str,
                                                  run_sql: Callable[..., list]) -> None:
    cfg = migrate.alembic_config(db_url)
    command.downgrade(cfg, "0005")
    run_sql("INSERT INTO xo_policies (version, body, source, created_at) "
            "VALUES (4, '{}', 'tuner', 1.0)")
    run_sql("INSERT INTO xo_retunes (triggered_by, started_at, status) "
            "VALUES ('admin', 1.0, 'applied')")
    migrate.upgrade(db_url)
    # rows written before belong to the single daemon, ""
    assert run_sql("SELECT instance, version FROM xo_policies") == [("", 4)]
    assert run_sql("SELECT instance, status FROM xo_retunes") == [("", "applied")]
    run_sql(INSERT_POLICY, i="a", v=4)  # another instance may have version 4 too
    with pytest.raises(IntegrityError):
        run_sql(INSERT_POLICY, i="a", v=4)  # but not twice
    with pytest.raises(RuntimeError, match="several instances have policy version 4"):
        command.downgrade(cfg, "0005")
    assert migrate.current_revision(db_url) == migrate.head_revision()
    run_sql("DELETE FROM xo_policies WHERE instance = 'a'")
    command.downgrade(cfg, "0005")
    with pytest.raises(IntegrityError):  # the global UNIQUE(version) is back
        run_sql("INSERT INTO xo_policies (version, body, source, created_at) "
                "VALUES (4, '{}', 'admin', 2.0)")
    migrate.upgrade(db_url)
    assert run_sql("SELECT instance, version FROM xo_policies") == [("", 4)]


def test_history_reads_and_writes_one_instance(db: Engine) -> None:
    with session_scope(db) as s:
        for name, vocab in (("a", 0), ("b", 8192)):
            save_policy(s, 0, {"draft_vocab": 0}, "default", at=1.0, instance=name)
            save_policy(s, 1, {"draft_vocab": vocab}, "tuner", at=2.0, instance=name)
            mark_applied(s, 0, at=1.0, instance=name)
        mark_applied(s, 1, at=3.0, instance="b")
        save_policy(s, 2, {}, "admin", at=4.0, instance="b")
    with session_scope(db) as s:
        assert active_policy(s, instance="a").version == 0
        assert active_policy(s, instance="b").version == 1
        assert active_policy(s) is None  # "" has no policy
        assert max_policy_version(s, instance="a") == 1 and max_policy_version(s) is None
        assert get_policy(s, 1, instance="b").body == {"draft_vocab": 8192}
        with pytest.raises(LookupError, match="instance 'c'"):
            get_policy(s, 1, instance="c")
        assert draft_vocab_by_version(s, instance="b") == {0: 0, 1: 8192, 2: 0}
        assert draft_vocab_by_instance(s)["a"] == {0: 0, 1: 0}
        assert [p.version for p in policy_history(s, instance="a")] == [1, 0]
        assert [(p.instance, p.version) for p in policy_history(s, 2, instance=None)] == [
            ("b", 2), ("b", 1)]
    with pytest.raises(IntegrityError), session_scope(db) as s:
        save_policy(s, 1, {}, "tuner", instance="a")


def test_retunes_per_instance(db: Engine) -> None:
    with session_scope(db) as s:
        a1 = start_retune(s, "admin", at=10.0, instance="a").id
        b1 = start_retune(s, "schedule", at=11.0, instance="b").id
        a2 = start_retune(s, "schedule", at=12.0, instance="a").id
        finish_retune(s, a1, "applied", at=13.0)
        finish_retune(s, a2, "skipped", at=13.0)
    with session_scope(db) as s:
        assert retune_counts(s, instance="a") == {"applied": 1, "skipped": 1}
        assert retune_counts(s, instance="b") == {"running": 1}
        assert retune_counts(s, instance=None) == {"applied": 1, "skipped": 1, "running": 1}
        assert retune_counts(s) == {}
        assert [r.id for r in running_retunes(s, instance="b")] == [b1]
        assert running_retunes(s, instance="a") == []
        assert [r.id for r in retune_history(s, instance="a")] == [a2, a1]
        assert len(retune_history(s, instance=None)) == 3
        assert last_real_retune_start(s, instance="a") == 10.0  # a2 was a skip
        assert last_real_retune_start(s, instance="b") == 11.0
        assert get_retune(s, b1, instance="a") is None and get_retune(s, b1).instance == "b"
        assert instances(s) == ["a", "b"]
