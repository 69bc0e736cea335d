"""Bad requests: each a 4xx with an OpenAI-style error naming the param; the engine never sees them.

Every case runs twice: against the fake engine and against the real engine
path (EngineCore over the tiny random model), since the HTTP parser and
`EngineCore.add_request` share one set of rules (engine.types) and a value the
fake ignores (a seed of -1) once took the real engine loop down.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from daemon.app import request_log
from daemon.state import ENGINE_THREAD
from daemon.tenants.auth import AUTH
from daemon.tenants.limits import TenantInfo, TenantLimits
from engine.fake import BYTE_OFFSET, FakeEngine
from engine.types import ParamError, Request, SamplingParams
from tests.daemon.helpers import MODEL, LiveServer, http_request, parse_sse, wait_for

CTX = 256
C, CHAT = "/v1/completions", "/v1/chat/completions"


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (case id, path, body, status, param)
    ("malformed-json", C, b'{"model": "fake-reverse", "prompt": ', 400, None),
    ("nan", C, b'{"model": "fake-reverse", "prompt": "a", "temperature": NaN}', 400, None),
    ("not-an-object", C, b"[1, 2, 3]", 400, None),
    ("empty-body", C, b"", 400, None),
    ("invalid-utf8", C, b'{"model": "fake-reverse", "prompt": "\xff\xfe"}', 400, None),
    ("missing-model", C, without(comp(), "model"), 400, "model"),
    ("model-not-string", C, comp(model=7), 400, "model"),
    ("unknown-model", C, comp(model="gpt-17"), 404, "model"),
    ("missing-prompt", C, without(comp(), "prompt"), 400, "prompt"),
    ("empty-prompt", C, comp(prompt=""), 400, "prompt"),
    ("empty-token-list", C, comp(prompt=[]), 400, "prompt"),
    ("prompt-wrong-type", C, comp(prompt=12), 400, "prompt"),
    ("prompt-batch-too-many", C, comp(prompt=["a"] * 17), 400, "prompt"),
    ("prompt-batch-mixed", C, comp(prompt=["a", [5, 6]]), 400, "prompt"),
    ("prompt-batch-empty-one", C, comp(prompt=["a", ""]), 400, "prompt"),
    ("echo-not-boolean", C, comp(echo="yes"), 400, "echo"),
    ("tokenize-both", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400,
     "prompt"),
    ("tokenize-prompt-not-string", "/tokenize", {"prompt": [5]}, 400, "prompt"),
    ("tokenize-flag-not-boolean", "/tokenize", {"prompt": "a", "add_special_tokens": 1}, 400,
     "add_special_tokens"),
    ("tokenize-wrong-model", "/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("detokenize-missing", "/detokenize", {}, 400, "tokens"),
    ("detokenize-bad-id", "/detokenize", {"tokens": [5, -1]}, 400, "tokens"),
    ("detokenize-not-ids", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("prompt-negative-id", C, comp(prompt=[5, -1]), 400, "prompt"),
    ("prompt-over-context", C, comp(prompt="x" * CTX), 400, "prompt"),
    ("prompt-over-char-limit", C, comp(prompt="x" * 600), 400, "prompt"),
    ("prompt-plus-max-tokens", C, comp(prompt="x" * 200, max_tokens=100), 400, "max_tokens"),
    ("max-tokens-zero", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", C, comp(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-huge", C, comp(max_tokens=10**9), 400, "max_tokens"),
    ("max-tokens-string", C, comp(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-float", C, comp(max_tokens=1.5), 400, "max_tokens"),
    ("temperature-negative", C, comp(temperature=-0.1), 400, "temperature"),
    ("temperature-high", C, comp(temperature=2.5), 400, "temperature"),
    ("temperature-string", C, comp(temperature="hot"), 400, "temperature"),
    ("top-p-zero", C, comp(top_p=0), 400, "top_p"),
    ("top-p-high", C, comp(top_p=1.5), 400, "top_p"),
    ("top-k-float", C, comp(top_k=2.5), 400, "top_k"),
    ("top-k-huge", C, comp(top_k=10**6), 400, "top_k"),
    ("seed-string", C, comp(seed="x"), 400, "seed"),
    ("stop-too-many", C, comp(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("stop-empty-string", C, comp(stop=[""]), 400, "stop"),
    ("stop-wrong-type", C, comp(stop=5), 400, "stop"),
    ("stream-not-bool", C, comp(stream="yes"), 400, "stream"),
    ("ignore-eos-not-bool", C, comp(ignore_eos="yes"), 400, "ignore_eos"),
    ("stream-options-without-stream", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
    ("token-id-out-of-vocab", C, comp(prompt=[2, 99999]), 400, "prompt"),
    ("chat-missing-messages", CHAT, without(chat(), "messages"), 400, "messages"),
    ("chat-messages-string", CHAT, chat(messages="hi"), 400, "messages"),
    ("chat-messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("chat-message-not-object", CHAT, chat(messages=[1]), 400, "messages[0]"),
    ("chat-role-missing", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("chat-role-unknown", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role"),
    ("chat-content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]),
     400, "messages[0].content"),
    ("chat-image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "messages[0].content[0]"),
    ("chat-max-completion-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("chat-top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-over-context", CHAT, chat(messages=[{"role": "user", "content": "y" * 400}]), 400, "messages"),
    ("chat-unknown-model", CHAT, chat(model="nope"), 404, "model"),
    ("top-k-below-off", C, comp(top_k=-2), 400, "top_k"),
    ("temperature-overflow", C, b'{"model": "fake-reverse", "prompt": "a", "temperature": 1e999}', 400,
     "temperature"),
    ("seed-too-large", C, comp(seed=2**64), 400, "seed"),
    ("seed-too-small", C, comp(seed=-(2**63) - 1), 400, "seed"),
    ("seed-float", C, comp(seed=1.5), 400, "seed"),
    ("stop-too-long", C, comp(stop=["s" * 201]), 400, "stop"),
    ("stop-token-ids-type", C, comp(stop_token_ids="1"), 400, "stop_token_ids"),
    ("stop-token-ids-negative", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop-token-ids-out-of-vocab", C, comp(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("stop-token-ids-too-many", C, comp(stop_token_ids=list(range(3, 36))), 400, "stop_token_ids"),
    ("top-logprobs-over-20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("logprobs-over-20", C, comp(logprobs=21), 400, "logprobs"),
    ("user-not-string", C, comp(user=5), 400, "user"),
    ("user-too-long", CHAT, chat(user="u" * 300), 400, "user"),
    ("metadata-not-object", CHAT, chat(metadata="x"), 400, "metadata"),
    ("chat-two-max-tokens-disagree", CHAT, chat(max_tokens=5, max_completion_tokens=6), 400, "max_tokens"),
    ("chat-max-completion-over-context", CHAT, chat(max_completion_tokens=CTX), 400,
     "max_completion_tokens"),
    ("min-p-above-one", C, comp(min_p=1.5), 400, "min_p"),
    ("min-tokens-over-max-tokens", C, comp(min_tokens=20, max_tokens=4), 400, "min_tokens"),
    ("min-tokens-float", CHAT, chat(min_tokens=2.5), 400, "min_tokens"),
    ("presence-penalty-high", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty-string", C, comp(frequency_penalty="x"), 400, "frequency_penalty"),
    ("repetition-penalty-zero", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("temperature-huge-int", C, comp(temperature=10**400), 400, "temperature"),
    ("top-p-huge-int", CHAT, chat(top_p=-(10**320)), 400, "top_p"),
    ("presence-penalty-huge-int", C, comp(presence_penalty=10**309), 400, "presence_penalty"),
    ("repetition-penalty-subnormal", C, comp(repetition_penalty=5e-324), 400, "repetition_penalty"),
    ("top-p-below-float32", CHAT, chat(top_p=1e-40), 400, "top_p"),
    ("temperature-below-float32", C, comp(temperature=1e-300), 400, "temperature"),
    ("prompt-lone-surrogate", C, b'{"model": "fake-reverse", "prompt": "a\\ud800b"}', 400, None),
    ("chat-lone-surrogate", CHAT,
     b'{"model": "fake-reverse", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, None),
    ("chat-more-messages-than-context", CHAT, chat(messages=[{"role": "user", "content": ""}] * (CTX + 1)),
     400, "messages"),
    ("n-zero", C, comp(n=0), 400, "n"),
    ("n-nine", CHAT, chat(n=9, temperature=1.0), 400, "n"),
    ("n-float", C, comp(n=2.5), 400, "n"),
    ("n-true", C, comp(n=True), 400, "n"),
    ("tool-choice-without-tools", CHAT, chat(tool_choice="auto"), 400, "tool_choice"),
    ("tool-bad-name", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools[0].function.name"),
    ("tool-role-without-call-id", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].tool_call_id"),
    ("message-tool-calls-empty", CHAT, chat(messages=[{"role": "user", "content": "x"},
                                                      {"role": "assistant", "content": None,
                                                       "tool_calls": []}]),
     400, "messages[1].tool_calls"),
]

UNSUPPORTED: list[tuple[str, str, dict[str, Any], str]] = [
    # (case id, path, body, the param the 400 unsupported_parameter names)
    ("unknown-key", C, comp(frobnicate=1), "frobnicate"),
    ("unknown-key-chat", CHAT, chat(temprature=0.5), "temprature"),
    ("best-of", C, comp(best_of=3), "best_of"),
    ("best-of-with-n", C, comp(n=2, best_of=2), "best_of"),
    ("suffix", C, comp(suffix="x"), "suffix"),
    ("tokenize-unknown-key", "/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), "functions"),
    ("logit-bias", C, comp(logit_bias={"5": 1}), "logit_bias"),
    ("stream-options-other-key", C, comp(stream=True, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats"),
    ("text-part-extra-key", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]),
     "messages[0].content[0].cache_control"),
    ("message-name", CHAT, chat(messages=[{"role": "user", "content": "x", "name": "bob"}]),
     "messages[0].name"),
]

GOOD: list[tuple[str, str, dict[str, Any]]] = [
    # (case id, path, body): accepted, answered with a normal completion
    ("seed-minus-one", C, comp(seed=-1, temperature=1.0, max_tokens=4, ignore_eos=True)),
    ("seed-min", C, comp(seed=-(2**63), temperature=0.7, max_tokens=4, ignore_eos=True)),
    ("seed-max", CHAT, chat(seed=2**64 - 1, temperature=1.0, max_tokens=4, ignore_eos=True)),
    ("top-k-off", C, comp(top_k=-1, temperature=1.0, max_tokens=4, ignore_eos=True)),
    ("top-k-256", C, comp(top_k=256, temperature=1.0, max_tokens=4, ignore_eos=True)),
    ("temperature-two", C, comp(temperature=2, max_tokens=4, ignore_eos=True)),
    ("labels", CHAT, chat(user="alice", metadata={"team": "a"}, max_tokens=4, ignore_eos=True)),
    ("neutral-values", CHAT, chat(n=1, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1,
                                  min_p=0, min_tokens=0, logit_bias={}, response_format={"type": "text"},
                                  tool_choice="none", tools=[], store=False, max_tokens=4,
                                  ignore_eos=True)),
    ("nulls", C, comp(n=None, suffix=None, tools=None, max_tokens=4, ignore_eos=True)),
    ("developer-role", CHAT, chat(messages=[{"role": "developer", "content": "be brief"},
                                            {"role": "user", "content": "hi"}], max_tokens=4,
                                  ignore_eos=True)),
    ("stop-token-ids", C, comp(stop_token_ids=[3], max_tokens=4, ignore_eos=True)),
    ("top-logprobs-one", CHAT, chat(logprobs=True, top_logprobs=1, max_tokens=4, ignore_eos=True)),
    ("logprobs-one", C, comp(logprobs=1, max_tokens=4, ignore_eos=True)),
    ("logprobs-twenty", C, comp(logprobs=20, max_tokens=4, ignore_eos=True)),
    ("top-logprobs-five", CHAT, chat(logprobs=True, top_logprobs=5, max_tokens=4, ignore_eos=True)),
    ("chat-default-max-tokens", CHAT, chat(max_tokens=None)),
    ("penalties-and-min-p", C, comp(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                    min_p=0.1, temperature=1.0, max_tokens=4, ignore_eos=True)),
    ("min-tokens", CHAT, chat(min_tokens=3, max_tokens=4)),
    ("n-two-sampled", C, comp(n=2, temperature=1.0, max_tokens=4, ignore_eos=True)),
    ("n-eight-chat", CHAT, chat(n=8, temperature=0.7, seed=-1, max_tokens=3, ignore_eos=True)),
    ("n-two-greedy", C, comp(n=2, temperature=0, max_tokens=4)),
    ("paired-surrogates", C, comp(prompt="a\U0001F600b", max_tokens=4, ignore_eos=True)),
    ("prompt-batch", C, comp(prompt=["ab", "cd", "e"], n=2, temperature=1.0, seed=3, max_tokens=3,
                             ignore_eos=True)),
    ("echo", C, comp(echo=True, max_tokens=2, ignore_eos=True)),
    ("echo-logprobs-batch", C, comp(prompt=[[40, 41, 42], [43, 44]], echo=True, logprobs=2, n=2, max_tokens=2,
                                    temperature=1.0, ignore_eos=True)),
]


def tiny_engine() -> Any:
    """EngineCore over the tiny random model with a byte tokenizer, context CTX, compiled on use."""
    import jax

    from tests.engine.conftest import ChatBytes, make_engine
    from tests.engine.tiny import init_random_params, tiny_config

    cfg = tiny_config()
    engine = make_engine((cfg, init_random_params(cfg, jax.random.PRNGKey(0))), ChatBytes(),
                         max_batch=2, max_context=CTX)
    engine.warmup = lambda progress=True: None  # a handful of shapes compile on use instead
    return engine


@pytest.fixture(scope="module", params=["fake", "tiny"])
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    engine = FakeEngine(max_context=CTX) if request.param == "fake" else tiny_engine()
    srv = LiveServer(engine, max_prompt_chars=500, max_body_bytes=16384).start()
    yield srv
    srv.close()


def on(server: LiveServer, body: Any) -> Any:
    """`body` addressed to the server's model (the cases name the fake's)."""
    model = server.engine.model_name
    if isinstance(body, bytes):
        return body.replace(MODEL.encode(), model.encode())
    return {**body, "model": model} if body.get("model") == MODEL else body


def wait_idle(server: LiveServer) -> None:
    """No request in flight and every KV page back (either engine)."""
    server.wait_idle(60.0)


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server: LiveServer, path: str, body: Any, status: int, param: str | None) -> None:
    r = server.post(path, on(server, body))
    assert r.status == status, r.data
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_field_is_refused(server: LiveServer, path: str, body: Any, param: str) -> None:
    r = server.post(path, on(server, body))
    assert r.status == 400, r.data
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    assert param.split(".")[-1] in error["message"]


def test_more_messages_than_the_context_are_refused_before_tokenizing(server: LiveServer) -> None:
    """Every message renders a turn of tokens: more messages than context tokens are refused
    by count (the message says so), before a tokenizer call per message."""
    r = server.post(CHAT, on(server, chat(messages=[{"role": "user", "content": ""}] * (CTX + 1))))
    assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"holds {CTX + 1} messages" in r.json()["error"]["message"]


def test_nothing_reached_the_engine(server: LiveServer) -> None:
    wait_idle(server)
    assert server.sink.results == []  # validation happens before the engine
    assert server.app[ENGINE_THREAD].ready


@pytest.mark.parametrize("path,body", [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_good_request_is_served(server: LiveServer, path: str, body: Any) -> None:
    before = len(server.sink.results)
    r = server.post(path, on(server, body))
    assert r.status == 200, r.data
    n = (body.get("n") or 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                and isinstance(body["prompt"][0], (str, list)) else 1)
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(n))
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert r.json()["usage"]["completion_tokens"] >= n
    wait_idle(server)
    assert len(server.sink.results) == before + n and server.app[ENGINE_THREAD].ready


def test_negative_seed_is_its_unsigned_twin(server: LiveServer) -> None:
    """seed -1 and 2**64 - 1 name the same generator seed: the same sampled text."""
    texts = [server.post(C, on(server, comp(seed=s, temperature=1.0, max_tokens=8, ignore_eos=True,
                                            logprobs=0))).json()["choices"][0]["logprobs"]["tokens"]
             for s in (-1, 2**64 - 1)]
    assert texts[0] == texts[1] and len(texts[0]) == 8


def test_seeded_choices_are_reproducible(server: LiveServer) -> None:
    """n choices with a seed: choice i samples what one choice with seed + i does, every time,
    and the choices differ (the tiny model samples; the fake answers every choice alike)."""
    def tokens(**fields: Any) -> list[list[str]]:
        body = comp(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, **fields)
        r = server.post(C, on(server, body))
        assert r.status == 200, r.data
        return [c["logprobs"]["tokens"] for c in r.json()["choices"]]

    three = tokens(n=3, seed=2**64 - 2)  # the seeds wrap: 2**64 - 2, 2**64 - 1, 0
    assert tokens(n=3, seed=2**64 - 2) == three
    assert [tokens(seed=s)[0] for s in (2**64 - 2, -1, 0)] == three
    if not isinstance(server.engine, FakeEngine):
        assert len({tuple(t) for t in three}) == 3
    wait_idle(server)


def test_greedy_choices_are_identical_and_streamed_per_index(server: LiveServer) -> None:
    """n > 1 at temperature 0 is allowed and gives n equal choices (as vLLM); streamed, each
    chunk names its choice and each choice ends once, then one [DONE]."""
    r = server.post(CHAT, on(server, chat(n=3, temperature=0, max_tokens=5, ignore_eos=True)))
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert r.status == 200 and len(texts) == 3 and len(set(texts)) == 1
    r = server.post(CHAT, on(server, chat(n=3, temperature=0, max_tokens=5, ignore_eos=True, stream=True,
                                          stream_options={"include_usage": True})))
    events = parse_sse(r.data)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert events[-2]["usage"]["completion_tokens"] == 15
    streamed = {i: "" for i in range(3)}
    finishes = []
    for e in events[:-2]:
        (c,) = e["choices"]
        streamed[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            finishes.append((c["index"], c["finish_reason"]))
    assert streamed == dict(enumerate(texts))
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    wait_idle(server)


def test_engine_refuses_what_the_parser_refuses(server: LiveServer) -> None:
    """add_request applies the parser's rules itself (a request built in-process, no HTTP)."""
    engine = server.engine
    for bad, field in [(SamplingParams(top_k=-2), "top_k"), (SamplingParams(seed=2**64), "seed"),
                       (SamplingParams(top_logprobs=21), "top_logprobs"),
                       (SamplingParams(stop=("",)), "stop"), (SamplingParams(temperature=float("nan")),
                                                              "temperature"),
                       (SamplingParams(max_tokens=CTX), "max_tokens"), (SamplingParams(min_p=2.0), "min_p"),
                       (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens")]:
        with pytest.raises(ParamError) as info:
            engine.add_request(Request("direct", [2, 70, 71], bad))
        assert info.value.field == field
    for ids in ([2, 10**6], [], [2, -1], [2] * CTX):
        with pytest.raises(ParamError) as info:
            engine.add_request(Request("direct", ids, SamplingParams()))
        assert info.value.field == "prompt_ids"
    assert not engine.has_work()


def test_fake_answers_good_requests_exactly(server: LiveServer) -> None:
    if not isinstance(server.engine, FakeEngine):
        pytest.skip("the fake's output is checkable by hand")
    r = server.post(C, comp(max_tokens=20))
    assert r.status == 200 and r.json()["choices"][0]["text"] == "olleh"
    r = server.post(CHAT, chat())
    assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == "user: hi\nassistant: "[::-1]
    # stop_token_ids: the fake answers "hello" with "olleh"; the id of "l" ends it after "o"
    r = server.post(C, comp(max_tokens=20, stop_token_ids=[ord("l") + BYTE_OFFSET])).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("o", "stop")
    # min_tokens: the EOS after "olleh" comes too early and is replaced; the next one ends it
    r = server.post(C, comp(max_tokens=20, min_tokens=8)).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("ollehoolleh", "stop")
    assert r["usage"]["completion_tokens"] == 12
    # the developer role is the system role
    dev = server.post(CHAT, chat(messages=[{"role": "developer", "content": "x"},
                                           {"role": "user", "content": "hi"}])).json()
    assert dev["choices"][0]["message"]["content"] == "system: x\nuser: hi\nassistant: "[::-1]


def test_top_logprobs_list_the_most_likely_tokens(server: LiveServer) -> None:
    """The real engine lists N alternatives per token, best first (the fake lists the chosen one)."""
    if isinstance(server.engine, FakeEngine):
        pytest.skip("the fake lists only the emitted token")
    body = on(server, chat(logprobs=True, top_logprobs=5, max_tokens=3, ignore_eos=True))
    content = server.post(CHAT, body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for c in content:
        lps = [t["logprob"] for t in c["top_logprobs"]]
        assert len(lps) == 5 and lps == sorted(lps, reverse=True) and c["logprob"] <= lps[0] + 1e-6
    lp = server.post(C, on(server,
                           comp(logprobs=3, max_tokens=3, ignore_eos=True))).json()["choices"][0]["logprobs"]
    for text, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert text in top and 1 <= len(top) <= 4
    wait_idle(server)


def test_user_label_goes_to_the_request_log_line(server: LiveServer,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    def logged() -> bool:
        fields = [getattr(r, "crossover_fields", {}) for r in caplog.records if r.name == request_log.name]
        return any(f.get("user") == "alice-42" and f.get("status") == 200 for f in fields)

    with caplog.at_level(logging.INFO, logger=request_log.name):
        assert server.post(C, on(server, comp(user="alice-42", max_tokens=2))).status == 200
        wait_for(logged, 10.0, "the request's log line")
    wait_idle(server)


def test_ignore_eos_generates_exactly_max_tokens(server: LiveServer) -> None:
    r = server.post(C, on(server, comp(max_tokens=20, ignore_eos=True))).json()
    assert r["usage"]["completion_tokens"] == 20 and r["choices"][0]["finish_reason"] == "length"
    r = server.post(CHAT, on(server, chat(max_tokens=9, ignore_eos=True))).json()
    assert r["usage"]["completion_tokens"] == 9
    if isinstance(server.engine, FakeEngine):
        # the fake answers "hello" with "olleh" then EOS: 6 tokens, unless EOS is ignored
        assert server.post(C, comp(max_tokens=20)).json()["usage"]["completion_tokens"] == 6
        r = server.post(C, comp(max_tokens=20, ignore_eos=True)).json()
        assert r["choices"][0]["text"].startswith("ollehollehol")


def test_unknown_route_and_method_are_json_errors(server: LiveServer) -> None:
    r = server.get("/v1/nothing")
    assert r.status == 404 and "error" in r.json()
    r = server.get(C)
    assert r.status == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_body_over_the_limit_is_413(server: LiveServer) -> None:
    huge = json.dumps(comp(prompt="x" * 20000)).encode()
    r = server.post(C, huge)
    assert r.status == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(server: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 1024

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", C, body=chunks(), encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()


class DictDirectory:
    """A key directory from a dict (the daemon's real one reads the store)."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys

    async def lookup(self, key: str) -> TenantInfo | None:
        name = self.keys.get(key)
        return None if name is None else TenantInfo(name, TenantLimits())


def test_closed_mode_requires_a_key() -> None:
    srv = LiveServer(FakeEngine(), open_mode=False).start()
    try:
        r = srv.post(C, comp())
        assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = http_request(srv.port, "POST", C, comp(), {"Authorization": "Bearer nope"})
        assert r.status == 401
        srv.app[AUTH].directory = DictDirectory({"sk-team-a": "team-a"})
        r = http_request(srv.port, "POST", C, comp(), {"Authorization": "Bearer sk-team-a"})
        assert r.status == 200
        srv.wait_idle()
        assert [res.tenant for res in srv.sink.results] == ["team-a"]
    finally:
        srv.close()
