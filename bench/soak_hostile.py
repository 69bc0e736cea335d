"""The hostile clients of `crossover bench soak` (bench/soak_clients.py's module doc, 2): each holds
one connection the way an attacker or a broken client would and returns a `Hostile` outcome.
`HOSTILE` are connection-level (nothing reaches the engine), `ENGINE_HOSTILE` send requests
that reach it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from bench.soak_clients import (
    READ_LIMIT_S,
    connect,
    error_of,
    http_bytes,
    parse_answer,
    post_bytes,
    read_to_end,
)


@dataclass
class Hostile:
    kind: str
    seconds: float = 0.0
    status: int = 0
    """The status the daemon answered (0: none, it closed the connection or the client left)."""
    closed_by_daemon: bool = False
    problem: str | None = None


async def slowloris(port: int, key: str, rng: random.Random, header_timeout_s: float) -> Hostile:
    """Header bytes trickled every 2 s: the daemon must close the connection once
    `header_timeout_s` passed, answering nothing."""
    out, start = Hostile("slowloris"), time.monotonic()
    reader, writer = await connect(port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while time.monotonic() - start < header_timeout_s * 2 + 10:
            writer.write(f"X-Pad-{rng.randrange(10**6)}: ".encode())
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(1024), 2.0)
            except TimeoutError:
                continue
            out.closed_by_daemon = True
            out.status = parse_answer(data).status if data else 0
            break
    except ConnectionError:
        out.closed_by_daemon = True
    finally:
        writer.close()
    out.seconds = time.monotonic() - start
    if not out.closed_by_daemon:
        out.problem = f"trickled headers kept the connection {out.seconds:.0f} s"
    return out


async def idle_socket(port: int, key: str, rng: random.Random, header_timeout_s: float) -> Hostile:
    """A connection that never sends a byte: closed after `header_timeout_s`."""
    out, start = Hostile("idle socket"), time.monotonic()
    reader, writer = await connect(port)
    try:
        data = await read_to_end(reader, header_timeout_s * 2 + 10)
        out.status = parse_answer(data).status if data else 0
        out.closed_by_daemon = time.monotonic() - start < header_timeout_s * 2 + 9
    finally:
        writer.close()
    out.seconds = time.monotonic() - start
    if not out.closed_by_daemon:
        out.problem = f"an idle connection stayed open {out.seconds:.0f} s"
    return out


async def stalled_body(port: int, key: str, rng: random.Random, body_timeout_s: float) -> Hostile:
    """Headers promising 20 kB, 100 bytes of it, then nothing: 408 once `body_timeout_s` passed."""
    out, start = Hostile("stalled body"), time.monotonic()
    reader, writer = await connect(port)
    try:
        writer.write(http_bytes("POST", "/v1/completions", b"", {
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"}).replace(
            b"Content-Length: 0", b"Content-Length: 20000") + b'{"prompt": "' + b"x" * 88)
        await writer.drain()
        raw = parse_answer(await read_to_end(reader, body_timeout_s * 2 + 10))
        out.status, out.closed_by_daemon = raw.status, raw.status != 0
        if raw.status != 408 or error_of(raw) is None:
            out.problem = f"stalled body got {raw.status}: {raw.body[:200]!r}"
    except ConnectionError:
        out.problem = "stalled body: connection reset without an answer"
    finally:
        writer.close()
    out.seconds = time.monotonic() - start
    return out


def _stream_request(model: str, key: str, max_tokens: int) -> bytes:
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "logprobs": 1}
    return post_bytes("/v1/completions", body, key)


async def stalled_reader(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                         pace_s: float) -> Hostile:
    """A stream request whose client never reads, holding its socket 0.7-1.3 `pace_s` (the
    daemon's stream write timeout), then leaving."""
    out, start = Hostile("stalled reader"), time.monotonic()
    _reader, writer = await connect(port, rcvbuf=4096)
    try:
        writer.write(_stream_request(model, key, max_tokens))
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.7, 1.3) * pace_s)
    finally:
        writer.close()
    out.seconds = time.monotonic() - start
    return out


async def slow_reader(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                      pace_s: float) -> Hostile:
    """A stream read a kilobyte every `pace_s` / 10 until the daemon ends it."""
    out, start = Hostile("slow reader"), time.monotonic()
    reader, writer = await connect(port, rcvbuf=4096)
    try:
        writer.write(_stream_request(model, key, max_tokens))
        await writer.drain()
        first = await asyncio.wait_for(reader.read(1024), READ_LIMIT_S)
        out.status = parse_answer(first).status
        while time.monotonic() - start < 300:
            await asyncio.sleep(pace_s / 10)
            data = await asyncio.wait_for(reader.read(1024), READ_LIMIT_S)
            if not data:
                out.closed_by_daemon = True
                break
    except (TimeoutError, ConnectionError):
        out.closed_by_daemon = True
    finally:
        writer.close()
    out.seconds = time.monotonic() - start
    if out.status not in (200, 429):
        out.problem = f"slow reader got {out.status}"
    return out


async def midstream_hangup(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                           pace_s: float) -> Hostile:
    """A stream read for a few chunks, then the connection closed."""
    out, start = Hostile("hang-up mid-stream"), time.monotonic()
    reader, writer = await connect(port)
    try:
        writer.write(_stream_request(model, key, max_tokens))
        await writer.drain()
        first = await asyncio.wait_for(reader.read(rng.randint(200, 2000)), READ_LIMIT_S)
        out.status = parse_answer(first).status
    except (TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
    out.seconds = time.monotonic() - start
    if out.status not in (200, 429):
        out.problem = f"stream before the hang-up got {out.status}"
    return out


async def early_hangup(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                       pace_s: float) -> Hostile:
    """A request sent whole, the connection closed before the answer."""
    out, start = Hostile("hang-up before the answer"), time.monotonic()
    _reader, writer = await connect(port)
    try:
        writer.write(post_bytes("/v1/completions", {"model": model, "prompt": "Once upon a time",
                                               "max_tokens": max_tokens}, key))
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.0, 0.2))
    finally:
        writer.close()
    out.seconds = time.monotonic() - start
    return out


HOSTILE = (slowloris, idle_socket, stalled_body)
"""Connection-level: `(port, key, rng, timeout_s)`; nothing of theirs reaches the engine."""


ENGINE_HOSTILE = (stalled_reader, slow_reader, midstream_hangup, early_hangup)
"""Their requests reach the engine: `(port, key, rng, model, max_tokens, pace_s)`."""
