"""Sinks that carry the engine's telemetry to the recorder and the metrics.

Both run on the engine thread (daemon.bridge), so they only buffer: the
Recorder queues a record in O(1) and writes from its own thread. A failure is
logged, never raised into the engine loop; dropped rows (the recorder's
buffer full, or closed) are counted by the recorder and logged at most once
per `DROP_LOG_INTERVAL_S`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from daemon.engine_surface import Sink
from daemon.jsonlog import log_event
from engine.types import RequestResult, StepStats
from telemetry.recorder import Recorder

log = logging.getLogger("crossover.telemetry")

DROP_LOG_INTERVAL_S = 10.0
FLUSH_TIMEOUT_S = 10.0


class FanoutSink:
    """Hands every record to each sink in turn; one failing sink spares the others."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = tuple(sinks)

    def on_step(self, stats: StepStats) -> None:
        for sink in self.sinks:
            _guarded(sink.on_step, stats)

    def on_result(self, result: RequestResult) -> None:
        for sink in self.sinks:
            _guarded(sink.on_result, result)

    def flush(self) -> None:
        for sink in self.sinks:
            _guarded(lambda s: s.flush(), sink)


class RecorderSink:
    """Forwards StepStats and RequestResults to a `telemetry.recorder.Recorder`."""

    def __init__(self, recorder: Recorder, clock: Callable[[], float] = time.monotonic) -> None:
        self.recorder = recorder
        self._clock = clock
        self._last_drop_log = -DROP_LOG_INTERVAL_S

    def on_step(self, stats: StepStats) -> None:
        if not self.recorder.record_step(stats):
            self._dropped()

    def on_result(self, result: RequestResult) -> None:
        if not self.recorder.record_request(result):
            self._dropped()

    def flush(self) -> None:
        """Wait (bounded) until everything recorded so far is written."""
        if self.recorder.running and not self.recorder.flush(timeout=FLUSH_TIMEOUT_S):
            log_event(log, "telemetry flush timed out", level=logging.WARNING,
                      **_brief(self.recorder.stats()))

    def _dropped(self) -> None:
        now = self._clock()
        if now - self._last_drop_log >= DROP_LOG_INTERVAL_S:
            self._last_drop_log = now
            log_event(log, "telemetry rows dropped", level=logging.WARNING,
                      **_brief(self.recorder.stats()))


def _brief(stats: dict[str, Any]) -> dict[str, Any]:
    keys = ("dropped", "pending", "write_errors", "last_error")
    return {k: stats.get(k) for k in keys}


def _guarded(fn: Callable[[Any], None], arg: Any) -> None:
    try:
        fn(arg)
    except Exception:
        log.exception("telemetry sink failed")
