"""End to end on the real Gemma 3 270M: the official `openai` client against the
HTTP daemon, completions, chat and streaming, with telemetry into SQLite."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from sqlalchemy import text

from tests.daemon.helpers import REAL_ENGINE, LiveServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    from engine.loader import load_engine

    engine = load_engine(**REAL_ENGINE, progress=False, speculation=False)
    engine.warmup(progress=False)
    db = f"sqlite:///{tmp_path_factory.mktemp('db') / 'telemetry.db'}"
    srv = LiveServer(engine, db_url=db).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def test_completion_greedy_matches_the_engine(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 6
    assert "Paris" in r.choices[0].text or "capital" in r.choices[0].text
    again = client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=12,
                                      temperature=0)
    assert again.choices[0].text == r.choices[0].text


def test_chat_uses_the_gemma_template(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="gemma3-270m", max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "Say hello."}])
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.usage.prompt_tokens > 8  # <bos><start_of_turn>user\n ... <start_of_turn>model\n


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model="gemma3-270m", prompt="def fibonacci(n):", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_requests_and_steps_are_recorded(client: openai.OpenAI, server: LiveServer) -> None:
    client.completions.create(model="gemma3-270m", prompt="Hello", max_tokens=4, temperature=0)
    server.database.recorder.flush()
    with server.database.engine.connect() as conn:
        n_req = conn.execute(text("select count(*) from xo_requests")).scalar()
        n_steps = conn.execute(text("select count(*) from xo_steps")).scalar()
    assert n_req >= 1 and n_steps >= 4
    assert server.engine.pool.used == 0


def test_a_prompt_the_context_cannot_hold_is_refused_before_tokenizing(server: LiveServer) -> None:
    """Past max_context x the tokenizer's longest piece (31 characters) a prompt cannot fit:
    400 context_length_exceeded counted in characters, the text never tokenized."""
    limit = server.engine.max_context * server.engine.tokenizer.max_piece_chars
    for path, body in (("/v1/completions", {"prompt": "ab " * (limit // 3 + 1)}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x" * (limit + 1)}]})):
        r = server.post(path, {"model": server.engine.model_name, "max_tokens": 4, **body})
        error = r.json()["error"]
        assert r.status == 400 and error["code"] == "context_length_exceeded", r.data
        assert f"the limit is {limit}" in error["message"]



def test_ready_names_the_weights_served_and_the_memory_they_leave_the_pool(server: LiveServer) -> None:
    """By default the model serves its GGUF's own blocks (without the quantized-matmul kernel, their
    numbers as float32); /ready's memory block names the form and its bytes, and, the pool's bytes
    being fixed here (REAL_ENGINE's kv_budget_bytes), the memory budget is them plus the pool's."""
    from engine.quant.matmul import kernel_available

    m = server.get("/ready").json()["engine"]["memory"]
    served = ("gguf", 256_080_384) if kernel_available() else ("float32", 4 * server.engine.cfg.param_count())
    assert (m["weights"], m["weight_bytes"]) == served
    assert m["memory_budget_bytes"] == m["weight_bytes"] + REAL_ENGINE["kv_budget_bytes"]
