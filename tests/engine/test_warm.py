"""The fast start (engine/warmup/warm.py): plain decoding serves while the proposers' shapes compile in
the background; a technique runs only once its shapes are ready; serving never compiles."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading

from engine.policy import BatchRule, TunedPolicy
from engine.runtime.compiles import (
    compile_ahead,
    compile_count,
    drop_lowering,
    limit_malloc_arenas,
    trim_heap,
)
from engine.speculation.drafting import add_model_proposers
from engine.speculation.heads import DraftHeads
from engine.step.chooser import StepChooser
from engine.types import SamplingParams
from tests.engine.conftest import make_engine, run_prompts

SMALL = dict(max_batch=2, max_context=32, verify_tokens=(3,), spec_max_batch=2)
"""Few shapes: one context, batches 1 and 2, one verify size (depth 2)."""
NGRAM = TunedPolicy(rules=(BatchRule(64, "ngram", 2),), crossover=64, version=1)
SP = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = ["abcabcabcabcab", "xyzxyzxyz", "aaaa", "abab abab"]
"""Short repetitive prompts (n-gram drafts match): the context stays in the 32-token bucket."""


def _background(engine):
    engine.ecfg = dataclasses.replace(engine.ecfg, background_warmup=True)
    return engine


def _gated(engine) -> threading.Event:
    """Hold the background warmup at a first job of the n-gram proposer's until the event is set
    (a second job follows it: a warmup stopped meanwhile leaves n-gram unready)."""
    gate, ngram = threading.Event(), engine.proposers["ngram"]
    jobs = getattr(ngram, "compile_jobs", list)
    held = [lambda: gate.wait(120), lambda: None]
    object.__setattr__(ngram, "compile_jobs", lambda: held + jobs())  # a frozen dataclass
    return gate


def test_plain_decoding_serves_before_speculation_compiles_and_speculation_follows(tiny):
    plain = run_prompts(make_engine(tiny, **SMALL), PROMPTS, SP)[0]
    e = _background(make_engine(tiny, **SMALL))
    gate = _gated(e)
    try:
        e.warmup(progress=False)  # returns with the ragged calls compiled, n-gram's job held
        assert e.warmed_up and e.spec_warmup.running
        assert e.status()["techniques"] == {"ngram": "compiling"}
        e.set_policy(NGRAM)
        before = compile_count()
        out, stats = run_prompts(e, PROMPTS, SP)
        assert out == plain and stats and {s.technique for s in stats} == {"none"}  # ngram not ready
        assert compile_count() == before and e.compiles_since_warmup() == 0  # nothing compiled meanwhile
    finally:
        gate.set()
    assert e.spec_warmup.join(600) and e.status()["techniques"] == {"ngram": "ready"}
    before = compile_count()
    out, stats = run_prompts(e, PROMPTS, SP)
    assert out == plain and any(s.technique == "ngram" for s in stats)
    assert compile_count() == before and e.compiles_since_warmup() == 0


def test_the_serving_process_caps_its_malloc_arenas_and_trims_its_heap():
    assert limit_malloc_arenas(8)  # glibc (Linux): what `crossover serve` does with MALLOC_ARENAS
    trim_heap()


def test_a_dropped_lowering_keeps_its_executable():
    """Deterministic: the lowering in hand is dropped (no heap walk, no garbage collector)."""
    import jax
    import numpy as np

    f = jax.jit(lambda x: x * 2 + 1)
    x = np.arange(5, dtype=np.float32)
    lowered = f.lower(x)
    assert not drop_lowering(lowered)  # not compiled yet: nothing to drop
    assert compile_ahead(lowered)(x).tolist() == [1, 3, 5, 7, 9]  # compiled, then dropped
    assert not drop_lowering(lowered)  # dropped already
    before = compile_count()
    assert f(x).tolist() == [1, 3, 5, 7, 9] and compile_count() == before  # found, not lowered again
    f(np.arange(6, dtype=np.float32))
    assert compile_count() == before + 1  # a new shape still compiles
    again = f.lower(np.arange(7, dtype=np.float32))
    again.compile()
    assert drop_lowering(again) and not drop_lowering(again)


def test_after_warmup_serving_compiles_nothing(tiny):
    plain = run_prompts(make_engine(tiny, **SMALL), PROMPTS, SP)[0]
    e = make_engine(tiny, **SMALL)
    e.warmup(progress=False)
    e.set_policy(NGRAM)
    before = compile_count()
    out, stats = run_prompts(e, PROMPTS, SP)
    assert out == plain and any(s.technique == "ngram" for s in stats)
    assert compile_count() == before and e.compiles_since_warmup() == 0


def test_warmup_freezes_what_it_built_out_of_the_collectors_full_walks(tiny):
    """A full collection walked every object of a warmed-up engine (2 s for Gemma 3 270M with
    every proposer): warmup freezes them (`gc.freeze`), in the foreground and once a
    background warmup is done, so later collections walk only what serving creates."""
    gc.unfreeze()
    e = make_engine(tiny, **SMALL)
    e.warmup(progress=False)
    assert gc.get_freeze_count() > 0
    b = _background(make_engine(tiny, **SMALL))
    gate = _gated(b)
    b.warmup(progress=False)  # plain decoding ready: frozen so far; speculation held back
    gc.unfreeze()
    gate.set()
    assert b.spec_warmup.join(600) and gc.get_freeze_count() > 0  # frozen again when done


def test_model_proposers_compile_in_the_background_and_serve_without_compiling(tiny):
    """MTP heads, early exit and the draft model: each turns ready on the background thread; a
    policy using each then runs it with no compile on the serving thread."""
    cfg = tiny[0]
    e = _background(make_engine(tiny, **SMALL))
    add_model_proposers(e, DraftHeads.random(cfg, 8, (3, 6), 128, seed=1, scale=0.3), vocab_sizes=(128,))
    e.warmup(progress=False)
    assert e.spec_warmup.join(900)
    assert e.status()["techniques"] == dict.fromkeys(("ngram", "mtp", "early_exit", "draft"), "ready")
    for version, technique in enumerate(("mtp", "early_exit", "draft"), 1):
        e.set_policy(TunedPolicy((BatchRule(64, technique, 2),), crossover=64, pool_split=0.2,
                                 version=version))
        _, stats = run_prompts(e, PROMPTS, SP)
        assert any(s.technique == technique for s in stats)
    assert e.compiles_since_warmup() == 0


def test_a_background_warmup_stops_at_close(tiny):
    e = _background(make_engine(tiny, **SMALL))
    gate = _gated(e)
    e.warmup(progress=False)
    e.spec_warmup.stop(timeout_s=0)  # as close() does: no further job starts
    gate.set()  # the job under way (the gate) ends
    e.close()  # waits for it
    assert not e.spec_warmup.running
    assert e.status()["techniques"] == {"ngram": "stopped"}
    e.set_policy(NGRAM)
    _, stats = run_prompts(e, PROMPTS, SP)
    assert {s.technique for s in stats} == {"none"}  # never compiled: never chosen


def test_speculation_above_the_compiled_batches_is_clamped_visibly(tiny, caplog):
    """spec_max_batch 2: a policy speculating to batch 64 is served clamped, which the engine's
    status (/ready) and the log say; batches above 2 decode plainly, smaller ones speculate."""
    e = make_engine(tiny, max_batch=4, max_context=32, verify_tokens=(3,), spec_max_batch=2)
    e.warmup(progress=False)
    e.set_policy(NGRAM)
    with caplog.at_level(logging.WARNING, logger="crossover.engine"):
        _, stats = run_prompts(e, PROMPTS, SP)
    assert "verifies batches up to 2 only" in caplog.text
    assert e.status()["speculation"] == {
        "max_batch": 2, "clamped": {"policy_version": 1, "speculates_up_to": 64, "served_up_to": 2}}
    decoding = [s for s in stats if s.prefill_tokens == 0]  # their batch size is the decode batch
    assert any(s.batch_size > 2 for s in decoding) and any(s.technique == "ngram" for s in stats)
    assert all(s.technique == "none" for s in decoding if s.batch_size > 2)
    e.set_policy(dataclasses.replace(NGRAM, crossover=2, version=2))
    run_prompts(e, PROMPTS, SP)
    assert e.status()["speculation"]["clamped"] is None
    assert e.compiles_since_warmup() == 0


def test_the_chooser_decodes_plainly_where_a_technique_cannot_run():
    import numpy as np

    chooser = StepChooser(np.random.default_rng(0), spec_max_batch=16)
    chooser.start(TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64, "mtp", 3)), crossover=64, version=5))
    assert chooser.clamped == {"policy_version": 5, "speculates_up_to": 64, "served_up_to": 16}
    assert chooser.choose(4) == ("ngram", 2) and chooser.choose(16) == ("mtp", 3)
    assert chooser.choose(17) == ("none", 0) and chooser.choose(64) == ("none", 0)
    chooser.ready = lambda technique: technique != "mtp"  # mtp's shapes still compiling
    assert chooser.choose(4) == ("ngram", 2) and chooser.choose(16) == ("none", 0)
    chooser.start(TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=64))
    assert chooser.clamped is None  # it speculates up to batch 8 only
