"""First runs (engine/warmup/first_runs.py): each compiled ragged shape, and each proposer's shape once
its technique is ready, executes once on the scratch page before serving needs it, without
compiling, taking pages or changing any output."""

from __future__ import annotations

import dataclasses
import threading

from engine.execute import ragged_calls
from engine.policy import BatchRule, TunedPolicy
from engine.runtime.compiles import compile_count
from engine.types import SamplingParams
from engine.warmup import first_runs
from engine.warmup.warm import max_outputs, max_tokens
from tests.engine.conftest import SPEC_RC, make_engine, run_prompts

RC = dict(max_batch=2, max_context=128, verify_tokens=(3,), spec_max_batch=2)
SP = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = ["abcabcabcabcab", "xyzxyzxyz", "hello there, hello there"]
NGRAM = TunedPolicy(rules=(BatchRule(64, "ngram", 2),), crossover=64, version=1)


def _ran(monkeypatch) -> list[tuple[str, tuple]]:
    """Record every (kind, shape) FirstRuns executes."""
    ran, cls = [], first_runs.FirstRuns
    run = cls._run

    def record(self, kind, shape):
        ran.append((kind, shape))
        return run(self, kind, shape)

    monkeypatch.setattr(cls, "_run", record)
    return ran


def test_every_ragged_shape_runs_once_without_compiling_or_changing_outputs(tiny, monkeypatch):
    plain = run_prompts(make_engine(tiny, **RC), PROMPTS, SP)[0]
    e = make_engine(tiny, **RC)
    e.warmup(progress=False)
    e.set_policy(NGRAM)
    ran = _ran(monkeypatch)
    before, used = compile_count(), e.pool.used
    n = e.first_runs.run_all()
    shapes = ragged_calls.first_run_shapes(max_tokens(e), max_outputs(e))
    assert n == len(shapes) == len(ran) and ran == [("ragged", s) for s in shapes]
    assert len(shapes) >= len(ragged_calls.token_buckets(max_tokens(e)))  # every forward once at least
    assert compile_count() == before and e.pool.used == used == 0  # nothing compiled, no page taken
    assert not e.idle() and e.first_runs.left == []  # nothing left for idle moments
    out, stats = run_prompts(e, PROMPTS, SP)
    assert out == plain  # the scratch page's writes reach no sequence (speculation is lossless)
    assert any(s.technique == "ngram" for s in stats) and e.compiles_since_warmup() == 0


def test_idle_moments_run_one_shape_each_smallest_first(tiny, monkeypatch):
    e = make_engine(tiny, **{**RC, "verify_tokens": ()})
    e.warmup(progress=False)
    ran = _ran(monkeypatch)
    shapes = ragged_calls.first_run_shapes(max_tokens(e), max_outputs(e))
    assert e.idle() and ran == [("ragged", shapes[0])] and shapes[0][0] == min(s[0] for s in shapes)
    while e.idle():
        pass
    assert len(ran) == len(shapes) and e.first_runs.left == []


def test_a_proposers_shapes_wait_until_its_technique_is_ready(tiny, monkeypatch):
    """With the background warmup holding back n-gram's compile job, only the ragged shapes run;
    n-gram's own first run follows once its technique is ready."""
    e = make_engine(tiny, **RC)
    e.ecfg = dataclasses.replace(e.ecfg, background_warmup=True)
    gate, own = threading.Event(), []
    ngram = e.proposers["ngram"]
    object.__setattr__(ngram, "compile_jobs", lambda: [lambda: gate.wait(120)])  # a frozen dataclass
    object.__setattr__(ngram, "first_run_jobs", lambda: [lambda: own.append(1)])
    ran = _ran(monkeypatch)
    try:
        e.warmup(progress=False)
        shapes = ragged_calls.first_run_shapes(max_tokens(e), max_outputs(e))
        assert e.first_runs.run_all() == len(shapes) and not e.idle()
        assert {k for k, _ in ran} == {"ragged"} and own == []
    finally:
        gate.set()
    assert e.spec_warmup.join(600) and e.status()["techniques"] == {"ngram": "ready"}
    assert e.first_runs.run_all() == 1 and ran[-1] == ("ngram", (0,)) and own == [1]
    assert e.first_runs.left == [] and e.compiles_since_warmup() == 0


def test_idle_moments_wait_for_the_background_warmup(tiny, monkeypatch):
    """While speculation's shapes still compile on their thread, an idle moment runs nothing (a
    first run would take the cores from that thread); once they are compiled it runs them."""
    e = make_engine(tiny, **RC)
    e.ecfg = dataclasses.replace(e.ecfg, background_warmup=True)
    gate = threading.Event()
    object.__setattr__(e.proposers["ngram"], "compile_jobs", lambda: [lambda: gate.wait(120)])
    ran = _ran(monkeypatch)
    try:
        e.warmup(progress=False)
        assert e.spec_warmup.running and not e.idle() and ran == []
    finally:
        gate.set()
    assert e.spec_warmup.join(600)
    assert e.idle() and ran[0][0] == "ragged"


def test_a_failing_first_run_stops_first_runs_and_serving_goes_on(tiny, monkeypatch, caplog):
    e = make_engine(tiny, **{**RC, "verify_tokens": ()})
    e.warmup(progress=False)
    monkeypatch.setattr(ragged_calls, "run_padding", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    assert e.idle()  # it tried one
    assert e.first_runs.left == [] and "no more first runs" in caplog.text
    monkeypatch.undo()
    out, _ = run_prompts(e, PROMPTS[:1], SP)
    assert len(out[0]) == SP.max_tokens


def test_proposers_shapes_run_once_without_compiling_or_changing_outputs(tiny, monkeypatch):
    """MTP heads, the early-exit and draft-model layer stacks: each shape their warmup compiled
    runs once (on the scratch page of the pools they write), and drafting afterwards compiles
    nothing and decodes what plain decoding does."""
    from engine.speculation.drafting import add_model_proposers
    from engine.speculation.heads import DraftHeads

    rc = {**SPEC_RC, "verify_tokens": (3, 5), "spec_max_batch": 2, "max_batch": 2,
          "max_context": 128}
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


def test_a_max_batch_one_engine_runs_every_shape_with_its_one_row_slot(tiny):
    """A call has one row slot per token up to max_batch: with max batch 1 and a short context,
    the scratch-page run of a large token bucket is one long row, not several short ones."""
    e = make_engine(tiny, max_batch=1, max_context=32)
    e.warmup(progress=False)
    shapes = ragged_calls.first_run_shapes(max_tokens(e), max_outputs(e))
    assert max(n for n, _ in shapes) > e.runner.rc.max_context // 2  # the case that needs a long row
    used = e.pool.used
    for n, o in shapes:
        ragged_calls.run_padding(e.runner, n, o)
    assert e.pool.used == used == 0
