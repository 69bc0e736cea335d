"""The official `openai` client against a real daemon on loopback (FakeEngine); raw HTTP for
`n` > 1 at the edges (tenant slots, disconnects, stalled readers, a failing choice)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable, Iterator

import openai
import pytest

from daemon.state import GATES
from daemon.tenants.auth import AUTH
from daemon.tenants.limits import TenantInfo, TenantLimits
from engine.fake import FakeEngine, FakeTokenizer, fake_logprob
from tests.daemon.helpers import MODEL, LiveServer, parse_sse, wait_for

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
    """Logit bias, structured output on the fake engine (its tokens follow no grammar), unknown
    keys: a 400 unsupported_parameter naming the field, never a silent answer without it."""
    messages = [{"role": "user", "content": "hi"}]
    attempts = [
        ("response_format", dict(response_format={"type": "json_object"})),
        ("logit_bias", dict(logit_bias={"5": 1})),
        ("guided_json", dict(extra_body={"guided_json": {}})),
    ]
    for name, fields in attempts:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, **fields)
        error = info.value.body
        assert (error["param"], error["code"]) == (name, "unsupported_parameter"), error
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="abc", logprobs=21)
    assert (info.value.body["param"], info.value.body["code"]) == ("logprobs", "invalid_value")


def test_labels_developer_role_and_stop_token_ids(client: openai.OpenAI) -> None:
    messages = [{"role": "developer", "content": "d"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, user="alice",
                                       metadata={"team": "a"}, seed=-1, max_tokens=50)
    assert r.choices[0].message.content == "system: d\nuser: hi\nassistant: "[::-1]
    stop = TOK.encode("u", add_bos=False)  # the fake answers "hello" with "olleh"
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=50,
                                  extra_body={"stop_token_ids": TOK.encode("e", add_bos=False) + stop})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("oll", "stop")


def test_penalties_min_p_and_min_tokens_are_honoured(client: openai.OpenAI) -> None:
    """Accepted through the client's own arguments and extra_body; the fake's answer shows
    min_tokens at work (the early EOS is held off)."""
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=20, presence_penalty=0.5,
                                  frequency_penalty=-0.5, extra_body={"min_p": 0.1, "min_tokens": 8,
                                                                      "repetition_penalty": 1.1})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("ollehoolleh", "stop")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       presence_penalty=1.0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"


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
        client.completions.create(model=MODEL, prompt="x", n=9)
    assert (br.value.param, br.value.code) == ("n", "invalid_value")


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


# ---- n > 1: each choice its own engine request ---------------------------------------------

def test_n_choices(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.completions.create(model=MODEL, prompt="hello", n=3, max_tokens=50, temperature=0.8,
                                  seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == ["olleh"] * 3  # the fake ignores sampling
    assert all(c.finish_reason == "stop" for c in r.choices)
    # the prompt (BOS + 5 bytes) counted once, as OpenAI does; each choice 5 bytes + EOS
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 18, 24)
    server.wait_idle()
    assert sorted(res.request_id for res in server.sink.results) == [f"{r.id}-{i}" for i in range(3)]
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=3)
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [
        (0, " :t", "length"), (1, " :t", "length")]
    assert r.usage.completion_tokens == 6


def test_n_choices_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=50, n=3,
                                            stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices  # one choice per chunk, named by its index
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {i: "em maerts" for i in range(3)}
    assert finishes == {i: ["stop"] for i in range(3)}  # each choice ends once, with its reason
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 10
    assert chunks[-1].usage.completion_tokens == 30
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                               n=2, max_tokens=4, stream=True))
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chat[:2]]
    assert roles == [(0, "assistant"), (1, "assistant")]
    for i in range(2):
        mine = [c.choices[0] for c in chat if c.choices[0].index == i]
        assert "".join(m.delta.content or "" for m in mine) == " :tn"
        assert [m.finish_reason for m in mine if m.finish_reason] == ["length"]


def test_n_choices_raw_stream_ends_with_one_done(server: LiveServer) -> None:
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "abc", "n": 2, "stream": True})
    events = parse_sse(r.data)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert sorted(e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]) == [0, 1]


class TwoSlots:
    """A key directory with one tenant of two slots, none of which may wait."""

    async def lookup(self, key: str) -> TenantInfo | None:
        return TenantInfo("duo", TenantLimits(max_concurrent=2, max_queued=0)) if key == "sk" else None


def raw_stream(port: int, body: dict[str, object], key: str | None = None) -> socket.socket:
    """A socket (small receive window) that has sent one streaming request and read nothing yet."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the window
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n{auth}\r\n".encode() + data)
    return sock


def long_body(n: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": "abcdefgh", "max_tokens": 3000, "ignore_eos": True,
            "stream": True, "n": n}


def test_n_choices_take_n_of_the_tenants_slots(live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=0.01), open_mode=False)
    server.app[AUTH].directory = TwoSlots()
    key = {"Authorization": "Bearer sk"}
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 4}
    r = server.post("/v1/completions", {**body, "n": 3}, key)
    assert r.status == 400 and r.json()["error"]["param"] == "n"  # three slots it can never have
    sock = raw_stream(server.port, long_body(1), "sk")
    try:
        sock.recv(100)  # the stream has begun: one of the two slots is taken
        r = server.post("/v1/completions", {**body, "n": 2}, key)
        assert r.status == 429 and r.json()["error"]["code"] == "tenant_concurrency_limit"
        assert server.app[GATES].in_flight() == {"duo": (1, 0)}  # the slot it took is given back
        assert server.post("/v1/completions", body, key).status == 200  # one choice fits
    finally:
        sock.close()
    server.wait_idle()
    r = server.post("/v1/completions", {**body, "n": 2}, key)
    assert r.status == 200 and [c["text"] for c in r.json()["choices"]] == ["ba", "ba"]


def test_a_client_disconnect_aborts_every_choice(live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=0.01))
    sock = raw_stream(server.port, long_body(3))
    sock.recv(100)
    wait_for(lambda: server.engine.pages_used > 0, what="the choices running")
    sock.close()
    wait_for(lambda: len(server.sink.results) == 3, 10, "three choices aborted")
    assert [r.finish_reason for r in server.sink.results] == ["abort"] * 3
    server.wait_idle()
    assert server.engine.pages_used == 0


def test_a_stalled_reader_aborts_every_choice(live: Callable[..., LiveServer],
                                              caplog: pytest.LogCaptureFixture) -> None:
    server = live(FakeEngine(step_delay_s=0.02), stream_write_timeout_s=600.0,
                  stream_idle_timeout_s=0.5)
    caplog.set_level(logging.WARNING, logger="crossover.api")
    sock = raw_stream(server.port, long_body(3))
    try:  # never reads: the idle timeout trips
        wait_for(lambda: len(server.sink.results) == 3, 30, "three choices aborted")
        assert [r.finish_reason for r in server.sink.results] == ["abort"] * 3
        assert all(r.output_tokens < 3000 for r in server.sink.results)
        server.wait_idle()
    finally:
        sock.close()
    reasons = [r.crossover_fields["reason"] for r in caplog.records  # type: ignore[attr-defined]
               if r.getMessage() == "client stopped reading; request aborted"]
    assert reasons == ["idle_timeout"]  # one response: one timeout, every choice aborted


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_in_one_choice_fails_the_response(live: Callable[..., LiveServer], stream: bool) -> None:
    engine = FakeEngine(step_delay_s=0.005)

    def fault(request_id: str) -> None:  # choice 1 fails after two tokens
        if request_id.endswith("-1") and engine._running[request_id].produced >= 2:
            raise RuntimeError("internal detail")

    engine.request_fault = fault
    server = live(engine)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "abc", "n": 3, "max_tokens": 2000,
                                        "ignore_eos": True, "stream": stream})
    if stream:
        events = parse_sse(r.data)
        assert r.status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
        error = events[-2]["error"]
    else:
        error = r.json()["error"]
        assert r.status == 500
    assert (error["code"], error["type"]) == ("engine_error", "server_error")
    assert "internal detail" not in r.data.decode()
    server.wait_idle()
    reasons = {res.request_id[-2:]: res.finish_reason for res in server.sink.results}
    assert reasons == {"-0": "abort", "-1": "error", "-2": "abort"}  # the others were aborted
    assert engine.pages_used == 0


def test_n_choices_need_room_for_all_in_the_engine(live: Callable[..., LiveServer]) -> None:
    """The daemon-wide capacity (max_batch + max_waiting) counts every choice; a response that
    does not fit is refused before any choice reaches the engine."""
    server = live(FakeEngine(max_batch=2, step_delay_s=0.01), max_waiting=1)
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 4}
    r = server.post("/v1/completions", {**body, "n": 4})
    assert (r.status, r.json()["error"]["param"]) == (400, "n")  # 3 in flight at most
    sock = raw_stream(server.port, long_body(1))
    try:
        sock.recv(100)
        r = server.post("/v1/completions", {**body, "n": 3})
        assert r.status == 429 and r.json()["error"]["code"] == "queue_full"
        assert server.post("/v1/completions", {**body, "n": 2}).status == 200
    finally:
        sock.close()
    server.wait_idle()
    assert sorted(res.finish_reason for res in server.sink.results) == ["abort", "stop", "stop"]
