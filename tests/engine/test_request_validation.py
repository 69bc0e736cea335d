"""The one set of request rules (engine.types): each field's bounds, both sides of each bound."""

from __future__ import annotations

import numpy as np
import pytest

from engine.types import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    ParamError,
    Request,
    SamplingParams,
)

GOOD = [
    dict(max_tokens=1), dict(temperature=0), dict(temperature=2.0), dict(top_k=-1), dict(top_k=0),
    dict(top_k=256), dict(top_p=1e-6), dict(top_p=1), dict(seed=-(2**63)), dict(seed=2**64 - 1),
    dict(stop=("s" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS),
    dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS))),
    dict(top_logprobs=1), dict(logprobs=True, ignore_eos=True),
    dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=4, min_tokens=4), dict(min_tokens=0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(presence_penalty=2, frequency_penalty=-2),
    dict(repetition_penalty=2.0), dict(repetition_penalty=1e-6),
]
BAD = [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(temperature=-1e-9), "temperature"), (dict(temperature=2.01), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_k=257), "top_k"), (dict(top_k=1.0), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=float("nan")), "top_p"),
    (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(seed=1.0), "seed"),
    (dict(stop=("a",) * (MAX_STOP_STRINGS + 1)), "stop"), (dict(stop=("",)), "stop"),
    (dict(stop=("s" * (MAX_STOP_CHARS + 1),)), "stop"), (dict(stop=["a"]), "stop"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(stop_token_ids=(512,)), "stop_token_ids"),
    (dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (dict(top_logprobs=-1), "top_logprobs"), (dict(top_logprobs=21), "top_logprobs"),
    (dict(logprobs=1), "logprobs"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(min_p=-1e-9), "min_p"), (dict(min_p=1.01), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.0), "min_tokens"), (dict(presence_penalty=2.01), "presence_penalty"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=2.01), "repetition_penalty"),
]


@pytest.mark.parametrize("fields", GOOD)
def test_in_bounds(fields):
    Request("r", [2, 3], SamplingParams(**fields)).validate(vocab_size=512, max_context=64)


@pytest.mark.parametrize("fields,name", BAD)
def test_out_of_bounds_names_the_field(fields, name):
    with pytest.raises(ParamError) as info:
        Request("r", [2, 3], SamplingParams(**fields)).validate(vocab_size=512, max_context=64)
    assert info.value.field == name and str(info.value).startswith(name)


def test_up_to_twenty_alternatives_are_listed():
    SamplingParams(logprobs=True, top_logprobs=20).validate()
    with pytest.raises(ParamError) as info:
        SamplingParams(logprobs=True, top_logprobs=21).validate()
    assert (info.value.field, info.value.code) == ("top_logprobs", "invalid_value")


def test_numpy_and_tuple_prompts_are_fine():
    Request("r", [np.int32(2), np.int64(511)], SamplingParams()).validate(512, 64)
    Request("r", (2, 3), SamplingParams()).validate(512, 64)


@pytest.mark.parametrize("ids", [[], [2, 512], [2, -1], [2, True], [2, 3.0], [2] * 64, np.array([2, 3]),
                                 [np.int64(2), np.int64(512)]])
def test_prompt_ids(ids):
    with pytest.raises(ParamError) as info:
        Request("r", ids, SamplingParams(max_tokens=1)).validate(vocab_size=512, max_context=64)
    assert info.value.field == "prompt_ids"


def test_prompt_plus_max_tokens_must_fit_the_context():
    Request("r", [2] * 60, SamplingParams(max_tokens=4)).validate(512, 64)
    with pytest.raises(ParamError) as info:
        Request("r", [2] * 60, SamplingParams(max_tokens=5)).validate(512, 64)
    assert (info.value.field, info.value.code) == ("max_tokens", "context_length_exceeded")


def test_top_k_bound_is_the_samplers_candidate_count():
    from engine.execute.sampling import CANDIDATES
    from engine.types import MAX_TOP_K

    assert MAX_TOP_K == CANDIDATES  # a larger top_k would be cut to the candidates silently
