"""The engine thread and its bridge to asyncio (a queue per request, one task fanning out).

Data flow of one request:

1. A handler on the event loop calls `EngineThread.submit(request)`. It
   registers an `asyncio.Queue` under the request id, calls
   `engine.add_request` (a ValueError unregisters and propagates, so the
   handler answers 400) and sets the wake-up Event.
2. The engine thread runs `engine.warmup()` once, then loops on
   `engine.step()`; when the engine has no work it gives the engine an idle
   moment (`engine.idle()`, where it has one: EngineCore runs one compiled
   shape for the first time, engine/warmup/first_runs.py) and, once that returns
   False, sleeps on the Event.
3. The step's StepStats and RequestResults go to the sink (`on_step`,
   `on_result`) on the engine thread, so sinks must only buffer. This
   happens before step 4, so a stream that has ended has its result recorded.
4. The step's TokenEvents cross to the loop in one
   `loop.call_soon_threadsafe(self._dispatch, events)`; `_dispatch` puts
   each event in its request's queue. Events of requests nobody waits for
   any more are dropped.
5. The handler iterates the `RequestStream`; the event with finished=True
   ends it and unregisters the queue.
6. If the handler stops early (CancelledError when the client disconnects,
   `aclose()`/GeneratorExit, a failed write) the stream calls
   `engine.abort(id)`; the engine answers with a final "abort" event (dropped)
   and a RequestResult (to the sink), which frees the request's pages.
7. `stop(drain_deadline_s)` refuses new submits, lets the engine finish its
   work until the deadline, aborts the rest, steps until idle, joins the
   thread and flushes the sink.

An admin command that must run between two steps (`reset_prefix_cache`) goes
through the engine's inbox too: the engine completes a concurrent Future on
its thread at the next step's start, which the handler awaits (shielded, with
a timeout: a handler giving up leaves the command queued).

Faults. An event with finish_reason "error" (the engine failed that request
alone, engine/step/faults.py) makes its stream raise `EngineError`; the engine
goes on serving the others. If `step()` itself raises (a fault no request
owns), `engine.recover()` ends every request in the engine, every stream in
flight raises `EngineError`, and the loop restarts after a backoff
(`restart_backoff_s`, doubling per restart in a row; a run of
`restart_reset_s` without a fault starts the count again). `restarts`
counts them for /health and /metrics. The fault after `max_restarts`
restarts in a row (or one in warmup or recovery) is final: every waiting
stream raises `EngineError`, submits are refused and `failed` is set; the
daemon's /health turns 503 and `crossover serve` exits 1. A step that makes
no progress (no stats, no events) waits for a wake-up like an idle one, so
work that cannot run yet never spins the thread. Streams never see engine
exception text (it is logged here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from daemon.engine_surface import Engine, NullSink, Sink
from engine.runtime.progress import Reporter
from engine.types import Request, TokenEvent

log = logging.getLogger("crossover.bridge")

ABORT_GRACE_S = 5.0
"""How long the thread keeps stepping after aborting everything at stop."""

RESET_WAIT_S = 60.0
"""How long `reset_prefix_cache` waits for the engine to reach a step boundary."""


class EngineError(RuntimeError):
    """The engine thread died or is stopping, or failed this request; it cannot be served."""


REQUEST_FAILED = "the engine failed while serving this request"
"""What a stream's EngineError says after a fault (the exception text goes to the log only)."""


_Item = TokenEvent | BaseException


class RequestStream:
    """Async iterator over one request's TokenEvents.

    Ends after the event with finished=True. Leaving early (`aclose()`, the
    `async with` block, or cancellation while waiting) aborts the request.
    """

    def __init__(self, owner: EngineThread, request_id: str, queue: asyncio.Queue[_Item],
                 engine_done: asyncio.Event | None = None) -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue = queue
        self._done = False
        self.engine_done = engine_done or asyncio.Event()
        """Set once the engine has sent its last event (or failed the request): what is left
        is the client's reading."""

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self._done = True
            if isinstance(item, EngineError):
                raise item
            raise EngineError(REQUEST_FAILED) from item
        if item.finished:
            self._done = True
            self._owner._release(self.request_id)
            if item.finish_reason == "error":
                raise EngineError(REQUEST_FAILED)
        return item

    def close(self) -> None:
        """Abort the request unless it already finished."""
        if not self._done:
            self._done = True
            self._owner._abandon(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:  # noqa: PYI034
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class EngineThread:
    """Drives `engine.step()` on one thread and fans events out to asyncio."""

    def __init__(
        self,
        engine: Engine,
        sink: Sink | None = None,
        *,
        warmup: bool = True,
        warmup_progress: Reporter = False,
        idle_wait_s: float = 0.05,
        max_restarts: int = 3,
        restart_backoff_s: float = 0.5,
        restart_reset_s: float = 60.0,
    ) -> None:
        self.engine = engine
        self._max_restarts = max_restarts
        self._restart_backoff_s = restart_backoff_s
        self._restart_reset_s = restart_reset_s
        self.restarts = 0
        """Times the step loop was restarted after a fault (for /health and /metrics)."""
        self.restarting = False
        """True while the loop waits out a restart's backoff."""
        self.sink: Sink = sink or NullSink()
        self._warmup = warmup
        self._warmup_progress = warmup_progress
        self._idle_wait_s = idle_wait_s
        self._queues: dict[str, asyncio.Queue[_Item]] = {}  # loop thread only
        self._engine_done: dict[str, asyncio.Event] = {}  # loop thread only: set at the last event
        self._live: set[str] = set()  # guarded by _lock: submitted, not finished
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._abort_at = float("inf")  # monotonic time the thread aborts all at stop
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None
        self._call_started: float | None = None  # monotonic start of the engine call under way

    # ---- loop side ----------------------------------------------------
    def start(self) -> None:
        """Start the thread; call from the event loop that will consume events."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Warmed up and still running."""
        return self._ready.is_set() and self.failed is None and not self._closed

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running (a hung step leaves it alive: see `busy_for`)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def active(self) -> int:
        """Requests submitted whose stream has not ended."""
        return len(self._queues)

    @property
    def engine_active(self) -> int:
        """Requests submitted that the engine has not finished: the daemon's capacity counts
        these, so a client still reading a finished stream holds no engine slot."""
        with self._lock:
            return len(self._live)

    def submit(self, request: Request) -> RequestStream:
        """Hand `request` to the engine; raise ValueError if it rejects it."""
        if self._closed or self.failed is not None or self._thread is None:
            raise EngineError("engine is not accepting requests")
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"duplicate request_id {rid!r}")
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[rid] = queue
        done = self._engine_done[rid] = asyncio.Event()
        with self._lock:  # with _live, atomically: a recovery fails exactly the requests it ended
            self._live.add(rid)
            try:
                self.engine.add_request(request)
            except BaseException:
                self._release(rid)
                self._live.discard(rid)
                raise
        self._wake.set()
        return RequestStream(self, rid, queue, done)

    def abort_all(self) -> int:
        """Abort every unfinished request; return how many."""
        with self._lock:
            ids = list(self._live)
        for rid in ids:
            self.engine.abort(rid)
        self._wake.set()
        return len(ids)

    async def reset_prefix_cache(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Have the engine empty its prefix cache of the blocks no running request holds, between
        two steps on the engine thread, and return what went (`engine.reset_prefix_cache`).
        EngineError when the thread is not serving (warming up, failed, stopping); TimeoutError
        when no step boundary came within `timeout_s` (default RESET_WAIT_S; the reset stays
        queued for the next)."""
        if not self.ready or self._thread is None:
            raise EngineError("engine is not serving")
        done = self.engine.reset_prefix_cache()
        self._wake.set()
        # shielded: a caller giving up must not cancel the command (the engine thread completes it)
        wait = RESET_WAIT_S if timeout_s is None else timeout_s
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), wait)

    async def stop(self, drain_deadline_s: float = 0.0) -> None:
        """Refuse submits, drain until the deadline, abort the rest, join, flush."""
        self._closed = True
        self._abort_at = time.monotonic() + drain_deadline_s
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, drain_deadline_s + ABORT_GRACE_S + 1.0)
            if self._thread.is_alive():
                log.error("engine thread did not stop in time")
        self._fail_all(EngineError("engine stopped"))
        await asyncio.to_thread(self._flush_sink)

    def _release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._engine_finished(request_id)

    def _engine_finished(self, request_id: str) -> None:
        """Set the request's `RequestStream.engine_done` (once)."""
        done = self._engine_done.pop(request_id, None)
        if done is not None:
            done.set()

    def _abandon(self, request_id: str) -> None:
        self._release(request_id)
        with self._lock:
            live = request_id in self._live
        if live:
            self.engine.abort(request_id)
            self._wake.set()

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
                if event.finished:
                    self._engine_finished(event.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
        self._queues.clear()
        for rid in list(self._engine_done):
            self._engine_finished(rid)

    def _fail_ids(self, ids: list[str]) -> None:
        for rid in ids:
            queue = self._queues.pop(rid, None)
            if queue is not None:
                queue.put_nowait(EngineError(REQUEST_FAILED))
            self._engine_finished(rid)

    # ---- engine thread ------------------------------------------------
    def _run(self) -> None:
        try:
            if self._warmup:
                self.engine.warmup(progress=self._warmup_progress)
            self._ready.set()
            self._serve()
        except BaseException as exc:  # the thread must report, never vanish
            log.exception("engine thread failed")
            self.failed = exc
            self._post(self._fail_all, exc)

    def _serve(self) -> None:
        """Run the step loop; after a fault, recover and restart it (see the module doc)."""
        in_a_row, last_fault = 0, float("-inf")
        while True:
            try:
                return self._loop_steps()
            except Exception:
                now = time.monotonic()
                in_a_row = 1 if now - last_fault > self._restart_reset_s else in_a_row + 1
                last_fault = now
                if in_a_row > self._max_restarts or not hasattr(self.engine, "recover"):
                    raise
                log.exception("engine step failed; failing the requests in flight and restarting "
                              "(%d of %d in a row)", in_a_row, self._max_restarts)
                self._recover()
            self.restarts += 1
            self.restarting = True
            self._stopping.wait(self._restart_backoff_s * 2 ** (in_a_row - 1))
            self.restarting = False

    def _recover(self) -> None:
        """End every request the engine holds and fail every stream in flight."""
        with self._lock:
            results = self.engine.recover()
            ids = list(self._live)
            self._live.clear()
        for result in results:
            self._to_sink(self.sink.on_result, result)
        self._post(self._fail_ids, ids)

    def _loop_steps(self) -> None:
        aborted = False
        while True:
            self._wake.clear()
            busy = self.engine.has_work()
            if self._stopping.is_set():
                now = time.monotonic()
                if not busy or now > self._abort_at + ABORT_GRACE_S:
                    return
                if now >= self._abort_at and not aborted:
                    aborted = True
                    log.warning("drain deadline passed; aborting %d requests", self.abort_all())
            if busy and self._step_once():
                continue
            if not busy and not self._stopping.is_set() and self._idle_work():
                continue  # it ran one shape for the first time (EngineCore.idle): look for work again
            self._wake.wait(self._idle_wait_s)  # no progress: wait, never spin

    def _idle_work(self) -> bool:
        """The engine's use of an idle moment (EngineCore.idle; the fake engine has none)."""
        idle = getattr(self.engine, "idle", None)
        if idle is None:
            return False
        self._call_started = time.monotonic()
        try:
            return bool(idle())
        finally:
            self._call_started = None

    @property
    def busy_for(self) -> float:
        """Seconds the engine has spent in the step (or idle moment) under way; 0 between them.
        /health reads it: a device call that hangs shows here while the thread looks alive."""
        started = self._call_started
        return 0.0 if started is None else time.monotonic() - started

    def _step_once(self) -> bool:
        """One step, its telemetry and its events; whether it did anything."""
        self._call_started = time.monotonic()
        try:
            out = self.engine.step()
        finally:
            self._call_started = None
        if out.stats is not None:
            self._to_sink(self.sink.on_step, out.stats)
        for result in out.finished:  # before the events: a finished stream's result is recorded
            self._to_sink(self.sink.on_result, result)
        if out.events:
            with self._lock:
                self._live.difference_update(e.request_id for e in out.events if e.finished)
            self._post(self._dispatch, out.events)
        return out.stats is not None or bool(out.events or out.finished)

    def _post(self, fn: Any, arg: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed just now
                loop.call_soon_threadsafe(fn, arg)

    @staticmethod
    def _to_sink(fn: Any, arg: Any) -> None:
        try:
            fn(arg)
        except Exception:
            log.exception("telemetry sink failed")

    def _flush_sink(self) -> None:
        flush = getattr(self.sink, "flush", None)
        try:
            if flush is not None:
                flush()
        except Exception:
            log.exception("telemetry sink flush failed")
