"""Scored prompts (SamplingParams.prompt_logprobs): each prompt token's logprob given the tokens
before it is the dense reference model's, whatever the chunking, the batch mates, the prefix
cache or speculation; the first event carries them, the prompt's top tokens come best first,
and a scored prompt's chunks never ask for more output slots than the heads compile."""

from __future__ import annotations

import numpy as np
import pytest

from engine.execute.runner import RunnerConfig
from engine.step.core import EngineConfig, EngineCore
from engine.step.ragged_step import scored_lengths
from engine.types import ParamError, Request, SamplingParams
from tests.engine.conftest import TINY_RC, ByteTokenizer
from tests.engine.reference import dense_logits

TOK = ByteTokenizer()
LONG = "a prompt long enough to need several chunks of a step's budget when its every token is scored"


def _engine(tiny, **ecfg) -> EngineCore:
    rc = RunnerConfig(**{**TINY_RC.__dict__, "fast_output": False})
    e = EngineCore(tiny[0], tiny[1], TOK, EngineConfig(runner=rc, token_budget=32, **ecfg))
    e.warmup(progress=False)
    return e


def _events(e: EngineCore, reqs: list[Request]) -> dict[str, list]:
    for r in reqs:
        e.add_request(r)
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    while e.has_work():
        for ev in e.step().events:
            out[ev.request_id].append(ev)
    return out


def _reference(tiny, ids: list[int]) -> np.ndarray:
    lg = dense_logits(tiny[0], tiny[1], ids)
    lg = lg - lg.max(axis=-1, keepdims=True)
    return lg - np.log(np.exp(lg).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def engine(tiny):
    return _engine(tiny, prefix_cache=True)


def test_a_scored_prompt_has_the_reference_models_logprobs_in_any_batch(tiny, engine):
    prompts = [LONG, "short one", "x"]
    sp = SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=True, top_logprobs=1)
    plain = Request("plain", TOK.encode("a batch mate that is not scored " * 3), SamplingParams(max_tokens=4))
    reqs = [Request(f"s{i}", TOK.encode(p), sp) for i, p in enumerate(prompts)] + [plain]
    events = _events(engine, reqs)
    assert events["plain"][0].prompt_logprobs is None
    for i, p in enumerate(prompts):
        ids = TOK.encode(p)
        first, *rest = events[f"s{i}"]
        got = first.prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None
        assert all(ev.prompt_logprobs is None for ev in rest)
        ref = _reference(tiny, ids)
        for pos in range(1, len(ids)):
            lp, top = got[pos]
            assert lp == pytest.approx(ref[pos - 1, ids[pos]], abs=2e-4), (p, pos)
            assert len(top) == 2 and top[0][1] >= top[1][1]
            assert top[0][0] == int(np.argmax(ref[pos - 1]))
            assert top[0][1] == pytest.approx(ref[pos - 1].max(), abs=2e-4)
        # the output token after the scored prompt is still the greedy one
        assert first.token_ids[0] == int(np.argmax(ref[-1]))
    assert engine.status()["kv_pages_used"] == 0


def test_a_scored_prompt_is_computed_whole_even_when_its_prefix_is_cached(tiny, engine):
    ids = TOK.encode(LONG)
    _events(engine, [Request("warm", ids, SamplingParams(max_tokens=1))])  # its blocks are now cached
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got = _events(engine, [Request("again", ids, sp)])["again"][0].prompt_logprobs
    ref = _reference(tiny, ids)
    want = [round(float(ref[p - 1, ids[p]]), 3) for p in range(1, len(ids))]
    assert [round(g[0], 3) for g in got[1:]] == want
    assert all(g[1] == () for g in got[1:])  # no alternatives asked for


@pytest.mark.parametrize("outputs", [3, 8, 40, 1000])
def test_scored_chunks_keep_within_the_compiled_output_slots(outputs):
    def seq(scored: bool):
        sampling = SamplingParams(prompt_logprobs=0 if scored else None)
        return type("Seq", (), {"req": Request("r", [1], sampling)})

    chunks = [(seq(False), 0), (seq(True), 0), (seq(False), 0), (seq(True), 0)]
    lengths = scored_lengths(chunks, [200, 200, 5, 200], outputs)
    assert lengths[0] == 200 and lengths[2] == 5  # a chunk not scored has one output slot
    slots = lengths[1] + lengths[3] + 2
    assert min(lengths) >= 1 and (slots <= outputs or lengths[1] == lengths[3] == 1)
    assert lengths[1] == max(1, min(200, outputs - 3))  # the first scored chunk takes what is spare


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused_naming_it(value):
    with pytest.raises(ParamError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()
