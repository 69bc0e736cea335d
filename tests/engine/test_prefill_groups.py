"""Prefill groups (engine/prefill_groups.py): short prompts' chunks prefill as the rows of one
call, with the outputs of calls of their own, no compile while serving and every page back."""

from __future__ import annotations

from engine.prefill_groups import group_shapes, split_groups
from engine.runner import RunnerConfig
from engine.sequence import Detokenizer, Sequence, request_key
from engine.types import Request, SamplingParams
from tests.engine.conftest import TINY_RC, ByteTokenizer, run_prompts
from tests.engine.conftest import make_engine as _make_engine

SP = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = ["ab", "xyz", "abcd", "hello world!", "q", "a longer prompt, of more than one chunk", "hi", "abc"]
"""Tiny buckets: chunks of at most 4 tokens group; the longer prompts' first chunks run alone."""


def make_engine(tiny, tokenizer=None, **rc):
    """The padded steps' engine (EngineConfig.ragged_steps off): what this module tests."""
    return _make_engine(tiny, tokenizer, ragged_steps=False, **rc)


def _calls(engine) -> list[tuple[int, int]]:
    """(rows, tokens) of every call the runner runs from now on."""
    seen, run = [], engine.runner.run
    engine.runner.run = lambda c: (seen.append(c.tokens.shape), run(c))[1]
    return seen


def test_grouped_prefill_gives_the_outputs_of_prefill_alone(tiny):
    alone_engine = make_engine(tiny)
    alone, _ = run_prompts(alone_engine, PROMPTS, SP)
    e = make_engine(tiny, prefill_rows=4)
    e.warmup(progress=False)
    assert set(group_shapes((1, 2, 4, 8), 4, (32, 128), 4)) <= set(e.runner.shapes())
    calls = _calls(e)
    out, stats = run_prompts(e, PROMPTS, SP)
    assert out == alone
    grouped = [shape for shape in calls if shape[0] > 1 and shape[1] > 1]
    assert grouped and all(shape == (4, 4) or shape == (2, 4) for shape in grouped)
    assert sum(s.prefill_tokens for s in stats) == sum(len(ByteTokenizer().encode(p)) for p in PROMPTS)
    assert e.compiles_since_warmup() == 0 and e.pool.used == 0


def test_only_short_chunks_within_the_group_context_are_grouped():
    rc = RunnerConfig(**{**TINY_RC.__dict__, "prefill_rows": 4, "context_buckets": (32, 1024)})

    def seq(i: int, prompt: int, cached: int) -> Sequence:
        ids = list(range(1, prompt + 1))
        s = Sequence(Request(f"r{i}", ids, SP), ids, len(ids), request_key(None), Detokenizer(ByteTokenizer().decode, ids[-4:]))
        s.num_cached = cached
        return s

    short = [(seq(i, 10, 0), 3) for i in range(5)]
    long_chunk = (seq(9, 40, 0), 8)  # more than the smallest prefill bucket (4)
    late = (seq(10, 700, 690), 4)  # reaches a context past GROUP_MAX_CONTEXT
    groups, alone = split_groups(rc, [short[0], long_chunk, *short[1:], late], compiled=True)
    assert [[s for s, _ in g] for g in groups] == [[s for s, _ in short[:4]]]  # 4 rows at most
    assert alone == [long_chunk, short[4], late]  # a lone short chunk left over runs alone
    assert split_groups(rc, short, compiled=False) == ([], short)  # still compiling: alone
