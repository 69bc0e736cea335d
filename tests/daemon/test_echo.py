"""`echo` on /v1/completions (the prompt's text before each choice's, and with `logprobs` each prompt
token's logprob, as evaluation harnesses score continuations) and vLLM's tokenizer routes, on the
real EngineCore path (the tiny model) and the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.fake import FakeEngine
from tests.daemon.helpers import LiveServer, parse_sse

C = "/v1/completions"


@pytest.fixture(scope="module", params=["fake", "tiny"])
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    from tests.daemon.test_bad_input import tiny_engine

    srv = LiveServer(FakeEngine(max_context=256) if request.param == "fake" else tiny_engine()).start()
    yield srv
    srv.close()


def comp(server: LiveServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.engine.model_name, "max_tokens": 3, "ignore_eos": True, **fields}


def _tokens(server: LiveServer, text: str, bos: bool = True) -> list[int]:
    r = server.post("/tokenize", {"prompt": text, "add_special_tokens": bos})
    assert r.status == 200, r.data
    return r.json()["tokens"]


def test_echo_puts_each_prompt_before_its_choices(server: LiveServer) -> None:
    r = server.post(C, comp(server, prompt=["first prompt", "second"], n=2, echo=True, temperature=1.0,
                            seed=1))
    assert r.status == 200, r.data
    texts = [c["text"] for c in r.json()["choices"]]
    assert [t[: len("first prompt")] for t in texts[:2]] == ["first prompt"] * 2
    assert [t[: len("second")] for t in texts[2:]] == ["second"] * 2
    plain = server.post(C, comp(server, prompt="first prompt", temperature=1.0, seed=1)).json()["choices"][0]
    assert texts[0] == "first prompt" + plain["text"]  # the same seeded answer after the echo
    assert r.json()["usage"]["prompt_tokens"] == len(_tokens(server, "first prompt")) + len(
        _tokens(server, "second"))


def test_echoed_logprobs_score_every_prompt_token_as_the_engine_would_generate_it(server: LiveServer) -> None:
    """A prompt's last token scored with echo has the logprob the engine gave it when it generated
    that token greedily after the rest: the two paths (a scored chunk, a decode step) agree."""
    first = server.post(C, comp(server, prompt="scoring", max_tokens=1, temperature=0, logprobs=1,
                                return_tokens_as_token_ids=True)).json()
    generated = first["choices"][0]["logprobs"]
    ids = _tokens(server, "scoring")
    (token,) = generated["tokens"]
    assert token.startswith("token_id:")
    r = server.post(C, comp(server, prompt=ids + [int(token.removeprefix("token_id:"))], max_tokens=1,
                            temperature=0, logprobs=1, echo=True, return_tokens_as_token_ids=True))
    assert r.status == 200, r.data
    lp = r.json()["choices"][0]["logprobs"]
    n = len(ids) + 1
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["token_logprobs"][n - 1] == pytest.approx(generated["token_logprobs"][0], abs=1e-4)
    # greedy: the generated token is the best at its position, so its entry is the top one
    top = lp["top_logprobs"][n - 1]
    assert max(top.values()) == pytest.approx(lp["token_logprobs"][n - 1], abs=1e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["tokens"][:n] == [f"token_id:{t}" for t in ids] + [token]
    server.wait_idle(30.0)


def test_an_echoed_stream_starts_with_the_prompt_and_its_logprobs(server: LiveServer) -> None:
    r = server.post(C, comp(server, prompt="streamed", echo=True, logprobs=0, stream=True))
    assert r.status == 200, r.data
    events = parse_sse(r.data)
    assert events[-1] == "[DONE]"
    first = events[0]["choices"][0]
    assert first["text"].startswith("streamed")
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) >= len(_tokens(server, "streamed"))
    whole = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert whole.startswith("streamed") and whole.count("streamed") >= 1


def test_the_tokenizer_routes_round_trip(server: LiveServer) -> None:
    ids = _tokens(server, "round trip")
    assert ids[0] == server.engine.tokenizer.bos_id and ids[1:] == _tokens(server, "round trip", bos=False)
    r = server.post("/tokenize", {"prompt": "round trip"})
    assert r.json()["count"] == len(ids) and r.json()["max_model_len"] == server.engine.max_context
    assert server.post("/detokenize", {"tokens": ids}).json() == {"prompt": "round trip"}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert len(chat) > 2 and chat[0] == server.engine.tokenizer.bos_id
    info = server.get("/tokenizer_info").json()
    assert info["bos_token"] == "<bos>" and info["eos_token"] == "<eos>"
    assert info["model_max_length"] == server.engine.max_context
