"""What the daemon needs of an engine and of a telemetry sink (daemon/bridge.py drives both).

`Engine` is the surface of `engine.step.core.EngineCore` (and `engine.fake.FakeEngine`) the
daemon and the tuner use; `Sink` receives the engine thread's telemetry; `NullSink` drops it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

from engine.policy import TunedPolicy
from engine.runtime.progress import Reporter
from engine.types import EngineCapacity, Request, RequestResult, StepStats


class Engine(Protocol):
    """The surface of `EngineCore` (and `FakeEngine`) the daemon and the tuner use."""

    tokenizer: Any
    model_name: str
    max_context: int

    def add_request(self, req: Request) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> Any: ...
    def recover(self) -> list[RequestResult]: ...
    def has_work(self) -> bool: ...
    def warmup(self, progress: Reporter = True) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def capacity(self) -> EngineCapacity: ...
    def set_policy(self, policy: TunedPolicy) -> None: ...
    def reset_prefix_cache(self) -> Future: ...

    @property
    def policy(self) -> TunedPolicy: ...


class Sink(Protocol):
    """Receives telemetry on the engine thread; must not block."""

    def on_step(self, stats: StepStats) -> None: ...
    def on_result(self, result: RequestResult) -> None: ...
    def flush(self) -> None: ...


class NullSink:
    """Drops everything."""

    def on_step(self, stats: StepStats) -> None:
        pass

    def on_result(self, result: RequestResult) -> None:
        pass

    def flush(self) -> None:
        pass
