"""The buffered telemetry recorder: serving never waits on the database.

    1. `record_step` / `record_request` (any thread: the engine's, the event
       loop's) append the record to a deque under a tiny lock — O(1), no I/O.
       Past `max_buffer` pending rows the record is dropped and counted.
    2. The recorder's own thread wakes every `flush_interval_s` (or early when
       `max_batch` rows are waiting), turns the records into rows and writes
       them in batches, one transaction each.
    3. A failed write (database locked or unavailable) keeps its rows and is
       retried with exponential backoff; new records keep buffering meanwhile.
       Rows a database rejects outright are retried one by one and the bad
       ones dropped (counted as `invalid`).
    4. Every `retention_interval_s` the same thread applies retention.
    5. `close()` stops taking records and flushes everything, retrying until
       its timeout; whatever is still unwritten then is counted as lost.

After a hard kill, what is lost is what arrived since the last flush began:
at most one flush interval (plus the write in progress).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from store.db import make_engine
from telemetry.retention import RetentionConfig, apply_retention
from telemetry.writer import Row, request_row, step_row, write_rows

log = logging.getLogger("crossover.telemetry")
AT_EXIT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RecorderConfig:
    """How the recorder buffers, writes and retries."""

    flush_interval_s: float = 1.0
    """Seconds between flushes; a hard kill loses at most about this much."""
    max_buffer: int = 100_000
    """Most rows held in memory (waiting plus being written); past it, new rows are dropped."""
    max_batch: int = 10_000
    """Most rows per transaction; this many waiting rows also trigger an early flush."""
    busy_timeout_ms: int = 250
    """SQLite busy timeout of the writer's connection; a longer lock is retried."""
    retry_initial_s: float = 0.05
    """First backoff after a failed write."""
    retry_max_s: float = 2.0
    """Longest backoff between retries."""
    retention: RetentionConfig | None = None
    """Retention to apply from the recorder's thread; None leaves the database alone."""
    retention_interval_s: float = 60.0
    """Seconds between retention runs."""
    instance: str = ""
    """Stamped on every row: which daemon wrote it, when several share a database."""

    def validate(self) -> None:
        if self.flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {self.flush_interval_s}")
        if not 1 <= self.max_batch <= self.max_buffer:
            raise ValueError(
                f"need 1 <= max_batch ({self.max_batch}) <= max_buffer ({self.max_buffer})"
            )
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError(
                f"need 0 < retry_initial_s ({self.retry_initial_s}) "
                f"<= retry_max_s ({self.retry_max_s})"
            )
        if self.retention is not None:
            self.retention.validate()


@dataclass
class _Intake:
    """Records of one kind (steps or requests) waiting for the writer thread, and counts of
    those taken and refused; guarded by the recorder's lock."""

    records: deque[Any] = field(default_factory=deque)
    recorded: int = 0
    dropped: int = 0


class Recorder:
    """Buffers step and request records and writes them from its own thread."""

    def __init__(
        self,
        target: str | Engine,
        config: RecorderConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        **overrides: Any,
    ) -> None:
        self.config = replace(config or RecorderConfig(), **overrides)
        self.config.validate()
        self._owns_engine = isinstance(target, str)
        self._engine = (
            make_engine(target, busy_timeout_ms=self.config.busy_timeout_ms)
            if isinstance(target, str)
            else target
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._steps, self._requests = _Intake(), _Intake()
        self._pending = 0
        self._accepting = True
        self._max_buffer = self.config.max_buffer
        self._wake_at = self.config.max_batch
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._thread: threading.Thread | None = None
        self._writer = _WriterState()
        self._deadline = float("inf")

    # -- the caller's side: O(1), never blocks on I/O ---------------------

    def record_step(self, rec: Any) -> bool:
        """Queue one step record (the engine's StepStats); False if dropped."""
        return self._record(self._steps, rec)

    def record_request(self, rec: Any) -> bool:
        """Queue one finished-request record; False if dropped."""
        return self._record(self._requests, rec)

    def _record(self, intake: _Intake, rec: Any) -> bool:
        """Queue `rec` on `intake`, or count it dropped when the buffer is full or closed; wake
        the writer when the pending rows reach a batch."""
        with self._lock:
            if self._pending >= self._max_buffer or not self._accepting:
                intake.dropped += 1
                return False
            intake.records.append(rec)
            self._pending += 1
            intake.recorded += 1
            full = self._pending == self._wake_at
        if full:
            self._wake.set()
        return True

    @property
    def dropped(self) -> int:
        """Rows that never reached the database: buffer full, rejected, or lost at close."""
        with self._lock:
            counted = self._steps.dropped + self._requests.dropped
        return counted + self._writer.invalid + self._writer.lost

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and logs (a snapshot)."""
        with self._lock:
            out: dict[str, Any] = dict(
                recorded_steps=self._steps.recorded, recorded_requests=self._requests.recorded,
                dropped_steps=self._steps.dropped, dropped_requests=self._requests.dropped,
                pending=self._pending,
            )  # fmt: skip
        w = self._writer
        out.update(
            written_steps=w.written_steps, written_requests=w.written_requests,
            invalid=w.invalid, lost_at_close=w.lost, flushes=w.flushes,
            write_errors=w.write_errors, last_error=w.last_error,
            last_flush_ms=round(w.last_flush_s * 1000.0, 3), retention_runs=w.retention_runs,
            rolled_steps=w.rolled_steps, running=self.running,
        )  # fmt: skip
        out["dropped"] = out["dropped_steps"] + out["dropped_requests"] + w.invalid + w.lost
        return out

    # -- life cycle ---------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def writer_cpu_s(self) -> float | None:
        """CPU seconds used so far by the writer thread (None where unsupported)."""
        thread = self._thread
        if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # the thread has exited
            return None

    def start(self) -> Recorder:
        """Start the writer thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="telemetry-recorder", daemon=True
            )
            self._thread.start()
            atexit.register(self._close_at_exit)  # a daemon thread dies silently at exit
        return self

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything recorded so far is written (or dropped); False on timeout."""
        with self._lock:
            target = self._steps.recorded + self._requests.recorded
        deadline = time.monotonic() + timeout
        self._wake.set()  # flush now rather than at the next interval
        with self._progress:
            while self._writer.settled < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self.running:
                    return False
                self._progress.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Stop taking records and flush them all; True when nothing was lost."""
        with self._lock:
            self._accepting = False
        self._deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout + 1.0)
        elif self._pending:
            self._run()  # never started: write what there is, here
        if self._owns_engine:
            self._engine.dispose()
        atexit.unregister(self._close_at_exit)
        return self._pending == 0 and self._writer.lost == 0 and not self.running

    def _close_at_exit(self) -> None:
        self.close(timeout=AT_EXIT_TIMEOUT_S)

    def __enter__(self) -> Recorder:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the recorder's thread --------------------------------------------

    def _run(self) -> None:
        cfg = self.config
        backoff = cfg.retry_initial_s
        next_retention = time.monotonic()  # first run right away: catch up after downtime
        while True:
            due = time.monotonic() + cfg.flush_interval_s  # fixed rate, whatever a flush takes
            # Read the stop flag *before* flushing: rows queued while a flush ran
            # (before close() was called) still get one more flush.
            stopping = self._stop.is_set()
            try:
                ok = self._flush_once()
            except Exception as exc:  # a bug or an odd driver error must not end the writer
                log.exception("telemetry flush failed; retrying with backoff")
                self._writer.last_error = _describe(exc)
                ok = False
            if stopping and (ok or time.monotonic() >= self._deadline):
                break
            if ok and not stopping and cfg.retention and time.monotonic() >= next_retention:
                self._run_retention()
                next_retention = time.monotonic() + cfg.retention_interval_s
            if ok:
                wait, backoff = due - time.monotonic(), cfg.retry_initial_s
            else:
                wait, backoff = backoff, min(backoff * 2, cfg.retry_max_s)
            if stopping:
                time.sleep(max(0.0, min(wait, self._deadline - time.monotonic())))
            elif wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
        self._give_up()

    def _take(self) -> None:
        """Move queued records into the writer's own lists, as rows."""
        with self._lock:
            steps, self._steps.records = self._steps.records, deque()
            requests, self._requests.records = self._requests.records, deque()
        w, instance = self._writer, self.config.instance
        for queue, rows, to_row in (
            (steps, w.steps, step_row),
            (requests, w.requests, request_row),
        ):
            for rec in queue:
                try:
                    rows.append(to_row(rec, instance))
                except Exception as exc:  # a malformed record: drop it, keep going
                    w.last_error = f"bad record {type(rec).__name__}: {exc!r}"
                    self._settle(invalid=1)

    def _flush_once(self) -> bool:
        """Write all taken rows in batches; True when nothing is left unwritten."""
        self._take()
        w, size = self._writer, self.config.max_batch
        started = time.perf_counter()
        while w.steps or w.requests:
            steps = w.steps[:size]
            requests = w.requests[: size - len(steps)]
            bad_steps = bad_requests = 0
            try:
                self._write(steps, requests)
            except (OperationalError, OSError) as exc:  # locked, busy, unreachable: retry later
                self._note_error(exc)
                return False
            except Exception as exc:  # rows the database (or the driver) rejects
                self._note_error(exc)
                bad_steps, bad_requests = self._write_one_by_one(steps, requests)
            del w.steps[: len(steps)], w.requests[: len(requests)]
            self._settle(
                len(steps) - bad_steps, len(requests) - bad_requests, bad_steps + bad_requests
            )
        if w.last_error_active:
            log.info("telemetry writes recovered after %d errors", w.write_errors)
            w.last_error_active = False
        w.flushes += 1
        w.last_flush_s = time.perf_counter() - started
        return True

    def _write(self, steps: list[Row], requests: list[Row]) -> None:
        with self._engine.begin() as conn:
            write_rows(conn, steps, requests)

    def _write_one_by_one(self, steps: list[Row], requests: list[Row]) -> tuple[int, int]:
        """Write each row alone; return how many steps and requests were refused."""
        bad = [0, 0]
        for kind, rows in enumerate((steps, requests)):
            for row in rows:
                try:
                    self._write([row] if kind == 0 else [], [row] if kind == 1 else [])
                except Exception:  # this row is refused (or the database went away)
                    bad[kind] += 1
        return bad[0], bad[1]

    def _settle(self, steps: int = 0, requests: int = 0, invalid: int = 0) -> None:
        """Account rows that left the buffer: written, or dropped as invalid."""
        w = self._writer
        w.written_steps += steps
        w.written_requests += requests
        w.invalid += invalid
        with self._lock:
            self._pending -= steps + requests + invalid
        with self._progress:
            w.settled += steps + requests + invalid
            self._progress.notify_all()

    def _note_error(self, exc: BaseException) -> None:
        w = self._writer
        w.write_errors += 1
        w.last_error = _describe(exc)
        if not w.last_error_active:
            log.warning("telemetry write failed, retrying with backoff: %s", w.last_error)
            w.last_error_active = True

    def _run_retention(self) -> None:
        w = self._writer
        try:
            result = apply_retention(
                self._engine, self.config.retention, self._clock(), self.config.instance
            )
        except Exception as exc:  # the database may be locked: try next time
            w.last_error = f"retention: {_describe(exc)}"
            log.warning("telemetry %s", w.last_error)
            return
        w.retention_runs += 1
        w.rolled_steps += result.rolled_steps

    def _give_up(self) -> None:
        """At the close deadline: count what could not be written as lost."""
        self._take()
        w = self._writer
        left = len(w.steps) + len(w.requests)
        if left:
            log.error("telemetry recorder closing with %d unwritten rows (lost)", left)
            w.lost += left
            w.steps.clear()
            w.requests.clear()
            with self._lock:
                self._pending -= left
            with self._progress:
                w.settled += left
                self._progress.notify_all()


class _WriterState:
    """Rows and counters owned by the writer thread (read, unlocked, by stats())."""

    def __init__(self) -> None:
        self.steps: list[Row] = []
        self.requests: list[Row] = []
        self.written_steps = 0
        self.written_requests = 0
        self.invalid = 0
        self.lost = 0
        self.settled = 0
        self.flushes = 0
        self.write_errors = 0
        self.last_error: str | None = None
        self.last_error_active = False
        self.last_flush_s = 0.0
        self.retention_runs = 0
        self.rolled_steps = 0


def _describe(exc: BaseException) -> str:
    """"Type: first line of the message" (an exception whose message is empty has no line)."""
    first = (str(exc).splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__

