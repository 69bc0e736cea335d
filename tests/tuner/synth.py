"""Synthetic telemetry from a known ground truth, for the tuner tests.

Step time follows the model's own form with the coefficients below, times
multiplicative noise; each speculating sequence accepts draft i with the
conditional rate ACCEPT[technique][i]. Requests carry per-tenant acceptance
(TENANT_RATE). `write(url, steps, requests)` inserts rows the way the
recorder does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Engine

from engine.policy import TunedPolicy
from engine.types import RequestResult, StepStats
from telemetry.writer import request_row, step_row, write_rows

TARGET = (6.0, 0.05, 0.0, 0.55, 0.01)
"""t0 + t1*B + t2*q + t3*B*q + t4*P (ms); the model fits no q-only term (t2 = 0)."""
PROPOSE = {"ngram": (0.05, 0.02, 0.01), "mtp": (0.3, 0.05, 0.03)}
"""p0 + p1*B + p2*B*depth (ms)."""
ACCEPT = {"ngram": (0.8, 0.7, 0.6, 0.5), "mtp": (0.7, 0.6, 0.5, 0.4)}
TENANT_RATE = {"chat": 0.3, "code": 0.6}
T0 = 1_700_000_000.0


def true_step_ms(technique: str, depth: int, batch: int, prefill: int = 0) -> tuple[float, float]:
    """(step_ms, propose_ms) without noise."""
    q = 1 + depth
    t = TARGET
    target = t[0] + t[1] * batch + t[2] * q + t[3] * batch * q + t[4] * prefill
    p = PROPOSE.get(technique, (0.0, 0.0, 0.0)) if depth else (0.0, 0.0, 0.0)
    propose = p[0] + p[1] * batch + p[2] * batch * depth if depth else 0.0
    return target + propose, propose


@dataclass
class Synth:
    """A seeded generator of steps and requests."""

    seed: int = 1
    noise: float = 0.05
    accept_scale: float = 1.0
    """Multiplies every acceptance rate (0 makes every draft fail)."""
    slowdown: float = 1.0
    """Multiplies every step time (a degraded machine)."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def step(self, t: float, technique: str, depth: int, batch: int, version: int = 0,
             prefill: int = 0, queue: int = 0) -> StepStats:
        per_pos = [0] * depth
        if depth:
            for _ in range(batch):
                for i in range(depth):
                    if self.rng.random() >= ACCEPT[technique][i] * self.accept_scale:
                        break
                    per_pos[i] += 1
        ms, propose = true_step_ms(technique, depth, batch, prefill)
        ms *= self.slowdown * self.rng.uniform(1 - self.noise, 1 + self.noise)
        return StepStats(
            step_id=0, time=t, batch_size=batch, prefill_tokens=prefill,
            decode_tokens=batch + sum(per_pos), technique=technique, depth=depth,
            proposed=batch * depth, accepted=sum(per_pos), accepted_per_pos=tuple(per_pos),
            propose_ms=propose, verify_ms=ms - propose, step_ms=ms, kv_pages_used=0,
            kv_pages_free=0, queue_len=queue, policy_version=version, tenants=("chat", "code"),
        )  # fmt: skip

    def explore(self, n: int, start: float = T0, every_s: float = 0.01, version: int = 0,
                techniques: Sequence[str] = ("none", "ngram", "mtp"), max_batch: int = 32,
                max_depth: int = 4, mean_batch: float | None = None) -> list[StepStats]:
        """Steps at random techniques, depths and batch sizes (a profiled history): batch
        sizes uniform up to max_batch, or geometric-like around `mean_batch` (light load)."""
        out = []
        for k in range(n):
            technique = self.rng.choice(list(techniques))
            depth = 0 if technique == "none" else self.rng.randint(1, max_depth)
            batch = (self.rng.randint(1, max_batch) if mean_batch is None else
                     min(max_batch, 1 + int(self.rng.expovariate(1 / mean_batch))))
            prefill = self.rng.choice((0, 0, 0, 64))
            out.append(self.step(start + k * every_s, technique, depth, batch, version, prefill,
                                 queue=self.rng.randint(0, 3)))
        return out

    def serve(self, policy: TunedPolicy, n: int, start: float, every_s: float = 0.01,
              batches: Sequence[int] = (1, 2, 4, 8, 16)) -> list[StepStats]:
        """Steps of `policy` (its version) at the given batch sizes in turn."""
        out = []
        for k in range(n):
            batch = batches[k % len(batches)]
            technique, depth = policy.choose(batch)
            out.append(self.step(start + k * every_s, technique, depth, batch, policy.version))
        return out

    def requests(self, n: int, start: float = T0, every_s: float = 0.05,
                 tenants: Sequence[str] = ("chat", "code")) -> list[RequestResult]:
        out = []
        for k in range(n):
            tenant = tenants[k % len(tenants)]
            proposed = 100
            accepted = round(proposed * TENANT_RATE[tenant] * self.rng.uniform(0.9, 1.1))
            t = start + k * every_s
            out.append(RequestResult(f"r{k}-{self.seed}", tenant, 40, 60, t, t + 0.05, t + 0.5,
                                     "stop", proposed, accepted))
        return out


def write(engine: Engine, steps: Sequence[StepStats] = (),
          requests: Sequence[RequestResult] = ()) -> None:
    with engine.begin() as conn:
        write_rows(conn, [step_row(s) for s in steps], [request_row(r) for r in requests])
