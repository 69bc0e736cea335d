"""Policy and retune history: every read and write goes through store.history."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from store import history
from store.db import session_scope
from store.history import finish_retune, mark_applied, mark_rolled_back, save_policy, start_retune


def test_policy_and_retune_history(db: Engine) -> None:
    with session_scope(db) as s:
        for version in (1, 2, 3):
            save_policy(s, version, {"v": version}, "tuner", at=float(version))
            mark_applied(s, version, at=10.0 + version)
        mark_rolled_back(s, 3, "slower", at=20.0)
        first = start_retune(s, "schedule", "crossover", at=1.0)
        second = start_retune(s, "admin", "crossover", at=2.0)
        finish_retune(s, first.id, "applied", chosen_policy_version=2, at=1.5)
        finish_retune(s, second.id, "failed", error="not enough steps", at=2.5)
    with session_scope(db) as s:
        assert [p.version for p in history.policy_history(s, limit=2)] == [3, 2]
        assert history.active_policy(s).version == 2  # 3 was rolled back
        retunes = history.retune_history(s)
        assert [(r.triggered_by, r.status) for r in retunes] == [
            ("admin", "failed"), ("schedule", "applied"),
        ]  # fmt: skip
        assert history.retune_counts(s) == {"applied": 1, "failed": 1}
        assert history.max_policy_version(s) == 3
        assert history.last_real_retune_start(s) == 2.0
        assert [r.id for r in history.retune_history(s, since=1.5)] == [second.id]


def test_running_retunes_and_the_interrupted_status(db: Engine) -> None:
    with session_scope(db) as s:
        done = start_retune(s, "admin", at=1.0).id
        finish_retune(s, done, "applied", at=1.5)
        left = [start_retune(s, "schedule", at=t).id for t in (2.0, 3.0)]
    with session_scope(db) as s:
        assert [r.id for r in history.running_retunes(s)] == left
        finish_retune(s, left[0], "interrupted", error="interrupted: the daemon stopped")
    with session_scope(db) as s:
        assert [r.id for r in history.running_retunes(s)] == left[1:]
        assert history.retune_counts(s) == {"applied": 1, "interrupted": 1, "running": 1}
        with pytest.raises(ValueError, match="status"):
            finish_retune(s, left[1], "running")
