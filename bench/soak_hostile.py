"""The hostile clients of `crossover bench soak` (bench/soak_clients.py's module doc, 2): each holds
one connection the way an attacker or a broken client would and returns a `Hostile` outcome.
`HOSTILE` are connection-level (nothing reaches the engine), `ENGINE_HOSTILE` send requests
that reach it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
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

    def expect_stream(self, what: str) -> Hostile:
        """A stream request must have been answered 200 (or 429, busy): a problem otherwise."""
        if self.status not in (200, 429):
            self.problem = f"{what} got {self.status}"
        return self


@asynccontextmanager
async def _held(kind: str, port: int, rcvbuf: int | None = None) -> AsyncIterator[
        tuple[Hostile, asyncio.StreamReader, asyncio.StreamWriter]]:
    """One hostile connection: its outcome to fill, reader and writer; on leaving, the connection
    is closed and the outcome's `seconds` set (the time from before the connect)."""
    out, start = Hostile(kind), time.monotonic()
    reader, writer = await connect(port, rcvbuf=rcvbuf)
    try:
        yield out, reader, writer
    finally:
        writer.close()
        out.seconds = time.monotonic() - start


async def slowloris(port: int, key: str, rng: random.Random, header_timeout_s: float) -> Hostile:
    """Header bytes trickled every 2 s: the daemon must close the connection once
    `header_timeout_s` passed, answering nothing."""
    start = time.monotonic()
    async with _held("slowloris", port) as (out, reader, writer):
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
    if not out.closed_by_daemon:
        out.problem = f"trickled headers kept the connection {out.seconds:.0f} s"
    return out


async def idle_socket(port: int, key: str, rng: random.Random, header_timeout_s: float) -> Hostile:
    """A connection that never sends a byte: closed after `header_timeout_s`."""
    start = time.monotonic()
    async with _held("idle socket", port) as (out, reader, _writer):
        data = await read_to_end(reader, header_timeout_s * 2 + 10)
        out.status = parse_answer(data).status if data else 0
        out.closed_by_daemon = time.monotonic() - start < header_timeout_s * 2 + 9
    if not out.closed_by_daemon:
        out.problem = f"an idle connection stayed open {out.seconds:.0f} s"
    return out


async def stalled_body(port: int, key: str, rng: random.Random, body_timeout_s: float) -> Hostile:
    """Headers promising 20 kB, 100 bytes of it, then nothing: 408 once `body_timeout_s` passed."""
    async with _held("stalled body", port) as (out, reader, writer):
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
    return out


def _stream_request(model: str, key: str, max_tokens: int) -> bytes:
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "logprobs": 1}
    return post_bytes("/v1/completions", body, key)


async def _stream_status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes,
                         first_bytes: int) -> int:
    """Send `request`, read at most `first_bytes` of the answer: its status."""
    writer.write(request)
    await writer.drain()
    return parse_answer(await asyncio.wait_for(reader.read(first_bytes), READ_LIMIT_S)).status


async def stalled_reader(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                         pace_s: float) -> Hostile:
    """A stream request whose client never reads, holding its socket 0.7-1.3 `pace_s` (the
    daemon's stream write timeout), then leaving."""
    async with _held("stalled reader", port, rcvbuf=4096) as (out, _reader, writer):
        writer.write(_stream_request(model, key, max_tokens))
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.7, 1.3) * pace_s)
    return out


async def slow_reader(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                      pace_s: float) -> Hostile:
    """A stream read a kilobyte every `pace_s` / 10 until the daemon ends it."""
    start = time.monotonic()
    async with _held("slow reader", port, rcvbuf=4096) as (out, reader, writer):
        try:
            out.status = await _stream_status(reader, writer, _stream_request(model, key, max_tokens), 1024)
            while time.monotonic() - start < 300:
                await asyncio.sleep(pace_s / 10)
                data = await asyncio.wait_for(reader.read(1024), READ_LIMIT_S)
                if not data:
                    out.closed_by_daemon = True
                    break
        except (TimeoutError, ConnectionError):
            out.closed_by_daemon = True
    return out.expect_stream("slow reader")


async def midstream_hangup(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                           pace_s: float) -> Hostile:
    """A stream read for a few chunks, then the connection closed."""
    async with _held("hang-up mid-stream", port) as (out, reader, writer):
        try:
            request = _stream_request(model, key, max_tokens)
            out.status = await _stream_status(reader, writer, request, rng.randint(200, 2000))
        except (TimeoutError, ConnectionError):
            pass
    return out.expect_stream("stream before the hang-up")


async def early_hangup(port: int, key: str, rng: random.Random, model: str, max_tokens: int,
                       pace_s: float) -> Hostile:
    """A request sent whole, the connection closed before the answer."""
    async with _held("hang-up before the answer", port) as (out, _reader, writer):
        writer.write(post_bytes("/v1/completions", {"model": model, "prompt": "Once upon a time",
                                                   "max_tokens": max_tokens}, key))
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.0, 0.2))
    return out


HOSTILE = (slowloris, idle_socket, stalled_body)
"""Connection-level: `(port, key, rng, timeout_s)`; nothing of theirs reaches the engine."""


ENGINE_HOSTILE = (stalled_reader, slow_reader, midstream_hangup, early_hangup)
"""Their requests reach the engine: `(port, key, rng, model, max_tokens, pace_s)`."""
