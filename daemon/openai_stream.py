"""The engine side of one OpenAI response and its server-sent-event form.

1. `Choices` reads the engine streams of a response's n choices as one
   stream of (choice index, TokenEvent). With one choice it is that stream;
   with more, a task per stream forwards its events to one queue, so events
   come out in the order the engine produced them. Closing it aborts every
   choice that has not finished (RequestStream.close), which frees their
   pages; that is what a client disconnect, a stream timeout, an error in
   one choice or an "abort" finish does to the other choices.
2. `stream_response` writes the events as SSE chunks through a StreamGuard
   (daemon/stream_guard.py): each chunk names its choice's `index`, each
   choice ends with its own finish chunk, and the last choice's finish goes
   out in one write with the usage chunk (stream_options.include_usage: the
   prompt once, every choice's tokens) and `data: [DONE]`. An engine error in
   any choice ends the stream with the 500 error object, then [DONE].
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from daemon import state as st
from daemon.bridge import EngineError, RequestStream
from daemon.errors import ApiError
from daemon.jsonlog import log_event
from daemon.openai_format import Format, Output, usage
from daemon.stream_guard import StreamGuard, StreamStalled
from engine.types import TokenEvent

log = logging.getLogger("crossover.api")

_END = None
"""What a forwarding task puts in the merged queue when its stream has ended."""


class Choices:
    """Async iterator of (choice index, event) over the engine streams of one response."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._open = len(streams)
        self._merged: asyncio.Queue[tuple[int, TokenEvent | EngineError | None]] = asyncio.Queue()
        self._pumps = ([] if len(streams) == 1 else
                       [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)])

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for event in stream:
                self._merged.put_nowait((index, event))
        except EngineError as exc:
            self._merged.put_nowait((index, exc))
        self._merged.put_nowait((index, _END))

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        if not self._pumps:  # one choice: its own stream, no task in between
            return 0, await self.streams[0].__anext__()
        while self._open:
            index, item = await self._merged.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, EngineError):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Abort every choice still running and stop the forwarding tasks."""
        for stream in self.streams:
            stream.close()
        for pump in self._pumps:
            pump.cancel()


def aborted() -> ApiError:
    return ApiError(503, "the request was aborted (server shutting down)", code="aborted")


def engine_failed(request_id: str, exc: EngineError) -> ApiError:
    """Log what the engine raised; the client gets a message naming no internals."""
    log_event(log, "engine error", level=logging.ERROR, request_id=request_id,
              error=repr(exc.__cause__ or exc))
    return ApiError(500, "the engine failed while serving this request; see the server log",
                    code="engine_error")


async def stream_response(request: web.Request, choices: Choices, fmt: Format,
                          outs: list[Output]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", "X-Request-Id": fmt.id})
    await response.prepare(request)
    settings = request.app[st.SETTINGS]
    guard = StreamGuard(response, request.transport, settings.stream_write_timeout_s,
                        settings.stream_idle_timeout_s)
    try:
        async with guard.watching():
            await _stream_events(guard, choices, fmt, outs)
    except ConnectionError:  # the client hung up; leaving aborts every choice
        st.request_record(request)["client_gone"] = True
    except StreamStalled as exc:  # the client stopped reading: abort, free its slots, hang up
        st.request_record(request).update(client_gone=True, stream_timeout=exc.reason)
        log_event(log, "client stopped reading; request aborted", level=logging.WARNING,
                  request_id=fmt.id, reason=exc.reason, pending_bytes=guard.pending())
        if request.transport is not None:
            request.transport.abort()
    return response


async def _stream_events(writer: StreamGuard, choices: Choices, fmt: Format,
                         outs: list[Output]) -> None:
    """Write each engine event as one write of its SSE chunks (one syscall, not one per chunk)."""
    first = b"".join(_encode(fmt, chunk) for chunk in fmt.first_chunks())
    if first:
        await writer.write(first)
    tail: list[bytes] = []
    running, failed = len(outs), False
    try:
        async for index, event in choices:
            outs[index].add(event)
            data = _event_chunks(fmt, event, index, outs[index])
            running -= 1 if event.finished else 0
            if not running or event.finish_reason == "abort":  # an abort (shutdown) ends them all
                tail.append(data)  # goes out with the usage chunk (or the error) and [DONE]
                break
            if data:
                await writer.write(data)
    except EngineError as exc:
        failed = True
        for out in outs:
            out.finish_reason = out.finish_reason or "error"
        tail.append(_encode(fmt, engine_failed(fmt.id, exc).body()))
    if any(out.finish_reason == "abort" for out in outs):
        tail.append(_encode(fmt, aborted().body()))
    elif fmt.spec.include_usage and not failed:
        tail.append(_encode(fmt, {**fmt.envelope(fmt.object_chunk, []), "usage": usage(fmt.spec, outs)}))
    tail.append(b"data: [DONE]\n\n")
    await writer.write(b"".join(tail))
    await writer.write_eof()


def _event_chunks(fmt: Format, event: TokenEvent, index: int, out: Output) -> bytes:
    """The SSE chunks of one engine event: its text (if any, and not held back), then its finish
    (if it ends)."""
    data = b""
    wanted = event.text or (event.logprobs and fmt.spec.sampling.logprobs) or index in fmt.unechoed
    choice = fmt.text_choice(event, index) if wanted else None
    if choice is not None:
        data = _encode(fmt, fmt.envelope(fmt.object_chunk, [choice]))
    if event.finished and event.finish_reason != "abort":
        for finish in fmt.finish_choices(out, event.finish_reason, index):
            data += _encode(fmt, fmt.envelope(fmt.object_chunk, [finish]))
    return data


def _encode(fmt: Format, payload: dict[str, Any]) -> bytes:
    if fmt.spec.include_usage and "choices" in payload and "usage" not in payload:
        payload["usage"] = None
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
