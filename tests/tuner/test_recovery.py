"""What a restart finds: an invalid stored policy, a policy applied but never validated, and
retunes a stopped daemon left "running"; and a tuner output that fails the policy checks."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
from sqlalchemy import Engine

from engine.policy import NEVER, BatchRule, TunedPolicy
from store.db import session_scope
from store.history import (
    active_policy,
    finish_retune,
    get_policy,
    get_retune,
    mark_applied,
    save_policy,
    start_retune,
)
from tests.tuner.conftest import FAST, Host, history
from tuner.keeper import PolicyKeeper
from tuner.search import SearchJob, SearchOutcome, run_search
from tuner.service import Tuner

NO_WAIT = dataclasses.replace(FAST, validation_s=0.0)
STARTER = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4)


def stored(db: Engine, version: int, body: dict, source: str = "admin") -> None:
    """A policy row written straight to the history (as an older daemon may have)."""
    with session_scope(db) as s:
        save_policy(s, version, {**body, "version": version, "source": source}, source)
        mark_applied(s, version)


@pytest.mark.parametrize("bad", [
    {"rules": [{"max_batch": 4, "technique": "ngram", "depth": 2.5}], "crossover": 4},
    {"rules": [{"max_batch": 1.5}], "crossover": 4},
    {"rules": [{"max_batch": 64}], "crossover": 1e300},
    {"rules": [{"max_batch": 64}], "draft_vocab": -5},
    {"rules": "all", "extra": {"pinned": True}},
])
def test_an_invalid_stored_policy_falls_back_to_the_default_with_a_warning(
        db: Engine, host: Host, bad: dict, caplog: pytest.LogCaptureFixture) -> None:
    stored(db, 0, STARTER.to_dict(), "default")
    stored(db, 1, {**bad, "extra": {"pinned": True}})  # an admin's pin, restored at every start
    keeper = PolicyKeeper(db, host, default=STARTER)
    with caplog.at_level(logging.WARNING, logger="crossover.tuner"):
        served = keeper.restore()
    assert served == STARTER and host.policy == STARTER and not keeper.pinned
    assert "cannot restore policy v1" in caplog.text and "PolicyError" in caplog.text
    with session_scope(db) as s:
        assert active_policy(s).version == 1  # left in the history, unrecorded
    assert keeper.apply(NEVER, "admin").version == 2  # and the keeper goes on


def test_a_stop_mid_validation_rolls_the_unvalidated_policy_back_at_the_next_start(
        db: Engine, db_url: str, host: Host, caplog: pytest.LogCaptureFixture) -> None:
    stored(db, 0, STARTER.to_dict(), "default")
    with session_scope(db) as s:
        done = start_retune(s, "schedule", "study").id
        finish_retune(s, done, "applied", chosen_policy_version=1)
        validating = start_retune(s, "admin", "study").id
        searching = start_retune(s, "schedule", "study").id
    applied = dataclasses.replace(STARTER, crossover=2, extra={"retune_id": validating})
    stored(db, 1, applied.to_dict(), "tuner")  # applied, then the daemon died

    tuner = Tuner(db, db_url, PolicyKeeper(db, host, default=NEVER), lambda: None, NO_WAIT)
    with caplog.at_level(logging.WARNING, logger="crossover.tuner"):
        served = tuner.restore()
    assert served.version == 0 and host.policy.crossover == 4 and host.policy.version == 0
    with session_scope(db) as s:
        assert active_policy(s).version == 0
        rolled = get_policy(s, 1)
        assert rolled.rolled_back_at is not None and "never validated" in rolled.rollback_reason
        first, second, third = (get_retune(s, i) for i in (done, validating, searching))
        assert first.status == "applied"  # a finished retune is left alone
        assert second.status == third.status == "interrupted"
        assert second.finished_at is not None and "rolled back" in second.error
        assert second.chosen_policy_version == 1 and second.details["rolled_back"] == 1
        assert third.chosen_policy_version is None and "interrupted" in third.error
    assert "left running" in caplog.text
    assert tuner.recent()[0]["status"] == "interrupted" and tuner.recent()[0]["phase"] == "done"
    tuner.close()


def test_a_stop_after_validation_keeps_the_policy(db: Engine, db_url: str, host: Host) -> None:
    """Only a policy whose retune never finished is rolled back; a pin over it is kept."""
    with session_scope(db) as s:
        running = start_retune(s, "admin").id
    stored(db, 0, STARTER.to_dict(), "default")
    stored(db, 1, dataclasses.replace(STARTER, extra={"retune_id": running}).to_dict(), "tuner")
    stored(db, 2, dataclasses.replace(STARTER, crossover=3, extra={"pinned": True}).to_dict())
    tuner = Tuner(db, db_url, PolicyKeeper(db, host), lambda: None, NO_WAIT)
    assert tuner.restore().version == 2 and tuner.keeper.pinned
    with session_scope(db) as s:
        assert get_policy(s, 1).rolled_back_at is None
        assert get_retune(s, running).status == "interrupted"
    tuner.close()


def invalid_best(job: SearchJob) -> SearchOutcome:
    """A search whose chosen policy never met TunedPolicy's checks (as an unpickled one may)."""
    out = run_search(job)
    best = TunedPolicy((BatchRule(4, "ngram", 2), BatchRule(64)), crossover=4)
    object.__setattr__(best, "crossover", 1e300)
    return dataclasses.replace(out, best=best)


def test_a_tuner_output_that_fails_the_checks_fails_the_retune(
        db: Engine, host: Host, make_tuner: Callable[..., Tuner]) -> None:
    history(db)
    tuner = make_tuner(NO_WAIT, search=invalid_best)
    view = tuner.trigger("admin")[0]
    assert tuner.wait(view["id"], 60)
    r = tuner.get(view["id"])
    assert r["status"] == "failed" and "PolicyError" in r["error"] and "crossover" in r["error"]
    assert host.policy.version == 0 and tuner.keeper.current.version == 0  # never applied


@pytest.mark.parametrize("where", ["record", "commit"])
def test_a_policy_the_database_fails_to_record_is_not_served(
        db: Engine, host: Host, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A locked or full database while a pin is recorded: the pin fails and the engine is
    handed the recorded policy again, so what serves is what the history says."""
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    from tuner import keeper as keeper_module

    keeper = PolicyKeeper(db, host, default=STARTER)
    assert keeper.restore() == STARTER

    def locked(*_a, **_k):
        raise OperationalError("INSERT INTO xo_policies", {}, Exception("database is locked"))

    if where == "record":
        monkeypatch.setattr(keeper_module, "mark_applied", locked)
    else:
        monkeypatch.setattr(Session, "commit", locked)
    with pytest.raises(OperationalError):
        keeper.pin({"rules": [{"max_batch": 64}], "crossover": 0})
    monkeypatch.undo()
    assert host.policy == STARTER and keeper.current == STARTER and not keeper.pinned
    with session_scope(db) as s:
        assert active_policy(s).version == 0
    assert keeper.apply(NEVER, "admin").version == 1  # and the keeper goes on

