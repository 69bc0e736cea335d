"""`crossover bench structured`: its 20 schemas compile and are valid JSON Schema, and its runner
measures both phases and validates every constrained answer on the real EngineCore path (the
tiny model behind a live daemon)."""

from __future__ import annotations

import asyncio
import json

import jsonschema

from bench.structured import Answer, Runner, StructuredConfig, valid
from bench.workloads.schemas import SCHEMAS, SUBJECTS, structured_requests
from engine.grammar import grammar_text
from engine.types import Constraint
from tests.daemon.helpers import LiveServer
from tests.daemon.test_structured import server  # noqa: F401  (the tiny model's live daemon)


def test_twenty_schemas_five_prompts_each_all_compile() -> None:
    assert len(SCHEMAS) == 20 and len(SUBJECTS) == 5 and len(structured_requests()) == 100
    refs = 0
    for name, (schema, prompt) in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        grammar_text(Constraint("json", json.dumps(schema), name))
        assert "{subject}" in prompt
        refs += "$ref" in json.dumps(schema)
    assert refs >= 2


def test_valid_names_what_is_wrong() -> None:
    schema = SCHEMAS["rgb"][0]
    assert valid(Answer("rgb", text='{"r": 1, "g": 2, "b": 3}'), schema) is None
    assert "ValidationError" in valid(Answer("rgb", text='{"r": 1, "g": 2, "b": 300}'), schema)
    assert "JSONDecodeError" in valid(Answer("rgb", text='{"r": 1', finish="length"), schema)
    assert valid(Answer("rgb", error="HTTP 500"), schema) == "HTTP 500"


def test_a_round_measures_both_phases_and_every_answer_validates(server: LiveServer) -> None:  # noqa: F811
    runner = Runner(StructuredConfig(concurrency=4, rounds=1, max_tokens=400, free_tokens=8), server.url,
                    None, note=lambda line: None)
    runner.work = [w for w in runner.work if w[0] in ("rgb", "yes_no", "ref_points", "tags")][::5]
    result = asyncio.run(runner.run())
    (one,) = result["rounds"]
    constrained, free = one["constrained"], one["free"]
    assert constrained["requests"] == free["requests"] == 4
    assert constrained["valid"] == 4 and result["valid_all_rounds"], constrained["invalid"]
    assert constrained["grammar_steps"] > 0 and constrained["grammar_ms_per_step"] > 0
    assert free["output_tokens"] == 4 * 8 and one["tpot_p50_ratio"] > 0
