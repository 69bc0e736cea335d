"""Many concurrent streams with random disconnects, each recorded in SQLite; 429 on a full queue."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
from collections.abc import Callable
from typing import Any

import aiohttp

from engine.fake import FakeEngine, FakeTokenizer
from tests.daemon.helpers import MODEL, LiveServer, parse_sse, wait_for

TOK = FakeTokenizer()
N_REQUESTS = 100


def plan(i: int, rng: random.Random) -> dict[str, Any]:
    """Request i: completion or chat, a prompt, max_tokens, and when the client hangs up. A client
    that hangs up asks for hundreds of tokens, so its stream is still running when it goes, however
    slowly a loaded machine runs this test's client."""
    hang_up_after = rng.randint(1, 6) if rng.random() < 0.35 else None
    chat = rng.random() < 0.4
    n_words = rng.randint(1, 6) if hang_up_after is None else 120
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "délta"]) for _ in range(n_words))
    prompt_text = f"{i}: {words}"
    if chat:
        messages = [{"role": "user", "content": prompt_text}]
        body = {"model": MODEL, "messages": messages}
        text = TOK.apply_chat_template(messages)
    else:
        body = {"model": MODEL, "prompt": prompt_text}
        text = prompt_text
    max_tokens = rng.randint(3, 60) if hang_up_after is None else 2000
    body.update(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
            "chat": chat, "expected": text[::-1], "max_tokens": max_tokens,
            "hang_up_after": hang_up_after}


def expected_output(p: dict[str, Any]) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) the fake engine must produce."""
    tokens = TOK.encode(p["expected"], add_bos=False)
    if p["max_tokens"] <= len(tokens):
        return TOK.decode(tokens[: p["max_tokens"]]), "length", p["max_tokens"]
    return p["expected"], "stop", len(tokens) + 1


def check_stream(p: dict[str, Any], data: bytes) -> str:
    events = parse_sse(data)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if p["chat"]:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in choices)
    else:
        text = "".join(c["text"] for c in choices)
    finish = [c["finish_reason"] for c in choices]
    want_text, want_finish, want_tokens = expected_output(p)
    assert (text, finish[-1]) == (want_text, want_finish)
    assert set(finish[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == want_tokens
    return chunks[0]["id"]


async def one(session: aiohttp.ClientSession, url: str, p: dict[str, Any]) -> tuple[str, str | None]:
    async with session.post(url + p["path"], json=p["body"]) as resp:
        assert resp.status == 200, await resp.text()
        if p["hang_up_after"] is None:
            return "completed", check_stream(p, await resp.read())
        for _ in range(p["hang_up_after"]):
            line = await resp.content.readline()
            while line == b"\n":
                line = await resp.content.readline()
            assert line.startswith(b"data: ")
        resp.close()  # drop the connection mid-stream
        return "disconnected", None


def test_hundred_streams_with_random_disconnects(db_url: str,
                                                 live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(max_batch=16, step_delay_s=0.001), db_url=db_url, max_waiting=200)
    rng = random.Random(1234)
    plans = [plan(i, rng) for i in range(N_REQUESTS)]

    async def main() -> list[tuple[str, str | None]]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(*(one(session, server.url, p) for p in plans))

    outcomes = asyncio.run(main())
    completed = {rid for kind, rid in outcomes if kind == "completed"}
    n_disconnected = sum(kind == "disconnected" for kind, _ in outcomes)
    assert len(completed) + n_disconnected == N_REQUESTS
    assert n_disconnected >= 20 and len(completed) >= 40

    wait_for(lambda: len(server.sink.results) >= N_REQUESTS, what="a result per request")
    server.wait_idle()
    results = server.sink.results
    assert len(results) == N_REQUESTS and len({r.request_id for r in results}) == N_REQUESTS
    assert completed <= {r.request_id for r in results}
    assert any(r.finish_reason == "abort" for r in results)  # disconnects really aborted
    assert server.engine.pages_used == 0
    assert all(s.batch_size <= 16 for s in server.sink.steps)
    check_database(server, db_url)


def check_database(server: LiveServer, db_url: str) -> None:
    """Every request and every step reached SQLite through the recorder."""
    assert server.database is not None and server.database.recorder.flush(10.0)
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    try:
        rows = con.execute("SELECT request_id, tenant, finish_reason, status, output_tokens "
                           "FROM xo_requests").fetchall()
        n_steps = con.execute("SELECT COUNT(*) FROM xo_steps").fetchone()[0]
    finally:
        con.close()
    by_id = {r.request_id: r for r in server.sink.results}
    assert len(rows) == N_REQUESTS and {r[0] for r in rows} == set(by_id)
    for request_id, tenant, reason, status, output_tokens in rows:
        result = by_id[request_id]
        assert (tenant, reason, output_tokens) == ("default", result.finish_reason,
                                                    result.output_tokens)
        assert status == ("aborted" if reason == "abort" else "ok")
    assert n_steps == len(server.sink.steps)
    assert server.database.recorder.stats()["dropped"] == 0


def test_full_queue_gets_429_with_retry_after(live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(max_batch=1, step_delay_s=0.01), max_waiting=1)
    body = {"model": MODEL, "prompt": "z" * 100, "max_tokens": 200, "stream": True}

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            first = await session.post(server.url + "/v1/completions", json=body)
            second = await session.post(server.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "q"}], "stream": True})
            assert (first.status, second.status) == (200, 200)
            async with session.post(server.url + "/v1/completions", json=body) as third:
                assert third.status == 429
                assert int(third.headers["Retry-After"]) >= 1
                error = (await third.json())["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
            first.close()
            second.close()

    asyncio.run(main())
    wait_for(lambda: len(server.sink.results) == 2, what="both aborted")
    server.wait_idle()
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 5})
    assert r.status == 200 and json.loads(r.data)["choices"][0]["text"] == "ko"
