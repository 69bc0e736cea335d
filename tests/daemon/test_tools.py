"""Tool calls (daemon/tools.py): tools and tool_choice checked, the conversation rendered for a
template without a tool role, forced calls constrained by the function's schema, and answers
read back as `tool_calls`, whole and streamed, on the real EngineCore path (the tiny model)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from daemon.errors import ApiError
from daemon.tools import Tools, calls_in, parse_tools, tool_messages
from tests.daemon.helpers import LiveServer, parse_sse
from tests.daemon.test_structured import server  # noqa: F401  (the tiny model's live daemon)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def test_tool_choice_spellings() -> None:
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "none"}) is None
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    auto = parse_tools({"tools": TOOLS})
    assert auto is not None and auto.choice == "auto" and auto.constraint() is None
    assert list(auto.functions) == ["get_weather", "get_time"]
    named = parse_tools({"tools": TOOLS,
                         "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named is not None and named.choice == "get_time"
    schema = json.loads(named.constraint().spec)
    jsonschema.validate({"name": "get_time", "parameters": {"zone": "UTC"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"zone": "UTC"}}, schema)
    required = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert [s["properties"]["name"]["const"] for s in json.loads(required.constraint().spec)["anyOf"]] == [
        "get_weather", "get_time"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_tools(body)
    assert (err.value.status, err.value.param) == (400, param)


def test_the_conversation_renders_calls_and_results_as_turns() -> None:
    tools = parse_tools({"tools": TOOLS})
    assert isinstance(tools, Tools)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]},
                {"role": "tool", "content": "4 degrees", "tool_call_id": "c1"},
                {"role": "user", "content": "Thanks. And the time?"}]
    out = tool_messages(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("You have access to functions.") and system.endswith("Be brief.")
    listed = system.split("\n", 2)[2].rsplit("\n\n", 1)[0]  # after the instruction's two lines
    assert [f["name"] for f in json.loads(listed)] == ["get_weather", "get_time"]
    call = {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}  # Gemma's JSON form
    assert json.loads(out[2]["content"]) == call
    assert out[3]["content"] == "Function get_weather returned: 4 degrees\n\nThanks. And the time?"


def test_answers_are_read_as_calls_or_content() -> None:
    tools = parse_tools({"tools": TOOLS})
    for key in ("parameters", "arguments"):  # Gemma's form, and OpenAI's key
        calls = calls_in(f'{{"name": "get_time", "{key}": {{"zone": "CET"}}}}\n', tools)
        assert calls is not None and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    assert calls_in("It is sunny.", tools) is None
    assert calls_in('{"name": "launch", "arguments": {}}', tools) is None  # not an offered function


def chat(server: LiveServer, **fields: Any) -> dict[str, Any]:  # noqa: F811
    return {"model": server.engine.model_name, "messages": [{"role": "user", "content": "weather in Oslo?"}],
            "max_tokens": 80, "tools": TOOLS, **fields}


def test_a_named_call_follows_the_functions_schema(server: LiveServer) -> None:  # noqa: F811
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0.0, 1.0):
        body = chat(server, tool_choice=choice, temperature=temperature, seed=1, max_tokens=120)
        r = server.post("/v1/chat/completions", body)
        assert r.status == 200, r.data
        (answer,) = r.json()["choices"]
        assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
        (call,) = answer["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_a_streamed_call_reassembles_in_the_openai_client(server: LiveServer) -> None:  # noqa: F811
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=server.engine.model_name, messages=[{"role": "user", "content": "time?"}], tools=TOOLS,
            tool_choice="required", stream=True, max_tokens=80, temperature=0)
        calls: dict[int, dict[str, str]] = {}
        reasons = []
        for chunk in stream:
            for c in chunk.choices:
                for d in c.delta.tool_calls or ():
                    got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    got["name"] += d.function.name or ""
                    got["arguments"] += d.function.arguments or ""
                reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and len(calls) == 1
    call = calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), schema)


def test_auto_answers_in_text_when_the_model_makes_no_call(server: LiveServer) -> None:  # noqa: F811
    r = server.post("/v1/chat/completions", chat(server, stream=True, max_tokens=6, ignore_eos=True))
    events = [e for e in parse_sse(r.data) if isinstance(e, dict)]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["length"] and not any("tool_calls" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas)  # the text, held back until the answer ended


def test_a_forced_call_and_a_response_format_conflict(server: LiveServer) -> None:  # noqa: F811
    r = server.post("/v1/chat/completions", chat(server, tool_choice="required",
                                                 response_format={"type": "json_object"}))
    assert r.status == 400 and r.json()["error"]["param"] == "tool_choice"
