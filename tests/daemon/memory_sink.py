"""A telemetry sink that keeps everything in lists, for tests that read what the engine sent."""

from __future__ import annotations

from engine.types import RequestResult, StepStats


class MemorySink:
    """Keeps every step and result (`daemon.bridge.Sink`); counts flushes."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.results: list[RequestResult] = []
        self.flushed = 0

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_result(self, result: RequestResult) -> None:
        self.results.append(result)

    def flush(self) -> None:
        self.flushed += 1
