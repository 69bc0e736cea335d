"""EngineThread: events reach asyncio, leaving early aborts, stop drains, failures surface."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from daemon.bridge import EngineError, EngineThread
from engine.fake import FakeEngine, FakeTokenizer
from engine.types import Request, SamplingParams, StepOutput
from tests.daemon.memory_sink import MemorySink

TOK = FakeTokenizer()


def req(rid: str, prompt: str, max_tokens: int = 64) -> Request:
    return Request(rid, TOK.encode(prompt), SamplingParams(max_tokens=max_tokens))


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


def run_with(engine: FakeEngine, body: Callable[[EngineThread, MemorySink], Awaitable[None]],
             stop_deadline: float = 1.0, **thread_kw: Any) -> MemorySink:
    sink = MemorySink()

    async def main() -> None:
        thread = EngineThread(engine, sink, **thread_kw)
        thread.start()
        await until(lambda: thread.ready)
        try:
            await body(thread, sink)
        finally:
            await thread.stop(stop_deadline)

    asyncio.run(main())
    return sink


def test_events_arrive_in_order_and_telemetry_reaches_the_sink() -> None:
    texts: dict[str, str] = {}

    async def body(thread: EngineThread, sink: MemorySink) -> None:
        async def consume(rid: str, prompt: str) -> None:
            parts = [e.text async for e in thread.submit(req(rid, prompt))]
            texts[rid] = "".join(parts)

        await asyncio.gather(*(consume(f"r{i}", f"prompt {i}") for i in range(10)))
        assert thread.active == 0

    sink = run_with(FakeEngine(max_batch=4), body)
    assert texts == {f"r{i}": f"{i} tpmorp" for i in range(10)}
    assert sorted(r.request_id for r in sink.results) == sorted(texts)
    assert sink.steps and max(s.batch_size for s in sink.steps) <= 4
    assert sink.flushed == 1


def test_cancelling_a_consumer_aborts_its_request() -> None:
    engine = FakeEngine(step_delay_s=0.005)

    async def body(thread: EngineThread, sink: MemorySink) -> None:
        got: list[str] = []

        async def consume() -> None:
            async for event in thread.submit(req("slow", "x" * 200, max_tokens=500)):
                got.append(event.text)

        task = asyncio.create_task(consume())
        await until(lambda: len(got) >= 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await until(lambda: bool(sink.results))
        assert sink.results[0].finish_reason == "abort"
        assert engine.pages_used == 0 and thread.active == 0

    run_with(engine, body)


def test_closing_an_unstarted_stream_aborts() -> None:
    engine = FakeEngine(step_delay_s=0.005)

    async def body(thread: EngineThread, sink: MemorySink) -> None:
        stream = thread.submit(req("never-read", "abc" * 50, max_tokens=400))
        await stream.aclose()
        await until(lambda: bool(sink.results))
        assert sink.results[0].finish_reason == "abort"
        await until(lambda: engine.pages_used == 0)

    run_with(engine, body)


def test_rejected_request_leaves_nothing_registered() -> None:
    async def body(thread: EngineThread, sink: MemorySink) -> None:
        with pytest.raises(ValueError, match="empty"):
            thread.submit(Request("bad", []))
        assert thread.active == 0

    run_with(FakeEngine(), body)


def test_stop_aborts_what_outlives_the_deadline() -> None:
    engine = FakeEngine(step_delay_s=0.01)
    sink = MemorySink()
    reasons: list[str | None] = []

    async def main() -> None:
        thread = EngineThread(engine, sink)
        thread.start()
        stream = thread.submit(req("long", "y" * 300, max_tokens=700))

        async def consume() -> None:
            async for event in stream:
                if event.finished:
                    reasons.append(event.finish_reason)

        task = asyncio.create_task(consume())
        await until(lambda: engine.pages_used > 0)
        started = time.monotonic()
        await thread.stop(drain_deadline_s=0.1)
        assert time.monotonic() - started < 2.0
        await task
        with pytest.raises(EngineError):
            thread.submit(req("late", "z"))

    asyncio.run(main())
    assert reasons == ["abort"]
    assert [r.finish_reason for r in sink.results] == ["abort"]
    assert engine.pages_used == 0 and sink.flushed == 1


class ExplodingEngine(FakeEngine):
    def step(self) -> StepOutput:
        if self.has_work():
            raise RuntimeError("device on fire")
        return super().step()


def test_engine_failure_reaches_waiting_streams_and_new_submits() -> None:
    async def body(thread: EngineThread, sink: MemorySink) -> None:
        with pytest.raises(EngineError) as failure:
            async for _ in thread.submit(req("a", "abc")):
                pass
        assert "device on fire" not in str(failure.value)  # logged, never shown to the client
        assert "device on fire" in str(failure.value.__cause__)
        await until(lambda: thread.failed is not None)
        assert isinstance(thread.failed, RuntimeError)
        assert not thread.ready
        with pytest.raises(EngineError):
            thread.submit(req("b", "abc"))

    run_with(ExplodingEngine(), body, max_restarts=0)  # no restart: the first fault is final


class FlakySink(MemorySink):
    def on_step(self, stats: object) -> None:
        raise RuntimeError("sink bug")


def test_a_failing_sink_does_not_stop_the_engine() -> None:
    sink = FlakySink()

    async def main() -> None:
        thread = EngineThread(FakeEngine(), sink)
        thread.start()
        text = "".join([e.text async for e in thread.submit(req("a", "abc"))])
        assert text == "cba"
        await thread.stop()

    asyncio.run(main())
    assert len(sink.results) == 1


def test_both_engines_have_the_protocols_surface() -> None:
    """daemon/ and tuner/ reach engines only through `Engine`: every member exists on the fake,
    and on EngineCore (checked on the class: building one needs a model)."""
    import typing

    from daemon.engine_surface import Engine
    from engine.step.core import EngineCore

    members = {n for n in vars(Engine) if not n.startswith("_")} | set(typing.get_type_hints(Engine))
    assert {"capacity", "set_policy", "policy", "step", "status"} <= members
    fake = FakeEngine()
    assert all(hasattr(fake, n) for n in members)
    core_members = set(vars(EngineCore)) | {"tokenizer", "model_name", "max_context"}
    assert members <= core_members


def test_the_step_loop_hands_an_idle_engine_its_idle_moments() -> None:
    """The step loop calls `idle()` while the engine has no work (EngineCore runs a shape for the
    first time there), again at once while it reports work done, and never while busy."""

    class IdleFake(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[bool] = []  # has_work() at each idle() call

        def idle(self) -> bool:
            self.calls.append(self.has_work())
            return len(self.calls) < 3  # work for the first two idle moments, then none

    engine = IdleFake()

    async def body(thread: EngineThread, sink: MemorySink) -> None:
        await until(lambda: len(engine.calls) >= 3)
        stream = thread.submit(req("r1", "hello", max_tokens=16))
        async for _ in stream:
            pass

    run_with(engine, body)
    assert len(engine.calls) >= 3 and not any(engine.calls[:3])  # (a submit may race a later one)
