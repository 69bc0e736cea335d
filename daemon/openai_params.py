"""Request bodies of the OpenAI-compatible routes -> a validated `GenerationSpec`.

Everything is checked here, before the engine sees the request; each
failure is an ApiError whose `param` names the offending field. One field
beyond OpenAI's: `ignore_eos` (a boolean, as in vLLM) keeps generating past
the model's stop tokens, so load tests get exactly max_tokens tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from daemon.errors import ApiError, bad_request
from engine.types import SamplingParams

MAX_STOP_STRINGS = 4
"""Like OpenAI."""
MAX_TOP_LOGPROBS = 20


class Tokenizer(Protocol):
    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True)
class Limits:
    """What a request may ask for."""

    model_name: str
    max_context: int
    max_prompt_chars: int
    max_tokens: int | None = None
    """The tenant's cap on completion tokens: more is a 400; an unset max_tokens is clamped."""


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request, ready to become an `engine.types.Request`."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    top_logprobs: int
    """Entries per token in top_logprobs; only the chosen token is ever listed."""


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The raw body, or 413 when it is larger than `max_bytes`."""
    too_large = ApiError(413, f"request body is larger than {max_bytes} bytes",
                         code="request_too_large")
    if (request.content_length or 0) > max_bytes:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object, or 400 (bad UTF-8, bad JSON, NaN, not an object)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"request body is not valid UTF-8 (byte {exc.start})"
        raise bad_request(message, code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def check_model(body: dict[str, Any], limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    if model != limits.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this daemon serves "
                       f"{limits.model_name!r}", param="model", code="model_not_found")


def parse_completion(body: dict[str, Any], limits: Limits, tok: Tokenizer) -> GenerationSpec:
    check_model(body, limits)
    _reject_unsupported(body)
    if body.get("echo") not in (None, False):
        raise _unsupported("echo")
    if body.get("suffix") not in (None, ""):
        raise _unsupported("suffix")
    prompt_ids = _completion_prompt(body, limits, tok)
    logprobs, top = _completion_logprobs(body)
    return _spec(body, limits, prompt_ids, logprobs, top, max_tokens_key="max_tokens",
                 default_max_tokens=16)


def _completion_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """(logprobs on, top entries) from `logprobs`: null/false, true, or an integer 0..5."""
    value = body.get("logprobs")
    if value is None or value is False:
        return False, 0
    if value is True:
        return True, 0
    if not _is_int(value):
        raise _type_error("logprobs", "an integer or a boolean")
    if not 0 <= value <= 5:
        raise _value_error("logprobs", "must be between 0 and 5", value)
    return True, min(value, 1)


def parse_chat(body: dict[str, Any], limits: Limits, tok: Tokenizer) -> GenerationSpec:
    check_model(body, limits)
    _reject_unsupported(body)
    messages = _chat_messages(body, limits)
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise bad_request(str(exc), "messages", "invalid_value") from None
    prompt_ids = tok.encode(text, add_bos=True)
    _check_prompt_fits(prompt_ids, limits, "messages")
    logprobs = _opt(body, "logprobs", bool, "a boolean") or False
    top = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs", "invalid_value")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _spec(body, limits, prompt_ids, logprobs, min(top, 1), max_tokens_key=key,
                 default_max_tokens=None)


def _spec(body: dict[str, Any], limits: Limits, prompt_ids: list[int], logprobs: bool,
          top_logprobs: int, *, max_tokens_key: str, default_max_tokens: int | None
          ) -> GenerationSpec:
    room = limits.max_context - len(prompt_ids)
    max_tokens = _opt_int(body, max_tokens_key, 1, limits.max_context)
    cap = limits.max_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        max_tokens = max_tokens if cap is None else min(max_tokens, cap)
    elif cap is not None and max_tokens > cap:
        raise bad_request(f"{max_tokens_key}={max_tokens} is more than this API key's max_tokens "
                          f"limit of {cap} tokens per request", max_tokens_key, "max_tokens_exceeded")
    elif max_tokens > room:
        raise bad_request(
            f"{max_tokens_key}={max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds "
            f"the context of {limits.max_context} tokens", max_tokens_key, "context_length_exceeded")
    stream = _opt(body, "stream", bool, "a boolean") or False
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_opt_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_opt_number(body, "top_p", 0.0, 1.0, 1.0, open_low=True),
        top_k=_opt_int(body, "top_k", 0, None) or 0,
        seed=_opt_int(body, "seed", -(1 << 63), (1 << 64) - 1),
        stop=_stop_strings(body),
        logprobs=logprobs,
        ignore_eos=_opt(body, "ignore_eos", bool, "a boolean") or False,  # vLLM's extension
    )
    try:
        sampling.validate(max_stop_strings=MAX_STOP_STRINGS)
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param if param in body else None, "invalid_value") from None
    return GenerationSpec(prompt_ids, sampling, stream, _include_usage(body, stream), top_logprobs)


def _reject_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request("only n=1 is supported", "n", "unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None and (not _is_number(value) or value != 0):
            raise _unsupported(key)
    if body.get("logit_bias") not in (None, {}):
        raise _unsupported("logit_bias")


def _completion_prompt(body: dict[str, Any], limits: Limits, tok: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("you must provide a prompt parameter", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise _value_error("prompt", "must not be empty", prompt)
        if len(prompt) > limits.max_prompt_chars:
            raise _too_long("prompt", len(prompt), limits)
        ids = tok.encode(prompt, add_bos=True)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if not prompt:
            raise _value_error("prompt", "must not be empty", prompt)
        if any(t < 0 for t in prompt):
            raise _value_error("prompt", "token ids must not be negative", prompt[:8])
        ids = list(prompt)
    elif isinstance(prompt, list):
        raise bad_request("only a single prompt (a string or a list of token ids) is supported",
                          "prompt", "invalid_type")
    else:
        raise _type_error("prompt", "a string or a list of token ids")
    _check_prompt_fits(ids, limits, "prompt")
    return ids


def _check_prompt_fits(ids: list[int], limits: Limits, param: str) -> None:
    if len(ids) >= limits.max_context:
        raise bad_request(
            f"the prompt is {len(ids)} tokens; the context holds {limits.max_context} tokens "
            "including at least one generated token", param, "context_length_exceeded")


def _chat_messages(body: dict[str, Any], limits: Limits) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("you must provide a messages parameter", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array")
    if not messages:
        raise _value_error("messages", "must not be empty", messages)
    out, chars = [], 0
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _type_error(param, "an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{param}.role", "a string")
        content = _message_text(message.get("content"), f"{param}.content", role)
        chars += len(content)
        out.append({"role": role, "content": content})
    if chars > limits.max_prompt_chars:
        raise _too_long("messages", chars, limits)
    return out


def _message_text(content: Any, param: str, role: str) -> str:
    """A message's text: a string, or the concatenated text parts of a list."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise _type_error(param, "a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request("only text content parts are supported", f"{param}[{j}]", "invalid_value")
        texts.append(part["text"])
    return "".join(texts)


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _value_error("stop", f"may hold at most {MAX_STOP_STRINGS} strings", len(stops))
    if any(s == "" for s in stops):
        raise _value_error("stop", "strings must not be empty", stop)
    return tuple(stops)


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options", "invalid_value")
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _type_error("stream_options.include_usage", "a boolean")
    return include


# ---- small field readers --------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _opt(body: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise _type_error(key, what)
    return value


def _opt_int(body: dict[str, Any], key: str, lo: int, hi: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise _type_error(key, "an integer")
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise _value_error(key, f"must be {bound}", value)
    return int(value)


def _opt_number(body: dict[str, Any], key: str, lo: float, hi: float, default: float,
                open_low: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value):
        raise _type_error(key, "a number")
    if value > hi or value < lo or (open_low and value == lo):
        low = "(" if open_low else "["
        raise _value_error(key, f"must be in {low}{lo}, {hi}]", value)
    return float(value)


def _type_error(param: str, what: str) -> ApiError:
    return bad_request(f"{param} must be {what}", param, "invalid_type")


def _value_error(param: str, what: str, value: Any) -> ApiError:
    return bad_request(f"{param} {what}, got {value!r}"[:300], param, "invalid_value")


def _unsupported(param: str) -> ApiError:
    return bad_request(f"{param} is not supported by this server", param, "unsupported_parameter")


def _too_long(param: str, chars: int, limits: Limits) -> ApiError:
    return bad_request(f"{param} is {chars} characters; the limit is {limits.max_prompt_chars}",
                       param, "context_length_exceeded")
