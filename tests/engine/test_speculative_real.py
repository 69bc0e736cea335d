"""Every technique at depths 1..8 on the real Gemma 3 270M: greedy output equals plain decoding,
and so do a seeded sampled request's and a JSON-schema-constrained one's.

One batch of mixed-length prompts from all four workload kinds; the shipped
heads (engine/data) load by default, so MTP, early exit and the draft model
run with their trained weights. Also checks that serving compiled nothing,
that every page came back, and that `crossover plan`'s per-technique memory
formulas match what the loaded proposers really hold.
"""

from __future__ import annotations

import json

import pytest

from engine.policy import NEVER, BatchRule, TunedPolicy
from engine.types import Constraint, SamplingParams
from tests.engine.conftest import run_requests

pytestmark = pytest.mark.slow
TECHNIQUES = ("ngram", "mtp", "early_exit", "draft")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def engine():
    from engine.loader import load_engine
    from engine.runtime.compiles import memory_mappings

    before = memory_mappings()
    e = load_engine(dtype="float32", max_batch=4, max_context=128, progress=False, speculation=True,
                    spec_max_batch=4)
    e.warmup(progress=False)
    e.test_mappings_added = None if before is None else memory_mappings() - before
    return e


def test_warmup_maps_well_under_the_hosts_default_mapping_cap(engine):
    """XLA:CPU maps every compiled kernel (Linux stops a process at vm.max_map_count, 65530 by
    default): loading and warming up every ragged call and proposer stays under half of it."""
    import jax

    if engine.test_mappings_added is None or jax.default_backend() != "cpu":
        pytest.skip("counts XLA:CPU's memory mappings in /proc/self/maps")
    assert {"early_exit", "draft"} <= set(engine.proposers)
    assert 0 < engine.test_mappings_added <= 65530 // 2


@pytest.fixture(scope="module")
def prompts(engine):
    from bench.workloads import KINDS, prompts, to_request

    out = []
    for n, kind in zip((96, 64, 40, 16), KINDS):  # mixed lengths, one prompt per kind
        ids = to_request(prompts(kind, 1, seed=3)[0], engine.tokenizer, kind).prompt_ids
        out.append([ids[0]] + ids[-n:])
    return out


def _run(engine, prompts, policy):
    engine.set_policy(policy)
    return run_requests(engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))


@pytest.fixture(scope="module")
def plain(engine, prompts):
    return _run(engine, prompts, NEVER)[0]


def test_all_four_techniques_are_loaded(engine):
    assert set(TECHNIQUES) <= set(engine.proposers)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_greedy_speculation_equals_plain_on_the_real_model(engine, prompts, plain, technique):
    accepted = 0
    for depth in range(1, 9):
        policy = TunedPolicy(rules=(BatchRule(4, technique, depth),), crossover=4, pool_split=0.25,
                             version=depth)
        out, stats = _run(engine, prompts, policy)
        assert out == plain, f"{technique} depth {depth}"
        spec = [s for s in stats if s.technique == technique]
        assert spec, f"{technique} depth {depth} never speculated"
        accepted += sum(s.accepted for s in spec)
        assert engine.pool.used == 0
    assert accepted > 0, f"{technique} never had a draft accepted"
    assert engine.compiles_since_warmup() == 0


SAMPLED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_sampled(engine, prompts):
    engine.set_policy(NEVER)
    return run_requests(engine, prompts, SAMPLED)[0]


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_seeded_sampled_output_does_not_depend_on_speculation_on_the_real_model(engine, prompts,
                                                                                plain_sampled,
                                                                             technique):
    """Sampled verification draws with the numbers plain decoding uses at each position."""
    for depth in (2, 6):
        engine.set_policy(TunedPolicy(rules=(BatchRule(4, technique, depth),), crossover=4, pool_split=0.25))
        out, stats = run_requests(engine, prompts, SAMPLED)
        assert out == plain_sampled, f"{technique} depth {depth}"
        assert any(s.technique == technique and s.sampled_rows for s in stats)
        assert engine.pool.used == 0


def test_plan_memory_formulas_match_the_loaded_proposers(engine):
    from engine.memory.spec_memory import technique_costs

    rc = engine.runner.rc
    costs = {c.technique: c for c in technique_costs(engine.cfg, "float32", "float32", 128, rc.page_size,
                                                     8, sequence_bytes=1)}
    for name in TECHNIQUES:
        real = engine.proposers[name].resident_bytes()
        assert abs(real - costs[name].resident_bytes) <= 0.02 * max(real, 1), name


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
CONSTRAINED = SamplingParams(max_tokens=30, constraint=Constraint("json", json.dumps(PERSON)))  # + 97: in 128


@pytest.fixture(scope="module")
def plain_constrained(engine, prompts):
    engine.set_policy(NEVER)
    return run_requests(engine, prompts, CONSTRAINED)[0]


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_greedy_constrained_output_is_the_same_with_each_technique(engine, prompts, plain_constrained,
                                                                   technique):
    """Drafts cut at the first token the grammar refuses, each verified position masked by the
    grammar's state after the drafts before it: the same JSON as plain decoding."""
    for out in plain_constrained:
        text = engine.tokenizer.decode(out)
        if out[-1] in engine.tokenizer.stop_ids or len(out) < CONSTRAINED.max_tokens:
            obj = json.loads(text)
            assert set(obj) == {"name", "age", "tags"} and isinstance(obj["age"], int), text
    for depth in (2, 4):
        engine.set_policy(TunedPolicy(rules=(BatchRule(4, technique, depth),), crossover=4, pool_split=0.25))
        out, stats = run_requests(engine, prompts, CONSTRAINED)
        assert out == plain_constrained, f"{technique} depth {depth}"
        assert any(s.technique == technique for s in stats)
        assert engine.pool.used == 0
    assert engine.compiles_since_warmup() == 0
