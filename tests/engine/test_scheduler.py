"""Continuous batching: leaks, preemption by recompute, stops, aborts, compiles."""

from __future__ import annotations

import random

import pytest

from engine.types import Request, SamplingParams
from tests.engine.conftest import ByteTokenizer, LetterTokenizer, make_engine

TOK = ByteTokenizer()
WORDS = "alpha beta gamma delta the of and stop end x y z".split()


def _drive(engine, reqs, abort_p=0.0, rng=None):
    """Run until idle; optionally abort random live requests. Returns events and results by id."""
    for r in reqs:
        engine.add_request(r)
    events, results, live = {}, {}, {r.request_id for r in reqs}
    while engine.has_work():
        if rng and live and rng.random() < abort_p:
            engine.abort(rng.choice(sorted(live)))
        out = engine.step()
        for ev in out.events:
            events.setdefault(ev.request_id, []).append(ev)
        for res in out.finished:
            assert res.request_id not in results, "a request finished twice"
            results[res.request_id] = res
            live.discard(res.request_id)
    return events, results


def test_thousands_of_random_requests_leak_no_page(tiny):
    rng = random.Random(0)
    engine = make_engine(tiny, global_pages=40, local_pages=40)  # small: forces waiting and preemption
    reqs = []
    for i in range(2000):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12))) or "a"
        sp = SamplingParams(
            max_tokens=rng.randint(1, 12),
            temperature=rng.choice([0.0, 0.7, 1.2]),
            top_k=rng.choice([0, 5]),
            stop=tuple(rng.sample(["e", "ta", "zz"], rng.randint(0, 2))),
            stop_token_ids=tuple(rng.sample(range(3, 259), rng.randint(0, 3))),
            seed=i,
        )
        reqs.append(Request(f"r{i}", TOK.encode(prompt), sp))
    events, results = _drive(engine, reqs, abort_p=0.05, rng=rng)
    assert len(results) == len(reqs)
    assert {r.finish_reason for r in results.values()} >= {"stop", "length", "abort"}
    for evs in events.values():
        assert evs[-1].finished and not any(e.finished for e in evs[:-1])
    assert engine.pool.used == 0
    assert engine.pool.free == engine.pool.total
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine._seqs


def test_preemption_by_recompute_keeps_greedy_output(tiny):
    prompts = [TOK.encode(f"prompt number {i} " * (i + 1)) for i in range(6)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)

    def run(engine):
        ev, res = _drive(engine, [Request(f"r{i}", p, sp) for i, p in enumerate(prompts)])
        toks = {k: [t for e in v for t in e.token_ids] for k, v in ev.items()}
        return toks, sum(r.preemptions for r in res.values())

    roomy, n0 = run(make_engine(tiny))
    tight, n1 = run(make_engine(tiny, global_pages=34, local_pages=40))
    assert n0 == 0 and n1 > 0
    assert tight == roomy


def test_a_request_larger_than_the_pool_is_refused(tiny):
    engine = make_engine(tiny, global_pages=10)
    with pytest.raises(ValueError, match="pool"):
        engine.add_request(Request("big", TOK.encode("x" * 30), SamplingParams(max_tokens=20)))
    assert not engine.has_work()


def test_stop_string_cuts_text_and_stop_id_ends(tiny):
    engine = make_engine(tiny, LetterTokenizer())
    free_run, _ = _drive(engine,
                         [Request("a", TOK.encode("abc"), SamplingParams(max_tokens=30, ignore_eos=True))])
    text = "".join(e.text for e in free_run["a"])
    toks = [t for e in free_run["a"] for t in e.token_ids]
    assert len(text) == 30
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    ev, res = _drive(engine, [Request("b", TOK.encode("abc"),
                                      SamplingParams(max_tokens=30, stop=(stop,), ignore_eos=True))])
    got = "".join(e.text for e in ev["b"])
    assert got == text[: text.find(stop)] and res["b"].finish_reason == "stop"
    ev, res = _drive(engine, [Request("c", TOK.encode("abc"),
                                      SamplingParams(max_tokens=30, stop_token_ids=(toks[3],)))])
    assert [t for e in ev["c"] for t in e.token_ids] == toks[: toks.index(toks[3]) + 1]
    assert res["c"].finish_reason == "stop"


def test_a_stop_string_inside_several_new_tokens_ends_the_tokens_where_one_at_a_time_would():
    from engine.execute.sequence import Detokenizer, Sequence, append_tokens, request_key

    letters = LetterTokenizer()  # id i is letter i: 0 1 2 3 4 is "abcde"
    sp = SamplingParams(max_tokens=8, stop=("cd",), ignore_eos=True)
    seq = Sequence(Request("s", [7], sp), [7], 1, request_key(0), Detokenizer(letters.decode, [7]))
    ev = append_tokens(seq, [0, 1, 2, 3, 4], None, frozenset(), 128)
    assert (ev.token_ids, ev.text, ev.finish_reason, seq.num_output) == ((0, 1, 2, 3), "ab", "stop", 4)


def test_serving_a_mixed_workload_compiles_nothing_after_warmup(tiny):
    engine = make_engine(tiny)
    engine.warmup(progress=False)
    rng = random.Random(1)
    reqs = [
        Request(f"m{i}", TOK.encode("w " * rng.randint(1, 40)),
                SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 1.0]),
                               top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 3]),
                               logprobs=rng.random() < 0.5, ignore_eos=True))
        for i in range(40)
    ]
    _, results = _drive(engine, reqs, abort_p=0.02, rng=rng)
    assert len(results) == 40
    assert engine.compiles_since_warmup() == 0


def _seq(rid: str, n: int):
    from engine.execute.sequence import Detokenizer, Sequence, request_key

    ids = [5] * n
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    return Sequence(Request(rid, ids, sp), ids, n, request_key(None), Detokenizer(TOK.decode, ids[-4:]))


def test_a_long_prompt_is_capped_while_others_decode():
    """3 rows decode: a long prompt's chunk is mix_chunk(3, 4) = 16 tokens; alone it takes the
    budget."""
    from engine.memory.kv import KVPool
    from engine.step.scheduler import Scheduler, SchedulerConfig, mix_chunk

    assert mix_chunk(3, 4) == 16
    pool = KVPool(300, 300, 4, 8, None)
    cfg = SchedulerConfig(max_batch=8, token_budget=512, max_chunk=512, mix_tokens_per_row=4, mix_long=64)
    sched = Scheduler(cfg, pool)
    for i in range(3):
        sched.add(_seq(f"s{i}", 10))
    plan = sched.schedule()
    assert [n for _, n in plan.prefill] == [10, 10, 10]
    for seq, n in plan.prefill:  # prefilled: each decodes from the next step on
        seq.num_cached, seq.tokens = n, seq.tokens + [7]
    sched.add(_seq("long", 600))
    plan = sched.schedule()
    assert len(plan.decode) == 3 and [(s.request_id, n) for s, n in plan.prefill] == [("long", 16)]
    alone = Scheduler(cfg, KVPool(300, 300, 4, 8, None))
    alone.add(_seq("long", 600))
    assert [n for _, n in alone.schedule().prefill] == [512]
