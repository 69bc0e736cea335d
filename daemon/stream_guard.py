"""Bounds on a streamed response whose client stops reading.

A client that stops reading a stream without closing it does not look gone:
the kernel's socket buffers fill, then the transport's, and aiohttp's
`write` waits for a drain that never comes, holding the request's tenant
slot and its KV pages until the socket closes. `StreamGuard` ends that:

1. `write(data)` / `write_eof()` may each wait `write_timeout_s` for the
   client to take the bytes (aiohttp waits only once its buffer passes its
   high-water mark, so a write into an empty buffer goes without a timer);
2. while `watching()`, a timer samples every `idle_timeout_s / 4` (at most
   1 s) how many written bytes the client has taken (written minus those
   still in the transport's buffer and, on Linux, the socket's send queue).
   If bytes wait and none were taken for `idle_timeout_s`, it trips, also
   while the handler waits on the engine: a slow stream whose client stopped
   reading is caught before aiohttp's buffer is full.

Either raises `StreamStalled` (reason "write_timeout" or "idle_timeout") out
of `watching()`; the handler then leaves the request's stream (which aborts
it in the engine and frees its pages) and drops the connection.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

try:  # the socket's unsent byte count; Linux only, elsewhere only aiohttp's buffer counts
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):
    _OUTQ = None


class StreamStalled(Exception):
    """The client took none of a stream's bytes for too long."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        """"write_timeout" or "idle_timeout"."""


class StreamGuard:
    """Writes to `response` under the write timeout; `watching()` adds the idle timeout."""

    def __init__(self, response: web.StreamResponse, transport: Any, write_timeout_s: float,
                 idle_timeout_s: float) -> None:
        self._response, self._transport = response, transport
        self._write_timeout_s, self._idle_timeout_s = write_timeout_s, idle_timeout_s
        self._interval_s = min(1.0, idle_timeout_s / 4)
        limits = getattr(transport, "get_write_buffer_limits", None)
        self._high_water = limits()[1] if limits is not None else 0
        self._written = 0  # payload bytes handed to `response`
        self._taken = 0  # of those, the most the client has been seen to take
        self._taken_at = 0.0  # loop time of the last sample that saw progress (or nothing waiting)
        self._deadline: asyncio.Timeout | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.tripped: str | None = None

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[StreamGuard]:
        """Run the body under the idle timeout; raise StreamStalled when either bound trips."""
        loop = asyncio.get_running_loop()
        self._taken_at = loop.time()
        try:
            async with asyncio.timeout(None) as deadline:
                self._deadline = deadline
                self._timer = loop.call_later(self._interval_s, self._sample)
                yield self
        except TimeoutError:
            if self.tripped is None:
                raise
            raise StreamStalled(self.tripped) from None
        finally:
            if self._timer is not None:
                self._timer.cancel()

    async def write(self, data: bytes) -> None:
        self._written += len(data)
        transport = self._transport
        if (transport is not None and not transport.is_closing()
                and transport.get_write_buffer_size() == 0 and len(data) <= self._high_water):
            # nothing waits in the transport, so this write cannot wait for the client: no timer
            await self._response.write(data)
            return
        await self._bounded(self._response.write(data))

    async def write_eof(self) -> None:
        await self._bounded(self._response.write_eof())

    async def _bounded(self, send: Any) -> None:
        bound = asyncio.timeout(self._write_timeout_s)
        try:
            async with bound:
                await send
        except TimeoutError:
            if not bound.expired():
                raise
            self.tripped = "write_timeout"
            raise StreamStalled(self.tripped) from None

    def pending(self) -> int:
        """Bytes written to the connection that the client has not taken yet."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return 0
        return transport.get_write_buffer_size() + _unsent(transport)

    def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        now, pending = loop.time(), self.pending()
        taken = self._written - pending
        if pending == 0 or taken > self._taken:
            self._taken, self._taken_at = max(taken, self._taken), now
        elif now - self._taken_at >= self._idle_timeout_s and self._deadline is not None:
            self.tripped = "idle_timeout"
            self._deadline.reschedule(now)  # raises TimeoutError where the handler waits
            return
        self._timer = loop.call_later(self._interval_s, self._sample)


def _unsent(transport: Any) -> int:
    """Bytes in the socket's send queue not yet acknowledged by the peer (0 where unknown)."""
    sock = transport.get_extra_info("socket")
    if _OUTQ is None or sock is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0
