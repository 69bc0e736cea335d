"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

A handler authenticates the tenant (daemon.tenants.auth), reads and validates the
body against the tenant's limits (openai_params; 400 past its max_tokens, or
for `n` past its max_concurrent), takes one of the tenant's slots per choice
(daemon.tenants.gate; 429 past its max_concurrent and max_queued), asks the
admission check for room in the engine, submits one engine Request per
choice, tagged with the tenant, through the EngineThread and either collects
the events into one JSON body or streams them as server-sent events ending in
`data: [DONE]` (daemon.openai_stream). Body shapes are daemon.openai_format's.

A request with `n` > 1 is n engine requests, ids `<id>-0` .. `<id>-<n-1>`
(one choice keeps the response id), seeds `seed + i` (mod 2**64) when the
request has one, so a seeded response is reproducible and choice i is what
`n: 1` with seed + i gives. Its n tenant slots are taken one after another
before any choice starts: it is admitted whole or refused whole (429, the
slots it took are given back). While it waits for the rest it holds those
it has, but the queue is FIFO, so it only waits for requests ahead of it and
two such requests cannot deadlock (n above max_concurrent is refused by the
parser). An error in any choice fails the whole response (500
engine_error), aborting the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from daemon import state as st
from daemon.bridge import EngineError, RequestStream
from daemon.errors import ApiError, bad_request
from daemon.jsonlog import log_event
from daemon.openai_format import ChatFormat, Format, Output, usage
from daemon.openai_params import (
    GenerationSpec,
    Limits,
    param_error,
    parse_chat,
    parse_completion,
)
from daemon.openai_stream import Choices, aborted, engine_failed, stream_response
from daemon.request_body import decode_json_object, read_body
from daemon.tenants.auth import authenticate
from daemon.tenants.limits import TenantInfo
from engine.types import ParamError, Request

routes = web.RouteTableDef()
log = logging.getLogger("crossover.api")

OFFLOAD_BYTES = 64 * 1024
"""Bodies larger than this are parsed and tokenized in a worker thread."""
SEED_MODULUS = 1 << 64
"""Choice seeds wrap around the 64-bit range the engine reads seeds in."""

Parser = Callable[[dict[str, Any], Limits, Any], GenerationSpec]


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, Format)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, ChatFormat)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    await authenticate(request)
    names = request.app[st.SETTINGS].served_names(request.app[st.ENGINE].model_name)
    return web.json_response({"object": "list", "data": [_model_card(request, name) for name in names]})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    await authenticate(request)
    name = request.match_info["model"]
    if name not in request.app[st.SETTINGS].served_names(request.app[st.ENGINE].model_name):
        raise ApiError(404, f"the model {name[:200]!r} does not exist", param="model", code="model_not_found")
    return web.json_response(_model_card(request, name))


def _model_card(request: web.Request, name: str) -> dict[str, Any]:
    engine = request.app[st.ENGINE]
    return {"id": name, "object": "model",
            "created": int(request.app[st.STATE].started_at), "owned_by": "crossover",
            "max_model_len": engine.max_context}


async def _unless_draining(app: web.Application, reading: Any) -> bytes:
    """The body `reading` reads, or the 503 of a draining server once draining begins: a
    request still reading its body is not admitted yet, so a drain need not wait for it."""
    read = asyncio.ensure_future(reading)
    stop = asyncio.ensure_future(app[st.STATE].drain_started.wait())
    try:
        await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (read, stop):
            if not task.done():
                task.cancel()
        await asyncio.gather(read, stop, return_exceptions=True)
    if read.done() and not read.cancelled():
        return read.result()  # or its 413, 408, or the client's going away
    st.check_admission(app)  # draining: 503 shutting_down
    raise AssertionError("unreachable")


def _prompt_chars(settings: Any, engine: Any) -> int:
    """Most prompt characters a request may send: `max_prompt_chars`, and no more than the
    context could hold at the tokenizer's longest piece a token, so a prompt that cannot fit
    is refused before it is tokenized (a million characters hold the GIL for a second)."""
    piece = getattr(engine.tokenizer, "max_piece_chars", None)
    cap = settings.max_prompt_chars
    return cap if piece is None else min(cap, engine.max_context * piece)


async def _generate(request: web.Request, parse: Parser, fmt_cls: type[Format]) -> web.StreamResponse:
    start = time.monotonic()  # the time-to-first-token clock
    arrival = time.time()  # waiting for a tenant slot counts toward latency
    tenant = await authenticate(request)
    app = request.app
    st.check_admission(app)
    engine, settings = app[st.ENGINE], app[st.SETTINGS]
    raw = await _unless_draining(app, read_body(request, settings.max_body_bytes, settings.body_timeout_s))
    names = settings.served_names(engine.model_name)
    limits = Limits(names[0], engine.max_context, _prompt_chars(settings, engine),
                    tenant.limits.max_tokens, getattr(engine.tokenizer, "vocab_size", None),
                    tenant.limits.max_concurrent, names)
    work = functools.partial(_parse, raw, parse, limits, engine.tokenizer)
    # big bodies are decoded and tokenized off the loop, so other streams keep flowing
    spec = await asyncio.to_thread(work) if len(raw) > OFFLOAD_BYTES else work()
    if spec.choices > settings.max_in_flight:  # could never be admitted whole
        raise bad_request(f"{spec.choices} choices are more than this server's {settings.max_in_flight} "
                          "requests in flight", "n", "invalid_value")
    fmt = fmt_cls(names[0], spec, engine.tokenizer)
    record = st.request_record(request)
    record.update(request_id=fmt.id, tenant=tenant.name, prompt_tokens=sum(map(len, spec.all_prompts)),
                  stream=spec.stream)
    if spec.user is not None:  # the client's end-user label goes to the log line, nowhere else
        record["user"] = spec.user
    if spec.choices > 1:
        record["n"] = spec.choices
    reqs = [Request(rid, ids, sampling, tenant.name, arrival)
            for rid, ids, sampling in _choice_requests(fmt.id, spec)]
    outs = [Output(start) for _ in reqs]
    try:
        return await _serve(request, tenant, reqs, fmt, outs)
    finally:
        reasons = [out.finish_reason for out in outs]
        firsts = [out.ttft_ms for out in outs if out.ttft_ms is not None]
        record.update(completion_tokens=sum(len(out.token_ids) for out in outs),
                      finish_reason=reasons[0] if len(reasons) == 1 else reasons,
                      ttft_ms=min(firsts, default=None))


def _choice_requests(response_id: str, spec: GenerationSpec) -> list[tuple[str, list[int], Any]]:
    """(engine request id, prompt ids, sampling) per choice, `n` per prompt in prompt order (the
    choice's `index`): one choice keeps the response's id and seed; choice i gets seed + i.

    >>> from engine.types import SamplingParams
    >>> spec = GenerationSpec([1], SamplingParams(seed=2**64 - 1), False, False, 0, n=2)
    >>> [(rid, sp.seed) for rid, _, sp in _choice_requests("cmpl-x", spec)]
    [('cmpl-x-0', 18446744073709551615), ('cmpl-x-1', 0)]
    """
    if spec.choices == 1:
        return [(response_id, spec.prompt_ids, spec.sampling)]
    seed = spec.sampling.seed
    return [(f"{response_id}-{i}", ids, spec.sampling if seed is None else
             dataclasses.replace(spec.sampling, seed=(seed + i) % SEED_MODULUS))
            for i, ids in enumerate(ids for ids in spec.all_prompts for _ in range(spec.n))]


async def _serve(request: web.Request, tenant: TenantInfo, reqs: list[Request], fmt: Format,
                 outs: list[Output]) -> web.StreamResponse:
    """Hold a tenant slot per choice while the engine serves them; answer in one body or as SSE.
    The slots go back once the engine has finished every choice, even while a slow client
    still reads the rest of the stream (the stream guard bounds that)."""
    app = request.app
    slots = _Slots(app[st.GATES], tenant)
    await slots.take(len(reqs))
    watcher: asyncio.Task | None = None
    try:
        async with aclosing(_submit_all(app, reqs, fmt.spec)) as choices:
            watcher = asyncio.create_task(_release_when_done(choices, slots))
            if fmt.spec.stream:
                return await stream_response(request, choices, fmt, outs)
            return await _collect(choices, fmt, outs)
    finally:  # nothing awaited here: a client that hangs up now cannot cancel the cleanup
        if watcher is not None:
            watcher.cancel()
        slots.give_back()


class _Slots:
    """A response's tenant slots, one per choice, given back once (whichever comes first: the
    engine finished every choice, or the handler ends)."""

    def __init__(self, gates: Any, tenant: TenantInfo) -> None:
        self._gates, self._tenant, self._held = gates, tenant, 0

    async def take(self, n: int) -> None:
        try:
            for _ in range(n):
                await self._gates.acquire(self._tenant)
                self._held += 1
        except BaseException:
            self.give_back()
            raise

    def give_back(self) -> None:
        while self._held:
            self._held -= 1
            self._gates.release(self._tenant)


async def _release_when_done(choices: Choices, slots: _Slots) -> None:
    await asyncio.gather(*(stream.engine_done.wait() for stream in choices.streams))
    slots.give_back()


def _parse(raw: bytes, parse: Parser, limits: Limits, tok: Any) -> GenerationSpec:
    return parse(decode_json_object(raw), limits, tok)


def _submit_all(app: web.Application, reqs: list[Request], spec: GenerationSpec) -> Choices:
    """Submit every choice, or none: room for all is checked first, and a refusal after all
    aborts those already submitted."""
    limit = app[st.SETTINGS].max_in_flight
    if len(reqs) > 1 and app[st.ENGINE_THREAD].engine_active + len(reqs) > limit:
        raise ApiError(429, f"the server has no room for {len(reqs)} more requests ({limit} in flight "
                       "at most); retry later", code="queue_full", headers={"Retry-After": st.RETRY_AFTER_S})
    streams: list[RequestStream] = []
    try:
        for req in reqs:
            streams.append(_submit(app, req, spec))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return Choices(streams)


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


async def _collect(choices: Choices, fmt: Format, outs: list[Output]) -> web.Response:
    try:
        async for index, event in choices:
            outs[index].add(event)
            if event.finish_reason == "abort":  # the server is shutting down: no choice is answered
                break
    except EngineError as exc:
        raise engine_failed(fmt.id, exc) from None
    if any(out.finish_reason == "abort" for out in outs):
        raise aborted()
    body = fmt.envelope(fmt.object_full, [fmt.full_choice(out, i) for i, out in enumerate(outs)])
    body["usage"] = usage(fmt.spec, outs)
    return web.json_response(body, headers={"X-Request-Id": fmt.id})
