"""Fault isolation on the tiny model: a sequence's own fault fails it alone; a fault no
sequence owns (the forward call) propagates and `recover()` leaves the engine ready again."""

from __future__ import annotations

import pytest

import engine.step.core as core_module
import engine.step.ragged_step as ragged_step_module
from engine.execute import ragged_calls
from engine.policy import BatchRule, TunedPolicy
from engine.speculation.proposers import NgramProposer
from engine.types import Request, SamplingParams
from tests.engine.conftest import SPEC_RC, ByteTokenizer, make_engine

TOK = ByteTokenizer()
PROMPTS = {"r0": "abcabcabc abc", "bad": "the cat sat on the", "r1": "x", "r2": "one two one two"}
SP = SamplingParams(max_tokens=12, ignore_eos=True)


def _drive(engine, prompts=PROMPTS, sp=SP, seeds=None):
    """Submit every prompt, step until idle: (token ids by id, finish reason by id)."""
    for rid, text in prompts.items():
        s = sp if seeds is None else SamplingParams(**{**sp.__dict__, "seed": seeds.get(rid)})
        engine.add_request(Request(rid, TOK.encode(text), s))
    tokens = {rid: [] for rid in prompts}
    reasons = {}
    for _ in range(500):
        if not engine.has_work():
            break
        out = engine.step()
        for ev in out.events:
            tokens[ev.request_id] += ev.token_ids
            if ev.finished:
                assert ev.request_id not in reasons, "a request finished twice"
                reasons[ev.request_id] = ev.finish_reason
                assert ev.finish_reason != "error" or ev.text == ""
        assert {r.request_id for r in out.finished} == {e.request_id for e in out.events if e.finished}
    assert not engine.has_work()
    return tokens, reasons


@pytest.fixture(scope="module")
def clean(tiny):
    """Greedy tokens of the good prompts, without any fault."""
    good = {k: v for k, v in PROMPTS.items() if k != "bad"}
    return _drive(make_engine(tiny, **SPEC_RC), good)[0]


def _patch_forward(engine, monkeypatch, flaky_of):
    """Run every forward call of `engine`'s steps through `flaky_of(real)`, real(call) dispatching
    the ragged call a step makes (its own, or the next step's, engine/step/ahead.py)."""
    real = ragged_calls.launch
    flaky = flaky_of(lambda c: real(engine.runner, c))
    monkeypatch.setattr(ragged_calls, "launch", lambda runner, c: flaky(c))


def _only_bad_failed(engine, tokens, reasons, clean):
    assert reasons == {"r0": "length", "r1": "length", "r2": "length", "bad": "error"}
    assert {k: tokens[k] for k in clean} == clean
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total
    assert not engine._seqs and not engine.scheduler.running and not engine.scheduler.waiting


def test_a_fault_in_one_sequences_stop_rules_fails_it_alone(tiny, clean, monkeypatch):
    real = core_module.append_tokens

    def flaky(seq, *args):
        if seq.request_id == "bad" and seq.num_output >= 3:
            raise UnicodeError("detokenizer broke")
        return real(seq, *args)

    monkeypatch.setattr(core_module, "append_tokens", flaky)
    engine = make_engine(tiny, **SPEC_RC)
    tokens, reasons = _drive(engine)
    _only_bad_failed(engine, tokens, reasons, clean)
    assert len(tokens["bad"]) == 3  # tokens sent before the fault stay sent


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_fault_in_one_sequences_sampling_inputs_fails_it_alone(tiny, clean, phase, monkeypatch):
    engine = make_engine(tiny, **SPEC_RC)
    real = ragged_step_module._sampling

    def flaky(core, item):
        seq = item[0]
        if seq.request_id == "bad" and (phase == "prefill" or seq.num_output >= 2):
            raise OverflowError("bad sampling value")
        return real(core, item)

    monkeypatch.setattr(ragged_step_module, "_sampling", flaky)
    tokens, reasons = _drive(engine)
    _only_bad_failed(engine, tokens, reasons, clean)


def test_a_fault_at_admission_fails_that_request_alone(tiny, clean, monkeypatch):
    real = core_module.request_key

    def flaky(seed):
        if seed == 13:
            raise ValueError("no such seed")
        return real(seed)

    monkeypatch.setattr(core_module, "request_key", flaky)
    engine = make_engine(tiny, **SPEC_RC)
    tokens, reasons = _drive(engine, seeds={"bad": 13})
    _only_bad_failed(engine, tokens, reasons, clean)


def test_a_fault_in_one_sequences_proposer_fails_it_alone(tiny, clean, monkeypatch):
    engine = make_engine(tiny, **SPEC_RC)
    engine.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 3),), crossover=64, version=1))
    real, calls = NgramProposer.propose, []

    def flaky(self, seqs, depth):
        calls.append(len(seqs))
        if any(s.request_id == "bad" and s.num_output >= 2 for s in seqs):
            raise IndexError("proposer bug")
        return real(self, seqs, depth)

    monkeypatch.setattr(NgramProposer, "propose", flaky)
    tokens, reasons = _drive(engine)
    _only_bad_failed(engine, tokens, reasons, clean)  # greedy speculation is lossless
    assert 1 in calls and max(calls) > 1  # the batch proposed together, then each alone


def test_a_proposer_fault_no_sequence_reproduces_propagates(tiny, monkeypatch):
    engine = make_engine(tiny, **SPEC_RC)
    engine.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 3),), crossover=64, version=1))
    real = NgramProposer.propose

    def batch_fault(self, seqs, depth):  # fails for every batch, never for a sequence alone
        if len(seqs) > 1:
            raise MemoryError("proposer out of memory")
        return real(self, seqs, depth)

    monkeypatch.setattr(NgramProposer, "propose", batch_fault)
    for rid, text in PROMPTS.items():
        engine.add_request(Request(rid, TOK.encode(text), SP))
    with pytest.raises(MemoryError):
        for _ in range(50):
            engine.step()
    assert len(engine.recover()) == len(PROMPTS)
    assert engine.pool.used == 0


@pytest.mark.parametrize("lose_kv", [False, True])
def test_a_forward_fault_propagates_and_recover_ends_everything(tiny, clean, lose_kv, monkeypatch):
    engine = make_engine(tiny, **SPEC_RC)
    calls = []

    def flaky_of(real):
        def flaky(c):
            calls.append(1)
            if len(calls) == 6:
                if lose_kv:  # as if the KV arrays were donated to a call that then failed
                    for a in (engine.runner.kv.global_k, engine.runner.kv.local_v):
                        a.delete()
                raise RuntimeError("device error")
            return real(c)
        return flaky

    _patch_forward(engine, monkeypatch, flaky_of)
    for rid, text in PROMPTS.items():
        engine.add_request(Request(rid, TOK.encode(text), SP))
    engine.add_request(Request("queued", TOK.encode("q"), SP))
    with pytest.raises(RuntimeError, match="device error"):
        for _ in range(50):
            engine.step()
    engine.add_request(Request("late", TOK.encode("late"), SP))  # in the inbox at the fault
    engine.set_policy(TunedPolicy(version=9))  # policies queued at the fault survive recovery
    results = engine.recover()
    assert sorted(r.request_id for r in results) == sorted([*PROMPTS, "queued", "late"])
    assert {r.finish_reason for r in results} == {"error"}
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.total
    assert not engine._seqs and not engine.scheduler.running and not engine.scheduler.waiting
    engine.step()
    assert engine.policy.version == 9 and not engine.has_work()
    good = {k: v for k, v in PROMPTS.items() if k != "bad"}
    assert _drive(engine, good)[0] == clean  # the engine serves as before, same tokens


def test_recover_reports_the_requests_the_failed_step_had_already_ended(tiny, monkeypatch):
    engine = make_engine(tiny, **SPEC_RC)
    real = ragged_step_module._sampling

    def fails_short(core, item):
        if item[0].request_id == "short":
            raise OverflowError("bad sampling value")
        return real(core, item)

    def call_fails_of(real_call):
        def call_fails(c):
            raise RuntimeError("device error")
        return call_fails

    monkeypatch.setattr(ragged_step_module, "_sampling", fails_short)
    _patch_forward(engine, monkeypatch, call_fails_of)
    engine.add_request(Request("short", TOK.encode("a"), SamplingParams(max_tokens=1)))
    engine.add_request(Request("other", TOK.encode("b"), SP))
    with pytest.raises(RuntimeError):
        engine.step()  # "short" fails alone before the call, then the call raises
    results = {r.request_id: r for r in engine.recover()}
    assert set(results) == {"short", "other"} and {r.finish_reason for r in results.values()} == {"error"}
    assert results["short"].output_tokens == 0
    assert engine.recover() == [] and engine.pool.used == 0


def test_a_step_with_nothing_runnable_preempts_instead_of_raising(tiny, clean):
    engine = make_engine(tiny, **SPEC_RC)
    good = {k: v for k, v in PROMPTS.items() if k != "bad"}
    real, calls = engine.scheduler.schedule, []

    def stalls_once():
        calls.append(1)
        plan = real()
        if len(calls) == 4:  # running sequences, yet a plan with nothing to run
            assert engine.scheduler.running
            return type(plan)()
        return plan

    engine.scheduler.schedule = stalls_once
    tokens, reasons = _drive(engine, good)
    assert tokens == clean and set(reasons.values()) == {"length"}
    assert engine.pool.used == 0


def test_the_engine_thread_restarts_the_tiny_engine_after_forward_faults(tiny, monkeypatch):
    """Through daemon.bridge: one fault fails the request in flight and the loop serves again;
    faults past the bound fail the thread for good."""
    import asyncio

    from daemon.bridge import EngineError, EngineThread

    engine = make_engine(tiny, **SPEC_RC)
    faults = []

    def flaky_of(real):
        def flaky(c):
            if faults and faults[0] > 0:
                faults[0] -= 1
                raise RuntimeError("device error")
            return real(c)
        return flaky

    _patch_forward(engine, monkeypatch, flaky_of)

    async def run(rid: str) -> list[int]:
        return [t async for e in thread.submit(Request(rid, TOK.encode("abc abc"), SP)) for t in e.token_ids]

    async def main() -> None:
        thread.start()
        expected = await run("warm")
        faults.append(1)
        with pytest.raises(EngineError):
            await run("hit")
        assert await run("after") == expected and thread.restarts == 1 and thread.failed is None
        assert engine.pool.used == 0
        faults[0] = 99
        with pytest.raises(EngineError):  # max_restarts=1: a second fault within 60 s is final
            await run("again")
        assert isinstance(thread.failed, RuntimeError) and thread.restarts == 1
        with pytest.raises(EngineError):
            thread.submit(Request("refused", TOK.encode("a"), SP))
        await thread.stop()

    thread = EngineThread(engine, warmup=False, max_restarts=1, restart_backoff_s=0.0, restart_reset_s=60.0)
    asyncio.run(main())
