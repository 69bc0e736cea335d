"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

A handler authenticates the tenant (daemon.tenants.auth), reads and validates the
body against the tenant's limits (openai_params; 400 past its max_tokens),
takes one of the tenant's slots (daemon.tenants.gate; 429 past its
max_concurrent and max_queued), asks the admission check for room in the
engine, submits one engine Request, tagged with the tenant, through the
EngineThread and either collects the events into one JSON body or streams
them as server-sent events ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from daemon import state as st
from daemon.bridge import EngineError, RequestStream
from daemon.errors import ApiError, bad_request
from daemon.jsonlog import log_event
from daemon.openai_params import (
    GenerationSpec,
    Limits,
    decode_json_object,
    parse_chat,
    parse_completion,
    param_error,
    read_body,
)
from daemon.stream_guard import StreamGuard, StreamStalled
from daemon.tenants.auth import authenticate
from daemon.tenants.limits import TenantInfo
from engine.types import ParamError, Request, TokenEvent

routes = web.RouteTableDef()
log = logging.getLogger("crossover.api")

OFFLOAD_BYTES = 64 * 1024
"""Bodies larger than this are parsed and tokenized in a worker thread."""

Parser = Callable[[dict[str, Any], Limits, Any], GenerationSpec]


@dataclass
class _Output:
    """What came out of the engine for one request so far."""

    start: float = field(default_factory=time.monotonic)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    ttft_ms: float | None = None

    def add(self, event: TokenEvent) -> None:
        if self.ttft_ms is None and event.token_ids:
            self.ttft_ms = round((time.monotonic() - self.start) * 1000.0, 1)
        self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        if event.finished:
            self.finish_reason = event.finish_reason


class _Format:
    """Body shapes of /v1/completions; `_ChatFormat` overrides them for chat."""

    prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, model: str, spec: GenerationSpec, tok: Any) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model, self.spec, self.tok = model, spec, tok
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full_choice(self, out: _Output) -> dict[str, Any]:
        return {"index": 0, "text": "".join(out.text), "logprobs": self._lp(out.token_ids, out.logprobs),
                "finish_reason": out.finish_reason}

    def text_choice(self, event: TokenEvent) -> dict[str, Any]:
        lp = self._lp(list(event.token_ids), list(event.logprobs or ()))
        return {"index": 0, "text": event.text, "logprobs": lp, "finish_reason": None}

    def finish_choice(self, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def _lp(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.spec.sampling.logprobs:
            return None
        tokens = [self.tok.decode([t]) for t in token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = [{t: lp} for t, lp in zip(tokens, logprobs, strict=False)] if self.spec.top_logprobs else None
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top,
                "text_offset": offsets}


class _ChatFormat(_Format):
    prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def full_choice(self, out: _Output) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(out.text), "refusal": None}
        return {"index": 0, "message": message, "logprobs": self._lp(out.token_ids, out.logprobs),
                "finish_reason": out.finish_reason}

    def text_choice(self, event: TokenEvent) -> dict[str, Any]:
        lp = self._lp(list(event.token_ids), list(event.logprobs or ()))
        return {"index": 0, "delta": {"content": event.text}, "logprobs": lp, "finish_reason": None}

    def finish_choice(self, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}

    def first_chunks(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return [self.envelope(self.object_chunk, [choice])]

    def _lp(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.spec.sampling.logprobs:
            return None
        content = []
        for t, lp in zip(token_ids, logprobs, strict=False):
            text = self.tok.decode([t])
            entry = {"token": text, "logprob": lp, "bytes": list(text.encode())}
            content.append({**entry, "top_logprobs": [entry] if self.spec.top_logprobs else []})
        return {"content": content, "refusal": None}


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, _Format)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, _ChatFormat)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    await authenticate(request)
    return web.json_response({"object": "list", "data": [_model_card(request)]})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    await authenticate(request)
    card = _model_card(request)
    if request.match_info["model"] != card["id"]:
        raise ApiError(404, f"the model {request.match_info['model']!r} does not exist",
                       param="model", code="model_not_found")
    return web.json_response(card)


def _model_card(request: web.Request) -> dict[str, Any]:
    engine = request.app[st.ENGINE]
    return {"id": engine.model_name, "object": "model",
            "created": int(request.app[st.STATE].started_at), "owned_by": "crossover",
            "max_model_len": engine.max_context}


async def _generate(request: web.Request, parse: Parser, fmt_cls: type[_Format]) -> web.StreamResponse:
    out = _Output()  # starts the time-to-first-token clock
    arrival = time.time()  # waiting for a tenant slot counts toward latency
    tenant = await authenticate(request)
    app = request.app
    st.check_admission(app)
    engine, settings = app[st.ENGINE], app[st.SETTINGS]
    raw = await read_body(request, settings.max_body_bytes)
    limits = Limits(engine.model_name, engine.max_context, settings.max_prompt_chars,
                    tenant.limits.max_tokens, getattr(engine.tokenizer, "vocab_size", None))
    work = functools.partial(_parse, raw, parse, limits, engine.tokenizer)
    # big bodies are decoded and tokenized off the loop, so other streams keep flowing
    spec = await asyncio.to_thread(work) if len(raw) > OFFLOAD_BYTES else work()
    fmt = fmt_cls(engine.model_name, spec, engine.tokenizer)
    record = st.request_record(request)
    record.update(request_id=fmt.id, tenant=tenant.name, prompt_tokens=len(spec.prompt_ids),
                  stream=spec.stream)
    if spec.user is not None:  # the client's end-user label goes to the log line, nowhere else
        record["user"] = spec.user
    req = Request(fmt.id, spec.prompt_ids, spec.sampling, tenant.name, arrival)
    try:
        return await _serve(request, tenant, req, fmt, out)
    finally:
        record.update(completion_tokens=len(out.token_ids), finish_reason=out.finish_reason,
                      ttft_ms=out.ttft_ms)


async def _serve(request: web.Request, tenant: TenantInfo, req: Request, fmt: _Format,
                 out: _Output) -> web.StreamResponse:
    """Hold a tenant slot while the engine serves `req`; answer in one body or as SSE."""
    app = request.app
    async with app[st.GATES].slot(tenant):
        stream = _submit(app, req, fmt.spec)
        async with aclosing(stream):
            if fmt.spec.stream:
                return await _stream(request, stream, fmt, out)
            return await _collect(stream, fmt, out)


def _parse(raw: bytes, parse: Parser, limits: Limits, tok: Any) -> GenerationSpec:
    return parse(decode_json_object(raw), limits, tok)


def _submit(app: web.Application, req: Request, spec: GenerationSpec) -> RequestStream:
    st.check_admission(app)  # again: draining may have begun while the body was read
    st.check_capacity(app)
    try:
        return app[st.ENGINE_THREAD].submit(req)
    except ParamError as exc:  # the engine's rules (Request.validate), named as the body spells them
        raise param_error(exc, spec.names) from None
    except ValueError as exc:
        raise bad_request(str(exc), None, "invalid_value") from None
    except EngineError as exc:
        log_event(log, "engine refused a request", level=logging.WARNING, request_id=req.request_id,
                  error=str(exc))
        raise ApiError(503, "the engine is not accepting requests", code="engine_unavailable") from None


def _aborted() -> ApiError:
    return ApiError(503, "the request was aborted (server shutting down)", code="aborted")


def _engine_failed(request_id: str, exc: EngineError) -> ApiError:
    """Log what the engine raised; the client gets a message naming no internals."""
    log_event(log, "engine error", level=logging.ERROR, request_id=request_id,
              error=repr(exc.__cause__ or exc))
    return ApiError(500, "the engine failed while serving this request; see the server log",
                    code="engine_error")


async def _collect(stream: RequestStream, fmt: _Format, out: _Output) -> web.Response:
    try:
        async for event in stream:
            out.add(event)
    except EngineError as exc:
        raise _engine_failed(fmt.id, exc) from None
    if out.finish_reason == "abort":
        raise _aborted()
    body = fmt.envelope(fmt.object_full, [fmt.full_choice(out)])
    body["usage"] = _usage(fmt, out)
    return web.json_response(body, headers={"X-Request-Id": fmt.id})


async def _stream(request: web.Request, stream: RequestStream, fmt: _Format,
                  out: _Output) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", "X-Request-Id": fmt.id})
    await response.prepare(request)
    settings = request.app[st.SETTINGS]
    guard = StreamGuard(response, request.transport, settings.stream_write_timeout_s,
                        settings.stream_idle_timeout_s)
    try:
        async with guard.watching():
            await _stream_events(guard, stream, fmt, out)
    except ConnectionError:  # the client hung up; leaving aborts the request
        st.request_record(request)["client_gone"] = True
    except StreamStalled as exc:  # the client stopped reading: abort, free its slot, hang up
        st.request_record(request).update(client_gone=True, stream_timeout=exc.reason)
        log_event(log, "client stopped reading; request aborted", level=logging.WARNING,
                  request_id=fmt.id, reason=exc.reason, pending_bytes=guard.pending())
        if request.transport is not None:
            request.transport.abort()
    return response


async def _stream_events(writer: StreamGuard, stream: RequestStream, fmt: _Format,
                         out: _Output) -> None:
    """Write each engine event as one write of its SSE chunks (one syscall, not one per chunk)."""
    first = b"".join(_encode(fmt, chunk) for chunk in fmt.first_chunks())
    if first:
        await writer.write(first)
    tail: list[bytes] = []
    try:
        async for event in stream:
            out.add(event)
            data = _event_chunks(fmt, event)
            if event.finished:
                tail.append(data)  # goes out with the usage chunk and [DONE]
            elif data:
                await writer.write(data)
    except EngineError as exc:
        out.finish_reason = "error"
        tail.append(_encode(fmt, _engine_failed(fmt.id, exc).body()))
    if out.finish_reason == "abort":
        tail.append(_encode(fmt, _aborted().body()))
    elif fmt.spec.include_usage and out.finish_reason != "error":
        tail.append(_encode(fmt, {**fmt.envelope(fmt.object_chunk, []), "usage": _usage(fmt, out)}))
    tail.append(b"data: [DONE]\n\n")
    await writer.write(b"".join(tail))
    await writer.write_eof()


def _event_chunks(fmt: _Format, event: TokenEvent) -> bytes:
    """The SSE chunks of one engine event: its text (if any), then its finish (if it ends)."""
    data = b""
    if event.text or (event.logprobs and fmt.spec.sampling.logprobs):
        data = _encode(fmt, fmt.envelope(fmt.object_chunk, [fmt.text_choice(event)]))
    if event.finished and event.finish_reason != "abort":
        finish = fmt.finish_choice(event.finish_reason)
        data += _encode(fmt, fmt.envelope(fmt.object_chunk, [finish]))
    return data


def _encode(fmt: _Format, payload: dict[str, Any]) -> bytes:
    if fmt.spec.include_usage and "choices" in payload and "usage" not in payload:
        payload["usage"] = None
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _usage(fmt: _Format, out: _Output) -> dict[str, int]:
    prompt, completion = len(fmt.spec.prompt_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
