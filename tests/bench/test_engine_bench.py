"""`crossover bench engine`'s measurements on the tiny real engine, and the allocator restart."""

from __future__ import annotations

import pytest

from bench.engine import _decode_prompt, decode_throughput
from engine.runtime.allocator import HUGE_PAGE_TUNABLE, allocator_env
from tests.engine.conftest import ByteTokenizer, make_engine


def test_decode_throughput_counts_decode_steps_at_each_context_and_their_page_faults(tiny):
    engine = make_engine(tiny, ByteTokenizer(), max_batch=2, max_context=128)
    engine.warmup(progress=False)
    for context in (8, 100):
        r = decode_throughput(engine, 2, context, new_tokens=6)
        assert r["context"] == context and r["batch"] == 2
        assert r["steps"] == 5 and r["tokens_per_s"] > 0  # the first token comes from prefill
        assert r["minor_faults_per_step"] >= 0
    assert engine.pool.used == 0


def test_a_batch_the_pool_never_holds_reads_none_instead_of_dividing_by_zero(tiny):
    engine = make_engine(tiny, ByteTokenizer(), max_batch=1, max_context=128)
    engine.warmup(progress=False)
    r = decode_throughput(engine, 2, 8, new_tokens=4)  # max batch 1: never two rows at once
    assert r["steps"] == 0 and r["tokens_per_s"] is None


def test_long_decode_prompts_share_all_but_their_tails():
    tok = ByteTokenizer()
    a, b = _decode_prompt(tok, 100, 1), _decode_prompt(tok, 100, 2)
    assert len(a) == len(b) == 100 and a[:84] == b[:84] and a[84:] != b[84:]
    short = _decode_prompt(tok, 20, 1), _decode_prompt(tok, 20, 2)
    assert short[0][1:] != short[1][1:]


@pytest.mark.parametrize("env, want", [
    ({}, HUGE_PAGE_TUNABLE),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, f"glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}"),
])
def test_the_allocator_restart_adds_the_huge_page_tunable_once(env, want):
    out = allocator_env(env)
    assert out is not None and out["GLIBC_TUNABLES"] == want
    assert allocator_env(out) is None  # the restarted process does not restart again
    assert allocator_env({**env, "CROSSOVER_MALLOC": "default"}) is None


@pytest.mark.parametrize("flags, named", [
    (["--contexts", "32,x"], "--contexts"),
    (["--contexts", "4090"], "--max-context 4096"),
    (["--contexts", "1"], "--contexts"),
    (["--kv-gib", "0"], "--kv-gib"),
])
def test_bench_engine_refuses_bad_context_and_budget_flags_naming_them(flags, named, capsys):
    from cli.main import main

    assert main(["bench", "engine", *flags]) == 2  # refused before any model loads
    assert named in capsys.readouterr().err
