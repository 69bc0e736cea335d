"""The official `openai` client against a real daemon on loopback (FakeEngine)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import openai
import pytest

from engine.fake import FakeEngine, FakeTokenizer, fake_logprob
from tests.daemon.helpers import MODEL, LiveServer

TOK = FakeTokenizer()


@pytest.fixture
def server(live: Callable[..., LiveServer]) -> LiveServer:
    return live()


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_completion_text_usage_and_finish(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=50)
    assert r.choices[0].text == "dlrow olleh"
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    # prompt: BOS + 11 bytes; completion: 11 bytes + EOS
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (12, 12, 24)


def test_completion_max_tokens_and_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5)
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason, r.usage.completion_tokens) == ("dlrow", "length", 5)
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=50, stop=["o", "zz"],
                                  temperature=0.7, top_p=0.9, seed=3, extra_body={"top_k": 5})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("dlr", "stop")


def test_completion_from_token_ids_and_unicode(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=TOK.encode("hi"), max_tokens=10)
    assert r.choices[0].text == "ih" and r.usage.prompt_tokens == 3
    r = client.completions.create(model=MODEL, prompt="naïve €", max_tokens=50)
    assert r.choices[0].text == "€ evïan"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="abcde", max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["e", "d", "c"]
    assert lp.token_logprobs == [fake_logprob(i) for i in range(3)]
    assert lp.top_logprobs == [{"e": 0.0}, {"d": -0.25}, {"c": -0.5}]
    assert lp.text_offset == [0, 1, 2]


def test_chat_completion(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=500)
    prompt = TOK.apply_chat_template(messages)
    assert r.choices[0].message.content == prompt[::-1]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(TOK.encode(prompt))
    assert r.usage.completion_tokens == len(prompt) + 1


def test_chat_max_tokens_length_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=1)
    assert r.choices[0].message.content == " :tn"
    assert r.choices[0].finish_reason == "length"
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == [fake_logprob(i) for i in range(4)]
    assert [c.top_logprobs[0].token for c in content] == [" ", ":", "t", "n"]
    assert all(len(c.top_logprobs) == 1 for c in content)


def test_fields_the_server_cannot_honour_are_refused_by_name(client: openai.OpenAI) -> None:
    """More alternatives than the engine lists, tools, structured output, unknown keys: a 400
    unsupported_parameter naming the field, never a silent answer without it."""
    messages = [{"role": "user", "content": "hi"}]
    attempts = [
        ("top_logprobs", dict(logprobs=True, top_logprobs=5)),
        ("response_format", dict(response_format={"type": "json_object"})),
        ("tools", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        ("min_p", dict(extra_body={"min_p": 0.05})),
        ("guided_json", dict(extra_body={"guided_json": {}})),
    ]
    for name, fields in attempts:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, **fields)
        error = info.value.body
        assert (error["param"], error["code"]) == (name, "unsupported_parameter"), error
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="abc", logprobs=3)
    assert (info.value.body["param"], info.value.body["code"]) == ("logprobs", "unsupported_parameter")


def test_labels_developer_role_and_stop_token_ids(client: openai.OpenAI) -> None:
    messages = [{"role": "developer", "content": "d"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, user="alice",
                                       metadata={"team": "a"}, seed=-1, max_tokens=50)
    assert r.choices[0].message.content == "system: d\nuser: hi\nassistant: "[::-1]
    stop = TOK.encode("u", add_bos=False)  # the fake answers "hello" with "olleh"
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=50,
                                  extra_body={"stop_token_ids": TOK.encode("e", add_bos=False) + stop})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("oll", "stop")


def test_streamed_completion_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=50,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "em maerts"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_starts_with_role(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "héllo"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == TOK.apply_chat_template(messages)[::-1]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_client_errors_surface_as_openai_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-17", prompt="x")
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model=MODEL, prompt="x", n=2)
    assert br.value.param == "n"


def test_async_client_concurrent_requests(server: LiveServer) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as c:
            rs = await asyncio.gather(*(c.completions.create(model=MODEL, prompt=f"n{i}", max_tokens=8)
                                        for i in range(20)))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == [f"n{i}"[::-1] for i in range(20)]
    server.wait_idle()
    assert len(server.sink.results) == 20


def test_large_prompt_goes_through_the_worker_thread_path(live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(max_context=200_000, num_pages=20_000))
    prompt = "ab" * 40_000  # 80 kB body: decoded and tokenized off the event loop
    r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5})
    assert r.status == 200
    body = r.json()
    assert body["choices"][0]["text"] == "babab"
    assert body["usage"]["prompt_tokens"] == 80_001
    assert r.headers["x-request-id"] == body["id"]
