"""Bad requests: each a 4xx with an OpenAI-style error naming the param; the engine never sees them."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from daemon.tenants.auth import AUTH
from daemon.tenants.limits import TenantInfo, TenantLimits
from engine.fake import FakeEngine
from tests.daemon.helpers import MODEL, LiveServer, http_request

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
    ("prompt-batch", C, comp(prompt=["a", "b"]), 400, "prompt"),
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
    ("top-k-negative", C, comp(top_k=-1), 400, "top_k"),
    ("top-k-float", C, comp(top_k=2.5), 400, "top_k"),
    ("top-k-huge", C, comp(top_k=10**6), 400, "top_k"),
    ("seed-string", C, comp(seed="x"), 400, "seed"),
    ("stop-too-many", C, comp(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("stop-empty-string", C, comp(stop=[""]), 400, "stop"),
    ("stop-wrong-type", C, comp(stop=5), 400, "stop"),
    ("n-two", C, comp(n=2), 400, "n"),
    ("echo", C, comp(echo=True), 400, "echo"),
    ("best-of", C, comp(best_of=3), 400, "best_of"),
    ("logprobs-too-many", C, comp(logprobs=10), 400, "logprobs"),
    ("stream-not-bool", C, comp(stream="yes"), 400, "stream"),
    ("ignore-eos-not-bool", C, comp(ignore_eos="yes"), 400, "ignore_eos"),
    ("stream-options-without-stream", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
    ("token-id-out-of-vocab", C, comp(prompt=[2, 99999]), 400, None),
    ("chat-missing-messages", CHAT, without(chat(), "messages"), 400, "messages"),
    ("chat-messages-string", CHAT, chat(messages="hi"), 400, "messages"),
    ("chat-messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("chat-message-not-object", CHAT, chat(messages=[1]), 400, "messages[0]"),
    ("chat-role-missing", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("chat-role-unknown", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("chat-content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]),
     400, "messages[0].content"),
    ("chat-image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "messages[0].content[0]"),
    ("chat-max-completion-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("chat-top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-over-context", CHAT, chat(messages=[{"role": "user", "content": "y" * 400}]), 400, "messages"),
    ("chat-unknown-model", CHAT, chat(model="nope"), 404, "model"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    srv = LiveServer(FakeEngine(max_context=CTX), max_prompt_chars=500, max_body_bytes=16384).start()
    yield srv
    srv.close()


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server: LiveServer, path: str, body: Any, status: int, param: str | None) -> None:
    r = server.post(path, body)
    assert r.status == status, r.data
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"


def test_nothing_reached_the_engine_and_a_good_request_still_works(server: LiveServer) -> None:
    assert server.sink.results == []  # validation happens before the engine
    r = server.post(C, comp(max_tokens=20))
    assert r.status == 200 and r.json()["choices"][0]["text"] == "olleh"
    r = server.post(CHAT, chat())
    assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == "user: hi\nassistant: "[::-1]
    server.wait_idle()
    assert len(server.sink.results) == 2


def test_ignore_eos_generates_exactly_max_tokens(server: LiveServer) -> None:
    # the fake answers "hello" with "olleh" then EOS: 6 tokens, unless EOS is ignored
    assert server.post(C, comp(max_tokens=20)).json()["usage"]["completion_tokens"] == 6
    r = server.post(C, comp(max_tokens=20, ignore_eos=True)).json()
    assert r["usage"]["completion_tokens"] == 20 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["text"].startswith("ollehollehol")
    r = server.post(CHAT, chat(max_tokens=9, ignore_eos=True)).json()
    assert r["usage"]["completion_tokens"] == 9


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
