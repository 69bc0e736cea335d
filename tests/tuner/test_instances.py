"""Several daemons (instances) on one database, from the tuner's side: each keeps its own
policy versions and retunes, reads its own steps for the step-time model, and pools
acceptance over every instance (SQLite and PostgreSQL)."""

from __future__ import annotations

import dataclasses
import threading
import time

from sqlalchemy import Engine

from engine.policy import NEVER, BatchRule, TunedPolicy
from engine.types import StepStats
from store.db import session_scope
from store.history import active_policy, policy_history, retune_counts, start_retune
from telemetry.writer import step_row, write_rows
from tests.tuner import synth
from tests.tuner.conftest import CAPACITY, FAST, Host
from tuner.data import count_step_rows, coverage, read_steps, read_steps_by_instance
from tuner.keeper import PolicyKeeper
from tuner.model import PerfModel
from tuner.search import SearchJob, pool_acceptance, run_search
from tuner.service import Tuner

NGRAM = TunedPolicy(rules=(BatchRule(4, "ngram", 2), BatchRule(NEVER.rules[-1].max_batch)),
                    crossover=4)


def write(db: Engine, instance: str, steps: list[StepStats]) -> None:
    with db.begin() as conn:
        write_rows(conn, [step_row(s, instance) for s in steps], [])


def test_each_instance_keeps_its_own_versions_and_active_policy(db: Engine) -> None:
    hosts = {name: Host() for name in "ab"}
    keepers = {name: PolicyKeeper(db, hosts[name], instance=name) for name in "ab"}
    assert [k.restore().version for k in keepers.values()] == [0, 0]  # both record a version 0
    assert keepers["a"].apply(NGRAM, "tuner").version == 1
    assert keepers["a"].apply(NEVER, "admin").version == 2
    assert keepers["b"].apply(NGRAM, "tuner").version == 1  # not 3: versions count per instance
    with session_scope(db) as s:
        assert active_policy(s, instance="a").version == 2
        assert active_policy(s, instance="b").version == 1
        assert [p.version for p in policy_history(s, instance="b")] == [1, 0]
        assert len(policy_history(s, instance=None)) == 5
    # a restart of "b" serves b's own policy, not a's newer one
    again = PolicyKeeper(db, Host(), instance="b")
    assert again.restore().version == 1 and again.current.rules == NGRAM.rules


def test_two_keepers_racing_on_one_instance_never_share_a_version(db: Engine) -> None:
    """Two processes misconfigured with one instance name: the schema's UNIQUE(instance,
    version) turns the race into a conflict that `apply` retries with the next version."""
    keepers = [PolicyKeeper(db, Host(), instance="same") for _ in range(2)]
    keepers[0].restore()
    keepers[1].restore()
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(keeper: PolicyKeeper) -> None:
        start.wait()
        try:
            for i in range(8):
                keeper.apply(dataclasses.replace(NGRAM, crossover=4 + i), "tuner")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in keepers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    with session_scope(db) as s:
        versions = [p.version for p in policy_history(s, limit=100, instance="same")]
    assert sorted(versions) == list(range(17))  # version 0 and 16 applies, none lost or shared


def test_readers_filter_by_instance(db: Engine) -> None:
    gen = synth.Synth(seed=3)
    now = time.time()
    write(db, "a", gen.explore(40, start=now - 10))
    write(db, "b", [dataclasses.replace(s, technique="mtp", depth=2, batch_size=3)
                    for s in gen.explore(25, start=now - 10)])
    with session_scope(db) as s:
        assert len(read_steps(s, now - 60, instance="a")) == 40
        assert len(read_steps(s, now - 60, instance="b")) == 25
        assert len(read_steps(s, now - 60, instance=None)) == 65
        assert read_steps(s, now - 60) == []  # the default is the single daemon's ""
        by = read_steps_by_instance(s, now - 60)
        assert {k: len(v) for k, v in by.items()} == {"a": 40, "b": 25}
        b_rows = count_step_rows(s, now - 60, instance="b")
        assert b_rows == 75 and count_step_rows(s, now - 60, instance=None) > b_rows
        assert set(coverage(s, now - 60, instance="b")) == {"mtp"}


def test_acceptance_is_pooled_across_instances_and_step_time_is_not(db: Engine) -> None:
    """Instance "a" never drafted with n-gram at depth 3 and ran on slower hardware;
    "b" measured it. a's model takes n-gram acceptance from b's steps (its versions'
    vocabularies mapped apart from a's) and keeps its own step time."""
    now = time.time()
    slow = synth.Synth(seed=4, slowdown=2.0)
    own = [s for s in slow.explore(600, start=now - 30) if s.technique != "ngram"]
    other = synth.Synth(seed=5).explore(900, start=now - 30)
    assert any(s.technique == "ngram" for s in other)
    alone = PerfModel.fit(own)
    assert "ngram" not in alone.acceptance
    pooled, counts = pool_acceptance(alone, "a", own, {}, {"b": (other, {})})
    assert counts == {"a": len(own), "b": len(other)}
    assert pooled.acceptance["ngram"][0] > 0.1
    assert pooled.target == alone.target  # step time: a's own steps only
    # MTP vocabularies follow each instance's own versions: b's version 0 had 8192
    mtp_b = [dataclasses.replace(s, technique="mtp") for s in other if s.technique == "ngram"]
    pooled, _ = pool_acceptance(alone, "a", own, {0: 0}, {"b": (mtp_b, {0: 8192})})
    assert "mtp@8192" in pooled.acceptance and "mtp" in pooled.acceptance


def test_a_search_fits_its_own_steps_and_reports_the_pooled_instances(
        db: Engine, db_url: str) -> None:
    now = time.time()
    gen = synth.Synth(seed=6)
    write(db, "a", gen.explore(700, start=now - 20, mean_batch=4))
    write(db, "b", gen.explore(300, start=now - 20, mean_batch=4))
    job = SearchJob(db_url, dataclasses.replace(FAST, trials=4), CAPACITY, NEVER,
                    since=now - 600, until=now + 1, instance="a")
    outcome = run_search(job)
    assert outcome.acceptance_from == {"a": 700, "b": 300}
    assert 0 < outcome.traffic.steps <= 700  # a's traffic, not b's too


def test_a_restart_closes_only_its_own_instances_running_retunes(db: Engine, db_url: str) -> None:
    with session_scope(db) as s:
        start_retune(s, "admin", instance="b")  # b is mid-retune, alive
        start_retune(s, "admin", instance="a")  # a's, left by a crash
    keeper = PolicyKeeper(db, Host(), instance="a")
    tuner = Tuner(db, db_url, keeper, lambda: CAPACITY, FAST)
    try:
        tuner.restore()
        with session_scope(db) as s:
            assert retune_counts(s, instance="a") == {"interrupted": 1}
            assert retune_counts(s, instance="b") == {"running": 1}
            assert retune_counts(s, instance=None) == {"interrupted": 1, "running": 1}
        assert [r["instance"] for r in tuner.recent()] == ["a"]
        assert tuner.describe()["instance"] == "a"
    finally:
        tuner.close()
