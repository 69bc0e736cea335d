"""Fault isolation through the daemon (FakeEngine): a request's own fault fails it alone with a
500 naming no internals; a fault no request owns fails the requests in flight and restarts the
engine loop, up to a bound past which the engine thread fails for good."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from daemon.bridge import EngineError, EngineThread
from daemon.state import ENGINE_THREAD
from engine.fake import FakeEngine
from engine.types import Request, SamplingParams, StepOutput
from tests.daemon.helpers import MODEL, LiveServer, parse_sse, wait_for

SECRET = "secret internal detail"


def _completion(server: LiveServer, prompt: str, stream: bool = False, max_tokens: int = 32):
    return server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "stream": stream,
                                           "max_tokens": max_tokens})


def _is_error_500(r) -> bool:
    return r.status == 500 and _names_no_internals(r.json())


def _names_no_internals(body: dict) -> bool:
    """An OpenAI-style engine error whose message says nothing of the exception."""
    error = body["error"]
    return (error["type"] == "server_error" and error["code"] == "engine_error"
            and SECRET not in error["message"] and "RuntimeError" not in error["message"])


def test_a_requests_own_fault_fails_it_alone(live: Callable[..., LiveServer]) -> None:
    engine = FakeEngine(max_batch=8, step_delay_s=0.002)

    def fault(request_id: str) -> None:
        seq = engine._running[request_id]
        if "poison" in engine.tokenizer.decode(seq.request.prompt_ids) and seq.produced >= 2:
            raise RuntimeError(SECRET)

    engine.request_fault = fault
    server = live(engine)
    prompts = ["abcdef", "poison pill", "hello there", "poison stream", "xyz"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: _completion(server, p, stream="stream" in p), prompts))
    for prompt, r in zip(prompts, replies):
        assert SECRET.encode() not in r.data
        if "poison" not in prompt:
            assert r.status == 200 and r.json()["choices"][0]["text"] == prompt[::-1]
    assert _is_error_500(replies[1])
    events = parse_sse(replies[3].data)  # a stream: what was sent, an error object, then [DONE]
    assert replies[3].status == 200 and events[-1] == "[DONE]"
    assert _names_no_internals(events[-2])
    assert "".join(e["choices"][0]["text"] for e in events[:-2] if e.get("choices")) == "ma"
    server.wait_idle()
    assert engine.pages_used == 0
    assert server.get("/health").json() == {"status": "ok", "engine_restarts": 0}
    reasons = sorted(r.finish_reason for r in server.sink.results)
    assert reasons == ["error", "error", "stop", "stop", "stop"]


class FaultWhen(FakeEngine):
    """A step with work raises (a "device" fault no request owns) while `when(self)` holds, at
    most `times` times."""

    def __init__(self, when: Callable[[FakeEngine], bool], times: int = 1 << 30, **kw: Any) -> None:
        super().__init__(**kw)
        self.when, self.times, self.faults = when, times, 0

    def step(self) -> StepOutput:
        if self.faults < self.times and self.has_work() and self.when(self):
            self.faults += 1
            raise RuntimeError(SECRET)
        return super().step()


def test_a_fault_no_request_owns_fails_those_in_flight_and_restarts(live: Callable[..., LiveServer]) -> None:
    engine = FaultWhen(lambda e: len(e._running) == 2, times=1, max_batch=8, step_delay_s=0.01)
    server = live(engine, engine_restart_backoff_s=0.05)
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda p: _completion(server, p, stream="stream" in p),
                                ["a long prompt here", "a long stream here"]))
    assert _is_error_500(replies[0])
    events = parse_sse(replies[1].data)
    assert events[-1] == "[DONE]" and _names_no_internals(events[-2])
    assert all(SECRET.encode() not in r.data for r in replies)
    wait_for(lambda: server.get("/health").json() == {"status": "ok", "engine_restarts": 1}, what="restart")
    assert "crossover_engine_restarts_total 1.0" in server.get("/metrics").data.decode()
    assert engine.pages_used == 0
    r = _completion(server, "after")  # the engine serves again
    assert r.status == 200 and r.json()["choices"][0]["text"] == "retfa"
    server.wait_idle()
    assert sorted(r.finish_reason for r in server.sink.results) == ["error", "error", "stop"]


def test_faults_past_the_restart_bound_fail_the_engine_for_good(live: Callable[..., LiveServer]) -> None:
    engine = FaultWhen(lambda e: True)
    server = live(engine, engine_max_restarts=2, engine_restart_backoff_s=0.01)
    for _ in range(3):  # two faults restart the loop, the third is final
        assert _is_error_500(_completion(server, "abc"))
    wait_for(lambda: server.app[ENGINE_THREAD].failed is not None, what="engine failed")
    health = server.get("/health")
    assert health.status == 503 and health.json()["engine_restarts"] == 2
    r = _completion(server, "abc")
    assert r.status == 503 and r.json()["error"]["code"] == "engine_failed"


class HangOnce(FakeEngine):
    """A fake engine whose step with two rows running blocks until `release` is set: a
    device call that hangs, leaving the engine thread alive."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import threading

        self.hanging, self.release = threading.Event(), threading.Event()

    def step(self) -> StepOutput:
        if len(self._running) == 1 and not self.release.is_set():
            self.hanging.set()
            self.release.wait(60)
        return super().step()


def test_a_hung_step_turns_health_503_until_it_returns(live: Callable[..., LiveServer]) -> None:
    engine = HangOnce()
    server = live(engine, step_deadline_s=0.3)
    assert server.get("/health").status == 200
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_completion, server, "hang")
        assert engine.hanging.wait(10)
        wait_for(lambda: server.get("/health").status == 503, what="health 503 while the step hangs")
        health = server.get("/health").json()
        assert health["status"] == "stalled" and health["step_seconds"] >= 0.3
        assert not reply.done()
        engine.release.set()
        assert reply.result(30).status == 200
    wait_for(lambda: server.get("/health").json() == {"status": "ok", "engine_restarts": 0},
             what="health 200 once the step returned")


def test_faults_far_apart_do_not_add_up_to_the_bound() -> None:
    async def main(reset_s: float) -> EngineThread:
        engine = FaultWhen(lambda e: any(rid.startswith("r") for rid in e._live))
        thread = EngineThread(engine, max_restarts=1, restart_backoff_s=0.0, restart_reset_s=reset_s)
        thread.start()
        for i in range(3):
            with pytest.raises(EngineError):
                async for _ in thread.submit(Request(f"r{i}", engine.tokenizer.encode("ab"))):
                    pass
            if thread.failed:
                break
            async for _ in thread.submit(Request(f"ok{i}", engine.tokenizer.encode("ab"))):
                pass
        await thread.stop()
        return thread

    apart = asyncio.run(main(reset_s=0.0))  # every fault is the first of its run
    assert apart.failed is None and apart.restarts == 3
    close = asyncio.run(main(reset_s=60.0))  # the second fault in a minute passes the bound
    assert isinstance(close.failed, RuntimeError) and close.restarts == 1


class Stuck(FakeEngine):
    """Has work it never makes progress on (nothing runnable), until `stuck` is cleared."""

    stuck = True
    steps = 0

    def has_work(self) -> bool:
        return self.stuck or super().has_work()

    def step(self) -> StepOutput:
        self.steps += 1
        return super().step()


def test_a_step_that_makes_no_progress_waits_instead_of_spinning() -> None:
    async def main() -> Stuck:
        engine = Stuck()
        thread = EngineThread(engine, idle_wait_s=0.05)
        thread.start()
        await asyncio.sleep(0.5)
        assert engine.steps <= 20  # about one step per idle wait, not a busy loop
        engine.stuck = False
        text = "".join([e.text async for e in thread.submit(
            Request("a", engine.tokenizer.encode("abc"), SamplingParams(max_tokens=8)))])
        assert text == "cba"  # a wake-up still runs new work at once
        started = time.monotonic()
        await thread.stop()
        assert time.monotonic() - started < 2.0
        return engine

    asyncio.run(main())
