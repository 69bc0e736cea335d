"""Constrained decoding (engine/grammar.py): grammars checked before they reach the engine, masks
that allow exactly the grammar's tokens, outputs that match on the real EngineCore path (tiny
model), and greedy output the same with speculation as without."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from engine.grammar import ConstraintError, GrammarVocab, grammar_text
from engine.policy import BatchRule, TunedPolicy
from engine.types import Constraint, ParamError, SamplingParams
from tests.engine.conftest import SPEC_PROMPTS, SPEC_RC, ByteTokenizer, make_engine, run_prompts

TOK = ByteTokenizer()
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n", "tag"],
          "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["x", "y"]}}}


def ids_of(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def allowed(mask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize(("constraint", "says"), [
    (Constraint("regex", "(", "guided_regex"), "guided_regex"),
    (Constraint("json", "[1, 2]", "response_format"), "JSON schema must be an object"),
    (Constraint("json", "{not json", "guided_json"), "guided_json"),
    (Constraint("choice", "[]", "guided_choice"), "non-empty list"),
    (Constraint("grammar", "start: undefined_rule", "guided_grammar"), "guided_grammar"),
    (Constraint("sql", "x", "structured_outputs"), "unknown constraint kind"),
])
def test_a_grammar_that_cannot_compile_names_its_field(constraint: Constraint, says: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(says)) as err:
        grammar_text(constraint)
    assert err.value.field == constraint.param and err.value.code == "invalid_grammar"


def test_masks_allow_the_grammar_tokens_after_each_draft() -> None:
    vocab = GrammarVocab(TOK, 512)
    m = vocab.matcher(Constraint("regex", "[0-9]{3}"))
    digits = set(ids_of("0123456789"))
    assert m.drafts_allowed(ids_of("1x")) == 1 and m.drafts_allowed(ids_of("12")) == 2
    masks = m.masks(ids_of("12"))
    assert masks.shape == (3, 16)
    assert [allowed(row) for row in masks] == [digits, digits, digits]
    assert m.masks([]).shape == (1, 16)  # the drafts were rolled back: the state is the start again
    assert [m.advance(t) for t in ids_of("123")] == [False, False, True]  # then nothing more fits
    with pytest.raises(ValueError, match="refused"):
        vocab.matcher(Constraint("regex", "[0-9]{3}")).advance(ids_of("a")[0])


def test_an_engine_whose_tokenizer_has_no_token_bytes_refuses_a_constraint(tiny) -> None:
    from engine.types import Request

    engine = make_engine(tiny, tokenizer=type("NoBytes", (), {
        k: getattr(ByteTokenizer, k) for k in ("bos_id", "eos_id", "stop_ids", "encode", "decode")})())
    sp = SamplingParams(max_tokens=4, constraint=Constraint("regex", "[a-z]+", "guided_regex"))
    with pytest.raises(ParamError, match="no token bytes") as err:
        engine.add_request(Request("r", TOK.encode("hi"), sp))
    assert err.value.field == "guided_regex"


@pytest.fixture(scope="module")
def grammar_engine(tiny):
    return make_engine(tiny, **SPEC_RC)


def test_constrained_outputs_match_their_grammar(grammar_engine) -> None:
    for c, check in (
            (Constraint("regex", "[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
            (Constraint("choice", json.dumps(["yes", "no", "maybe"])), lambda t: t in ("yes", "no", "maybe")),
            (Constraint("json", json.dumps(SCHEMA)), lambda t: _valid(json.loads(t)))):
        for temperature in (0.0, 1.0):
            sp = SamplingParams(max_tokens=80, temperature=temperature, seed=7, constraint=c)
            outs, _ = run_prompts(grammar_engine, SPEC_PROMPTS, sp, TOK)
            for out in outs:
                assert out[-1] == TOK.eos_id or len(out) < 80, (c, out)  # ended by the grammar
                assert check(TOK.decode(out)), (c, TOK.decode(out))
    assert grammar_engine.pool.used == 0


def _valid(obj: dict) -> bool:
    return (set(obj) == {"name", "ok", "n", "tag"} and isinstance(obj["name"], str) and len(obj["name"]) <= 5
            and isinstance(obj["ok"], bool) and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
            and obj["tag"] in ("x", "y"))


@pytest.mark.parametrize("depth", [2, 4, 8])
def test_greedy_constrained_output_is_the_same_with_speculation(tiny, grammar_engine, depth) -> None:
    sp = SamplingParams(max_tokens=40, constraint=Constraint("regex", "[abc ]{12,30}"))
    plain, _ = run_prompts(grammar_engine, SPEC_PROMPTS, sp, TOK)
    spec_engine = make_engine(tiny, **SPEC_RC)
    spec_engine.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", depth),), crossover=64, version=1))
    spec, stats = run_prompts(spec_engine, SPEC_PROMPTS, sp, TOK)
    assert spec == plain
    assert all(re.fullmatch("[abc ]{12,30}", TOK.decode(out)) for out in spec)
    assert sum(s.proposed for s in stats if s.technique == "ngram") > 0
    assert spec_engine.pool.used == 0
