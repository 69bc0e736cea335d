"""vLLM's tokenizer routes, for clients that count or build prompts in the model's own tokens
(lm-eval's `remote` tokenizer reads all three):

- `POST /tokenize`: {"prompt": text} (`add_special_tokens`, default true: a leading BOS) or
  {"messages": [...]} (`add_generation_prompt`, default true) -> {"count", "max_model_len", "tokens"};
- `POST /detokenize`: {"tokens": [ids]} -> {"prompt": text};
- `GET /tokenizer_info`: the special tokens' texts and the context length.

Each takes a tenant's key as the generation routes do, and `model` when sent must be a served name.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from daemon import state as st
from daemon.errors import bad_request
from daemon.generation import Limits
from daemon.openai_params import chat_ids, chat_messages, check_fields, check_model, optional
from daemon.request_body import decode_json_object, read_body
from daemon.tenants.auth import authenticate

routes = web.RouteTableDef()

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    body, limits = await _body(request, TOKENIZE_FIELDS)
    tok = request.app[st.ENGINE].tokenizer
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("send one of prompt or messages", "prompt", "missing_required_parameter")
    if "messages" in body:
        ids = chat_ids(chat_messages(body, limits), tok, _flag(body, "add_generation_prompt"))
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string", "prompt", "invalid_type")
        if len(prompt) > limits.max_prompt_chars:
            raise bad_request(f"prompt is {len(prompt)} characters, more than this server's "
                              f"{limits.max_prompt_chars}", "prompt", "context_length_exceeded")
        ids = tok.encode(prompt, add_bos=_flag(body, "add_special_tokens"))
    return web.json_response({"count": len(ids), "max_model_len": limits.max_context, "tokens": ids,
                              "token_strs": None})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    body, limits = await _body(request, DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    if ids is None:
        raise bad_request("you must provide a tokens parameter", "tokens", "missing_required_parameter")
    high = limits.vocab_size
    if not (isinstance(ids, list) and all(_is_id(t, high) for t in ids)):
        raise bad_request(f"tokens must be a list of token ids{'' if high is None else f' in [0, {high})'}",
                          "tokens", "invalid_value")
    if len(ids) > limits.max_context:
        raise bad_request(f"tokens holds {len(ids)} ids, more than the context of {limits.max_context}",
                          "tokens", "context_length_exceeded")
    return web.json_response({"prompt": request.app[st.ENGINE].tokenizer.decode(ids)})


@routes.get("/tokenizer_info")
async def tokenizer_info(request: web.Request) -> web.Response:
    await authenticate(request)
    engine = request.app[st.ENGINE]
    tok = engine.tokenizer

    def text(name: str) -> str | None:
        i = getattr(tok, name, None)
        return None if i is None else tok.piece(i)

    return web.json_response({
        "tokenizer_class": type(tok).__name__, "model_max_length": engine.max_context,
        "bos_token": text("bos_id"), "eos_token": text("eos_id"), "pad_token": text("pad_id"),
        "vocab_size": getattr(tok, "vocab_size", None)})


async def _body(request: web.Request, fields: frozenset[str]) -> tuple[dict[str, Any], Limits]:
    """The checked JSON body of a tokenizer route and what it may ask for."""
    await authenticate(request)
    app = request.app
    engine, settings = app[st.ENGINE], app[st.SETTINGS]
    body = decode_json_object(await read_body(request, settings.max_body_bytes, settings.body_timeout_s))
    names = settings.served_names(engine.model_name)
    limits = Limits(names[0], engine.max_context, settings.max_prompt_chars,
                    vocab_size=getattr(engine.tokenizer, "vocab_size", None), model_names=names)
    if "model" in body:
        check_model(body, limits)
    check_fields(body, fields)
    return body, limits


def _flag(body: dict[str, Any], key: str) -> bool:
    """A boolean field, true when absent (or null)."""
    value = optional(body, key, bool, "a boolean")
    return True if value is None else value


def _is_id(value: Any, high: int | None) -> bool:
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return 0 <= value and (high is None or value < high)
