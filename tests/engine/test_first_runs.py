"""First runs (engine/first_runs.py): each compiled shape executes once on the scratch page,
before serving needs it, without compiling, taking pages or changing any output."""

from __future__ import annotations

import dataclasses
import threading

from engine import first_runs, warm
from engine.compiles import compile_count
from engine.policy import BatchRule, TunedPolicy
from engine.types import SamplingParams
from tests.engine.conftest import SPEC_RC, run_prompts
from tests.engine.conftest import make_engine as _make_engine

RC = dict(batch_buckets=(1, 2), context_buckets=(32, 128), verify_tokens=(3,), spec_max_batch=2)
SP = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = ["abcabcabcabcab", "xyzxyzxyz", "hello there, hello there"]
NGRAM = TunedPolicy(rules=(BatchRule(64, "ngram", 2),), crossover=64, version=1)


def make_engine(tiny, tokenizer=None, **rc):
    """The padded steps' engine (EngineConfig.ragged_steps off): what this module tests."""
    return _make_engine(tiny, tokenizer, ragged_steps=False, **rc)


def _ran(monkeypatch) -> list[tuple[str, tuple]]:
    """Record every (kind, shape) FirstRuns executes for its first run (not its timed runs)."""
    ran, timing, cls = [], [], first_runs.FirstRuns
    run, time_ = cls._run, cls._time

    def record(self, kind, shape):
        if not timing:
            ran.append((kind, shape))
        return run(self, kind, shape)

    def timed(self, kind, shape):
        timing.append(shape)
        try:
            time_(self, kind, shape)
        finally:
            timing.pop()

    monkeypatch.setattr(cls, "_run", record)
    monkeypatch.setattr(cls, "_time", timed)
    return ran


def test_every_shape_runs_once_without_compiling_or_changing_outputs(tiny, monkeypatch):
    plain = run_prompts(make_engine(tiny, **RC), PROMPTS, SP)[0]
    e = make_engine(tiny, **RC)
    e.warmup(progress=False)
    e.set_policy(NGRAM)
    ran = _ran(monkeypatch)
    before, used = compile_count(), e.pool.used
    n = e.first_runs.run_all()
    plain_shapes, verify_shapes = e.runner.shapes(), e.runner.verify_shapes()
    assert n == len(plain_shapes) + len(verify_shapes) == len(ran)
    assert sorted(s for k, s in ran if k == "plain") == sorted(plain_shapes)
    assert sorted(s for k, s in ran if k == "verify") == sorted(verify_shapes)
    assert compile_count() == before and e.pool.used == used == 0  # nothing compiled, no page taken
    assert not e.idle() and e.first_runs.left == []  # nothing left for idle moments
    out, stats = run_prompts(e, PROMPTS, SP)
    assert out == plain  # the scratch page's writes reach no sequence (speculation is lossless)
    assert any(s.technique == "ngram" for s in stats) and e.compiles_since_warmup() == 0


def test_decode_and_verify_shapes_at_speculations_context_are_timed_for_the_tuner(tiny):
    from tuner.objective import Capacity, padding_of

    e = make_engine(tiny, **RC)
    assert e.capacity().shape_ms == ()  # nothing timed before the first runs
    e.warmup(progress=False)
    e.first_runs.run_all()
    context = max(e.runner.rc.spec_contexts)
    timed = dict(e.capacity().shape_ms)
    want = {(b, 1) for b, t, c in e.runner.shapes() if t == 1 and c == context}
    want |= {(b, t) for b, t, c in e.runner.verify_shapes() if c == context}
    assert set(timed) == want and {(1, 1), (2, 3)} <= want  # plain decoding and the depth-2 verify
    assert all(0 < ms < 60_000 for ms in timed.values())
    assert padding_of(Capacity.from_engine(e.capacity())).timed == e.capacity().shape_ms


def test_idle_moments_run_one_shape_each_cheapest_first(tiny, monkeypatch):
    e = make_engine(tiny, **{**RC, "verify_tokens": ()})
    e.warmup(progress=False)
    ran = _ran(monkeypatch)
    total = len(e.runner.shapes())
    assert e.idle() and len(ran) == 1 and ran[0] == ("plain", (1, 1, 32))  # batch 1 decode, smallest context
    while e.idle():
        pass
    assert len(ran) == total and e.first_runs.left == []


def test_shapes_still_compiling_wait_until_compiled(tiny, monkeypatch):
    """With the background warmup holding back every shape but the covering ones, only those run;
    the rest run once the background has compiled them."""
    e = make_engine(tiny, **{**RC, "verify_tokens": ()})
    e.ecfg = dataclasses.replace(e.ecfg, background_warmup=True)
    gate, one = threading.Event(), warm._one_shape
    monkeypatch.setattr(warm, "_one_shape", lambda *a, **k: (gate.wait(120), one(*a, **k)))
    ran = _ran(monkeypatch)
    try:
        e.warmup(progress=False)
        usable = e.runner.usable
        assert usable is not None and e.first_runs.run_all() == len(usable)
        assert sorted(s for _, s in ran) == sorted(usable) and not e.idle()
    finally:
        gate.set()
    assert e.spec_warmup.join(600) and e.runner.usable is None
    e.first_runs.run_all()
    assert sorted(s for _, s in ran) == sorted(e.runner.shapes()) and e.compiles_since_warmup() == 0


def test_a_failing_first_run_stops_first_runs_and_serving_goes_on(tiny, monkeypatch, caplog):
    e = make_engine(tiny, **{**RC, "verify_tokens": ()})
    e.warmup(progress=False)
    monkeypatch.setattr(e.runner, "run", lambda c: (_ for _ in ()).throw(RuntimeError("boom")))
    assert e.idle()  # it tried one
    assert e.first_runs.left == [] and "no more first runs" in caplog.text
    monkeypatch.undo()
    out, _ = run_prompts(e, PROMPTS[:1], SP)
    assert len(out[0]) == SP.max_tokens


def test_proposers_shapes_run_once_without_compiling_or_changing_outputs(tiny, monkeypatch):
    """MTP heads, the early-exit and draft-model layer stacks: each shape their warmup compiled
    runs once (on the scratch page of the pools they write), and drafting afterwards compiles
    nothing and decodes what plain decoding does."""
    from engine.drafting import add_model_proposers
    from engine.heads import DraftHeads

    rc = {**SPEC_RC, "verify_tokens": (3, 5), "spec_max_batch": 2, "batch_buckets": (1, 2),
          "context_buckets": (32, 128)}
    plain = run_prompts(make_engine(tiny, **rc), PROMPTS, SP)[0]
    e = make_engine(tiny, **rc)
    add_model_proposers(e, DraftHeads.random(tiny[0], 4, (2,), 128, seed=1, scale=0.3), vocab_sizes=(0, 128))
    e.warmup(progress=False)
    ran = _ran(monkeypatch)
    before = compile_count()
    e.first_runs.run_all()
    own = {name: len(jobs) for name, jobs in e.first_runs.jobs.items()}
    assert own["mtp"] and own["early_exit"] and own["draft"] and own["ngram"] == 0
    assert {k: sum(r[0] == k for r in ran) for k in own if own[k]} == {k: n for k, n in own.items() if n}
    assert compile_count() == before and e.pool.used == 0 and e.first_runs.left == []
    for technique in ("mtp", "early_exit", "draft"):
        e.set_policy(TunedPolicy(rules=(BatchRule(64, technique, 2),), crossover=64, pool_split=0.2,
                                 version=len(technique)))
        out, stats = run_prompts(e, PROMPTS, SP)
        assert out == plain and any(s.technique == technique for s in stats), technique
    assert e.compiles_since_warmup() == 0 and e.pool.used == 0
