"""The clients of `crossover bench soak`: well-formed ones, hostile connections, bad inputs.

1. `well_formed` sends one valid request (bench.workloads prompts, streaming or not,
   greedy or seeded) and returns a `Answer`: status, X-Request-Id, TTFT of a stream
   (first chunk carrying text), tokens, whether it ended properly.
2. `HOSTILE` (connection-level, nothing reaches the engine) and `ENGINE_HOSTILE` (their
   requests reach the engine), in bench/soak_hostile.py, are coroutines that each hold one
   connection the way an attacker or a broken client would, and return a `Hostile` outcome:
   slowloris headers, a stalled body, an idle keep-alive socket, a stream nobody reads, a
   reader taking a kilobyte every few seconds, a hang-up mid-stream and one before the answer.
3. `bad_cases` lists every bad input the daemon must refuse with a 4xx OpenAI error body,
   sent raw (`raw_request`: one request per connection, exact bytes) so that bytes an
   HTTP library would refuse to send (a lone surrogate, `\\xff` in a header, a control
   byte) reach the daemon.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.workloads import Prompt

HOST = "127.0.0.1"
READ_LIMIT_S = 120.0
"""The longest a client waits for the daemon's answer to one request."""


@dataclass
class Answer:
    """What one well-formed request got."""

    status: int = 0
    request_id: str | None = None
    stream: bool = False
    ttft_s: float | None = None
    latency_s: float = 0.0
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


def request_body(prompt: Prompt, model: str, rng: random.Random,
                 max_tokens: int) -> tuple[str, dict[str, Any]]:
    """(path, body) of a valid request for `prompt`: streaming three times in four, greedy
    or seeded sampling, sometimes a stop string, usage in the stream."""
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
                            "stream": rng.random() < 0.75}
    if prompt.chat:
        path, body["messages"] = "/v1/chat/completions", prompt.as_messages()
    else:
        path, body["prompt"] = "/v1/completions", prompt.text
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=rng.choice([0.5, 1.0]), seed=rng.choice([-1, 0, rng.randrange(2**63)]),
                    top_p=rng.choice([0.9, 1.0]), top_k=rng.choice([0, 40]))
    if rng.random() < 0.2:
        body["stop"] = ["\n\n"]
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return path, body


async def well_formed(session: aiohttp.ClientSession, base: str, path: str, body: dict[str, Any],
                      key: str) -> Answer:
    answer = Answer(stream=bool(body.get("stream")))
    sent = time.perf_counter()
    try:
        async with session.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            answer.status, answer.request_id = r.status, r.headers.get("X-Request-Id")
            if r.status != 200:
                answer.error = (await r.text())[:300]
            elif answer.stream:
                await _read_stream(r, answer, sent)
            else:
                data = await r.json()
                choice = data["choices"][0]
                answer.finish_reason = choice["finish_reason"]
                answer.tokens = data["usage"]["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.latency_s = time.perf_counter() - sent
    if answer.error is None and answer.finish_reason not in ("stop", "length"):
        answer.error = f"finish_reason {answer.finish_reason!r}"
    return answer


async def _read_stream(r: aiohttp.ClientResponse, answer: Answer, sent: float) -> None:
    done = False
    async for line in r.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            answer.error = str(chunk["error"].get("message"))
        for choice in chunk.get("choices", ()):
            text = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
            if text and answer.ttft_s is None:
                answer.ttft_s = time.perf_counter() - sent
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
        if chunk.get("usage"):
            answer.tokens = chunk["usage"]["completion_tokens"]
    if not done and answer.error is None:
        answer.error = "the stream ended without [DONE]"


# ---- raw HTTP -----------------------------------------------------------------------------

@dataclass
class Raw:
    """A raw exchange's answer (status 0: the daemon closed without one)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    seconds: float = 0.0


def http_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
               host: str = HOST) -> bytes:
    """A request as bytes (headers encoded as latin-1 where they can be, UTF-8 otherwise)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    head = "\r\n".join(lines) + "\r\n\r\n"
    try:
        return head.encode("latin-1") + body
    except UnicodeEncodeError:
        return head.encode("utf-8", "surrogatepass") + body


def parse_answer(data: bytes) -> Raw:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/"):
        return Raw(body=data)
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return Raw(int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body)


async def connect(port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: it sets the window the daemon may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    except OSError:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=rcvbuf or 2**16)


async def read_to_end(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything until the daemon closes (or `timeout_s` passes, or the connection resets)."""
    chunks: list[bytes] = []
    end = time.monotonic() + timeout_s
    try:
        while (left := end - time.monotonic()) > 0:
            data = await asyncio.wait_for(reader.read(65536), left)
            if not data:
                break
            chunks.append(data)
    except (TimeoutError, ConnectionError):
        pass
    return b"".join(chunks)


async def raw_request(port: int, data: bytes, timeout_s: float = READ_LIMIT_S) -> Raw:
    """Send `data` on a new connection and read the answer until the daemon closes."""
    start = time.perf_counter()
    reader, writer = await connect(port)
    try:
        writer.write(data)
        await writer.drain()
        raw = parse_answer(await read_to_end(reader, timeout_s))
    except ConnectionError:
        raw = Raw()
    finally:
        writer.close()
    raw.seconds = time.perf_counter() - start
    return raw


def error_of(raw: Raw) -> dict[str, Any] | None:
    """The OpenAI error object of an answer, None when it is not one."""
    try:
        error = json.loads(raw.body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    ok = isinstance(error, dict) and isinstance(error.get("message"),
                                                str) and isinstance(error.get("type"), str)
    return error if ok else None


# ---- bad inputs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BadCase:
    name: str
    data: bytes
    status: int
    """The status the daemon must answer."""
    code: str | None = None
    """The error code it must carry (None: any)."""
    admin: bool = False
    """Sent with the admin token (the guess throttle counts wrong ones: see `wrong_admin`)."""


def post_bytes(path: str, body: Any, key: str, extra: dict[str, str] | None = None,
               raw: bytes | None = None) -> bytes:
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(extra or {})}
    return http_bytes("POST", path, data, headers)


def bad_cases(model: str, key: str, admin_token: str, max_context: int, max_body: int) -> list[BadCase]:
    """Every bad input a client or an admin may send, with the 4xx it must get."""
    C, CHAT = "/v1/completions", "/v1/chat/completions"
    comp = {"model": model, "prompt": "hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    huge = "1" + "0" * 400  # an integer past float range, as JSON text
    cases = [
        BadCase("huge int temperature", post_bytes(C, None, key, raw=json.dumps(comp)[:-1].encode()
                                                   + f', "temperature": {huge}}}'.encode()), 400),
        BadCase("huge int top_p", post_bytes(CHAT, None, key, raw=json.dumps(chat)[:-1].encode()
                                             + f', "top_p": {huge}}}'.encode()), 400),
        BadCase("huge int presence_penalty", post_bytes(C, None, key, raw=json.dumps(comp)[:-1].encode()
                                                        + f', "presence_penalty": -{huge}}}'.encode()), 400),
        BadCase("denormal repetition_penalty", post_bytes(C, {**comp, "repetition_penalty": 5e-324}, key),
                400),
        BadCase("lone surrogate in prompt", post_bytes(C, None, key, raw=json.dumps(comp).replace(
            '"hello"', '"\\ud800"').encode()), 400),
        BadCase("lone surrogate in chat", post_bytes(CHAT, None, key, raw=json.dumps(chat).replace(
            '"hi"', '"a\\udfffb"').encode()), 400),
        BadCase("empty messages past the context", post_bytes(CHAT, {**chat, "messages": [
            {"role": "user", "content": ""}] * (max_context + 1)}, key), 400),
        BadCase("prompt past the character bound",
                post_bytes(C, {**comp, "prompt": "x" * (max_context * 40)}, key), 400),
        BadCase("unknown stream_options key", post_bytes(C, {**comp, "stream": True,
                                                             "stream_options": {"include_usage": True,
                                                                                "x": 1}}, key), 400),
        BadCase("unknown text-part key", post_bytes(CHAT, {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache": True}]}]}, key), 400),
        BadCase("unknown field", post_bytes(C, {**comp, "frobnicate": 1}, key), 400),
        BadCase("unknown model", post_bytes(C, {**comp, "model": "gpt-17"}, key), 404),
        BadCase("seed past 64 bits", post_bytes(C, {**comp, "seed": 2**64}, key), 400),
        BadCase("max_tokens past the context", post_bytes(C, {**comp, "max_tokens": 10**9}, key), 400),
        BadCase("truncated JSON", post_bytes(C, None, key, raw=json.dumps(comp).encode()[:-3]), 400),
        BadCase("JSON not an object", post_bytes(C, None, key, raw=b"[1, 2]"), 400),
        BadCase("body past the limit", post_bytes(C, None, key, raw=b" " * (max_body + 1)), 413),
        BadCase("wrong API key", post_bytes(C, comp, "xo-not-a-key"), 401),
        BadCase("\\xff in the bearer", http_bytes("POST", C, json.dumps(comp).encode(), {
            "Authorization": "Bearer xo-\xff\xfe", "Content-Type": "application/json"}), 401),
        BadCase("control byte in a header", http_bytes("GET", "/v1/models", headers={
            "Authorization": f"Bearer {key}\x7f"}), 400, "malformed_request"),
        BadCase("foreign Host", http_bytes("POST", C, json.dumps(comp).encode(), {
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"}, host="evil.example"),
            403, "forbidden_origin"),
        BadCase("foreign Origin", post_bytes(C, comp, key, {"Origin": "https://evil.example"}), 403,
                "forbidden_origin"),
        BadCase("text/plain cross-site POST", http_bytes("POST", C, json.dumps(comp).encode(), {
            "Content-Type": "text/plain", "Origin": "http://attacker.test"}), 403, "forbidden_origin"),
    ]
    admin = {"Authorization": f"Bearer {admin_token}", "Content-Type": "application/json"}
    for name, body, code in (
            ("pin pool_split a huge int",
             b'{"rules": [{"max_batch": 64}], "pool_split": 1' + b"0" * 400 + b"}",
             "invalid_policy"),
            ("pin pool_split NaN", b'{"rules": [{"max_batch": 64}], "pool_split": NaN}', None),
            ("pin depth past the verify depth", json.dumps({"rules": [
                {"max_batch": 4, "technique": "ngram", "depth": 99}, {"max_batch": 64}]}).encode(),
                "invalid_policy"),
            ("pin rules out of order", json.dumps({"rules": [{"max_batch": 8}, {"max_batch": 4}]}).encode(),
             "invalid_policy"),
            ("pin unknown key", json.dumps({"rules": [{"max_batch": 64}], "bogus": 1}).encode(),
             "invalid_policy")):
        cases.append(BadCase(name, http_bytes("PUT", "/admin/policy/pin", body, admin), 400, code,
                             admin=True))
    for name, limits in (("tenant limit past 2**31", {"max_concurrent": 10**12}),
                         ("tenant limit a huge int", {"max_tokens": 10**400}),
                         ("tenant limit negative", {"max_queued": -1})):
        body = json.dumps({"name": f"soak-bad-{len(cases)}", **limits}).encode()
        cases.append(BadCase(name, http_bytes("POST", "/admin/tenants", body, admin), 400, admin=True))
    return cases


def wrong_admin(admin_token: str) -> BadCase:
    """A wrong admin token: 403, or 429 once this address used up its guesses."""
    return BadCase("wrong admin token", http_bytes("GET", "/admin/status", headers={
        "Authorization": f"Bearer {admin_token}-guess"}), 403, "invalid_admin_token")


# ---- hostile connections ------------------------------------------------------------------


