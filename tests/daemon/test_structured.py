"""Structured outputs over HTTP: the body's spellings (daemon/structured.py), their 400s, and
constrained answers from the real EngineCore path (the tiny model, its grammar heads)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from daemon.errors import ApiError
from daemon.structured import ANY_OBJECT, constraint_of
from engine.types import Constraint
from tests.daemon.helpers import LiveServer, parse_sse

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rain"],
          "properties": {"city": {"type": "string", "maxLength": 6}, "rain": {"type": "boolean"}}}


@pytest.mark.parametrize(("body", "want"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("json", ANY_OBJECT, "response_format")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     Constraint("json", json.dumps(SCHEMA), "response_format.json_schema.schema")),
    ({"guided_json": json.dumps(SCHEMA)}, Constraint("json", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+", "guided_regex")),
    ({"guided_choice": ["a", "b"]}, Constraint("choice", '["a", "b"]', "guided_choice")),
    ({"guided_grammar": 'start: "x"'}, Constraint("grammar", 'start: "x"', "guided_grammar")),
    ({"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+", "structured_outputs.regex")),
])
def test_each_spelling_becomes_one_constraint(body: dict[str, Any], want: Constraint | None) -> None:
    assert constraint_of(body) == want


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"response_format": "json"}, "response_format", "invalid_type"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "invalid_type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": [1]}}},
     "response_format.json_schema.schema", "invalid_type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": "yes"}}},
     "response_format.json_schema.strict", "invalid_type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "string", "pattern": "(("}}}},
     "response_format.json_schema.schema", "invalid_grammar"),
    ({"guided_regex": "("}, "guided_regex", "invalid_grammar"),
    ({"guided_regex": 5}, "guided_regex", "invalid_type"),
    ({"guided_choice": []}, "guided_choice", "invalid_value"),
    ({"guided_json": [1]}, "guided_json", "invalid_type"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "invalid_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {"sql": "x"}}, "structured_outputs", "invalid_value"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "invalid_value"),
    ({"guided_regex": "a" * 100_001}, "guided_regex", "invalid_value"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ApiError) as err:
        constraint_of(body)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    import jax

    from tests.engine.conftest import ChatBytes, make_engine
    from tests.engine.tiny import init_random_params, tiny_config

    cfg = tiny_config()
    engine = make_engine((cfg, init_random_params(cfg, jax.random.PRNGKey(0))), ChatBytes(),
                         max_batch=4, max_context=1536, global_pages=2000)  # tool prompts: ~700 byte tokens
    engine.warmup = lambda progress=True: None  # the shapes compile on use
    srv = LiveServer(engine).start()
    yield srv
    srv.close()


def chat(server: LiveServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.engine.model_name, "messages": [{"role": "user", "content": "weather?"}],
            "max_tokens": 60, **fields}


def test_a_json_schema_answer_parses_and_follows_the_schema(server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        r = server.post("/v1/chat/completions",
                        chat(server, response_format=fmt, temperature=temperature, seed=3))
        assert r.status == 200, r.data
        choice = r.json()["choices"][0]
        answer = json.loads(choice["message"]["content"])
        assert set(answer) == {"city", "rain"} and isinstance(answer["rain"], bool)
        assert isinstance(answer["city"], str) and len(answer["city"]) <= 6
        assert choice["finish_reason"] == "stop"
    server.wait_idle(30.0)


def test_regex_and_choice_constrain_completions_and_streams(server: LiveServer) -> None:
    body = {"model": server.engine.model_name, "prompt": "id:", "max_tokens": 30,
            "guided_regex": "[A-Z]{2}-[0-9]{3}"}
    r = server.post("/v1/completions", body)
    assert r.status == 200, r.data
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.json()["choices"][0]["text"])
    r = server.post("/v1/chat/completions",
                    chat(server, stream=True, guided_choice=["sunny", "rainy", "snow"]))
    assert r.status == 200
    chunks = [e for e in parse_sse(r.data) if isinstance(e, dict)]
    text = "".join(c["delta"].get("content") or "" for e in chunks for c in e["choices"])
    assert text in ("sunny", "rainy", "snow")


def test_a_grammar_the_engine_cannot_compile_is_a_400(server: LiveServer) -> None:
    r = server.post("/v1/chat/completions", chat(server, guided_regex="[a-"))
    assert r.status == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("guided_regex", "invalid_grammar")


def test_the_openai_clients_parse_returns_the_pydantic_object(server: LiveServer) -> None:
    """`client.chat.completions.parse(response_format=Model)` sends the model's strict JSON schema
    (titles, `additionalProperties: false`, every field required) and parses the answer."""
    import openai
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=8)
        rain: bool
        level: int = Field(ge=0, le=9)

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        r = client.chat.completions.parse(model=server.engine.model_name, response_format=Forecast,
                                          max_tokens=60,
                                          messages=[{"role": "user", "content": "weather?"}], temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and 0 <= parsed.level <= 9 and len(parsed.city) <= 8
    assert r.choices[0].finish_reason == "stop"
