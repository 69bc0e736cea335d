"""Progress of long operations: tqdm bars on a terminal, JSON log events under `crossover serve`.

The engine, head training and the benches report through a callback,
`progress(label, done, total)`, plus an optional `note(message)` for
informational lines (engine/runtime/progress.py); they draw nothing themselves.
`reporter()` builds what a command passes them:

1. stderr is a terminal: `TerminalProgress`, one tqdm bar per label, closed
   when done reaches total; notes are written above the bars.
2. not a terminal, with `json_events` (`crossover serve`, whose stderr is one
   JSON object per line): `JsonProgress`, a "progress" log event per label at
   most every `interval_s` seconds, plus the last one (done == total); notes
   become log events too. No bar characters reach the log.
3. not a terminal otherwise: True, the engine's "print informational lines,
   draw no bar" (a piped `crossover generate` or bench keeps its lines).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from engine.runtime.progress import Reporter

INTERVAL_S = 2.0
"""Least time between two JSON progress events of one label (the last one is always logged)."""

SCALE_FROM = 1 << 20
"""Totals from which a bar shows its counts scaled (123M/253M) rather than whole (12/40)."""

log = logging.getLogger("crossover.progress")


def reporter(json_events: bool = False, stream: IO[str] | None = None) -> Reporter:
    """The `progress` argument for a command's long operations (module doc)."""
    stream = stream or sys.stderr
    if _is_terminal(stream):
        return TerminalProgress(stream)
    if json_events:
        return JsonProgress()
    return True


def say(message: str) -> None:
    """Print a line on stderr without breaking a terminal bar that is being drawn."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        return False


class TerminalProgress:
    """One tqdm bar per label on `stream`; thread-safe (warmup runs in the engine thread)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._bars: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, label: str, done: int, total: int) -> None:
        from tqdm import tqdm

        with self._lock:
            bar = self._bars.get(label)
            if bar is None:
                # large totals are bytes (hashing, assembling): 123M/253M; small ones count steps: 12/40
                bar = self._bars[label] = tqdm(total=total, desc=label, file=self._stream, leave=True,
                                               unit_scale=total >= SCALE_FROM, dynamic_ncols=True)
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
                del self._bars[label]

    def note(self, message: str) -> None:
        from tqdm import tqdm

        with self._lock:
            tqdm.write(message, file=self._stream)


class JsonProgress:
    """Progress as JSON log events ("progress": label, done, total, seconds since the label began),
    at most one per `interval_s` per label plus the last; notes as plain log events."""

    def __init__(self, logger: logging.Logger = log, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger, self._interval_s, self._clock = logger, interval_s, clock
        self._started: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, label: str, done: int, total: int) -> None:
        from daemon.jsonlog import log_event

        now = self._clock()
        with self._lock:
            start = self._started.setdefault(label, now)
            last = self._last.get(label)
            end = done >= total
            if not end and last is not None and now - last < self._interval_s:
                return
            self._last[label] = now
            if end:
                del self._started[label], self._last[label]
        log_event(self._logger, "progress", label=label, done=done, total=total,
                  seconds=round(now - start, 1))

    def note(self, message: str) -> None:
        from daemon.jsonlog import log_event

        log_event(self._logger, message)
