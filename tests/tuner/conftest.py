"""Fixtures for the tuner tests: a database at head, a policy host, a tuner factory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine

from engine.policy import TunedPolicy
from tests.tuner import synth
from tuner.capacity import Capacity
from tuner.config import TunerConfig
from tuner.keeper import PolicyKeeper
from tuner.service import Tuner

CAPACITY = Capacity(total_pages=4096, page_size=16, max_depth=4, spec_max_batch=32,
                    proposers={"ngram": (0, 0), "mtp": (0, 0)})
FAST = TunerConfig(trials=12, seed=7, validation_s=5.0, validation_min_steps=60,
                   validation_poll_s=0.05, min_new_steps=100)


class Host:
    """Stands in for the engine: records every policy; `on_apply` simulates serving it."""

    def __init__(self, proposers: tuple[str, ...] = ("ngram", "mtp")) -> None:
        self.applied: list[TunedPolicy] = []
        self.proposers = proposers
        self.on_apply: Callable[[TunedPolicy], None] | None = None
        self.lock = threading.Lock()

    def set_policy(self, policy: TunedPolicy) -> None:
        missing = policy.techniques() - set(self.proposers)
        if missing:
            raise ValueError(f"no proposer for {sorted(missing)}")
        with self.lock:
            self.applied.append(policy)
        if self.on_apply is not None:
            self.on_apply(policy)

    @property
    def policy(self) -> TunedPolicy:
        return self.applied[-1]


def history(db: Engine, n: int = 1500, seed: int = 5, end: float | None = None) -> float:
    """Write a profiled history (version 0, light load: mostly small batches) ending just
    before `end`; returns `end`."""
    end = time.time() if end is None else end
    gen = synth.Synth(seed=seed)
    synth.write(db, gen.explore(n, start=end - n * 0.01 - 1.0, mean_batch=4),
                gen.requests(120, start=end - 20))
    return end


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
def make_tuner(db: Engine, db_url: str, host: Host) -> Iterator[Callable[..., Tuner]]:
    """Factory: `make_tuner(config=..., search=...)` -> a Tuner whose keeper has restored."""
    made: list[Tuner] = []

    def build(config: TunerConfig = FAST, **kwargs: Any) -> Tuner:
        keeper = PolicyKeeper(db, host)
        keeper.restore()
        tuner = Tuner(db, db_url, keeper, lambda: CAPACITY, config, **kwargs)
        made.append(tuner)
        return tuner

    yield build
    for tuner in made:
        tuner.close()
