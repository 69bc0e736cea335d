"""Request bodies of the OpenAI-compatible routes -> a validated `GenerationSpec`.

Types are read here; ranges are checked by `engine.types.SamplingParams.validate`
and `Request.validate`, the same rules `EngineCore.add_request` applies, so a
bad value is refused before the engine sees it. Each failure is an ApiError
whose `param` names the offending field. Every body key is either honoured,
accepted at its neutral value only (`best_of: 1`, `logit_bias: {}`, ...), or
refused with 400 `unsupported_parameter`; unknown keys are refused too
(daemon/README.md has the table). One field beyond OpenAI's: `ignore_eos` (a
boolean, as in vLLM) keeps generating past the model's stop tokens, so load
tests get exactly max_tokens tokens; `top_k`, `min_p`, `min_tokens`,
`repetition_penalty` and `stop_token_ids` are vLLM's. `n` (1..MAX_N choices) is
bounded by the tenant's max_concurrent too, since each choice takes one of its slots.
`response_format` and vLLM's `guided_*` / `structured_outputs` constrain the output
(daemon/structured.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from daemon import structured, tools
from daemon.errors import ApiError, bad_request
from daemon.generation import GenerationSpec, Limits, Tokenizer
from engine.types import Constraint, ParamError, Request, SamplingParams, check_prompt_ids, is_finite_number

COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "logprobs", "stream", "stream_options", "ignore_eos", "user", "metadata", "min_p", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "return_tokens_as_token_ids",
    *structured.FIELDS,
})
"""Keys both routes honour."""
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls"}
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "logit_bias": ({},),
    "functions": ([],),
    "store": (False,), "modalities": (["text"],),
}
"""Keys accepted only at the value that changes nothing (or null); any other value is refused."""
MESSAGE_FIELDS = frozenset({"role", "content"})
ROLE_FIELDS = {"assistant": MESSAGE_FIELDS | {"tool_calls"}, "tool": MESSAGE_FIELDS | {"tool_call_id"}}
ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles honoured; `developer` is read as `system`, `tool` results as user turns (daemon/tools.py)."""
UNSUPPORTED_ROLES = ("function",)
MAX_USER_CHARS = 256
MAX_N = 8
"""Most choices one request may ask for (`n`); each is its own engine request."""
MAX_PROMPTS = 16
"""Most prompts one completion request may carry; each is answered with its own `n` choices."""


def check_model(body: dict[str, Any], limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    names = limits.model_names or (limits.model_name,)
    if model not in names:
        raise ApiError(404, f"the model {model[:200]!r} does not exist; this daemon serves "
                       f"{', '.join(map(repr, names))}", param="model", code="model_not_found")


def parse_completion(body: dict[str, Any], limits: Limits, tok: Tokenizer) -> GenerationSpec:
    check_model(body, limits)
    check_fields(body, COMPLETION_FIELDS)
    names = {"prompt_ids": "prompt", "top_logprobs": "logprobs"}
    batch = _completion_batch(body, limits)
    # a string's control strings stay control tokens; ids are range-checked by Request.validate
    prompts = [tok.encode(p, add_bos=True) if isinstance(p, str) else list(p) for p in batch]
    logprobs, top = _completion_logprobs(body)
    longest = max(prompts, key=len)  # max_tokens' default and bound: the room the longest leaves
    spec = _spec(body, limits, longest, logprobs, top, names, default_max_tokens=16)
    if optional(body, "echo", bool, "a boolean"):  # the prompt's text, and with logprobs its tokens' too
        echo = tuple(p if isinstance(p, str) else tok.decode(p) for p in batch)
        scored = replace(spec.sampling, prompt_logprobs=top if logprobs else None)
        spec = replace(spec, echo=echo, sampling=scored)
    if len(prompts) == 1:
        return spec
    with _naming(names):
        for ids in prompts:
            Request("parse", ids, spec.sampling).validate(limits.vocab_size, limits.max_context)
    cap = limits.max_concurrent if limits.max_concurrent is not None else MAX_PROMPTS * MAX_N
    if len(prompts) * spec.n > min(cap, MAX_PROMPTS * MAX_N):
        raise bad_request(f"{len(prompts)} prompts x n={spec.n} choices is more than the "
                          f"{min(cap, MAX_PROMPTS * MAX_N)} "
                          "requests this API key may have in flight", "prompt", "invalid_value")
    return replace(spec, prompt_ids=prompts[0], prompts=prompts)


def _completion_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """(logprobs on, top entries) from `logprobs`: null/false, true, or an integer count."""
    value = body.get("logprobs")
    if value is None or value is False:
        return False, 0
    if value is True:
        return True, 0
    if not _is_int(value):
        raise _type_error("logprobs", "an integer or a boolean")
    return True, value


def parse_chat(body: dict[str, Any], limits: Limits, tok: Tokenizer) -> GenerationSpec:
    check_model(body, limits)
    check_fields(body, CHAT_FIELDS)
    offered = tools.parse_tools(body)
    messages = tools.tool_messages(chat_messages(body, limits), offered)
    forced = offered.constraint() if offered is not None else None
    if forced is not None and structured.constraint_of(body) is not None:
        raise bad_request("a forced tool call and a response format both constrain the output; send one",
                          "tool_choice", "invalid_value")
    prompt_ids = chat_ids(messages, tok)
    logprobs = optional(body, "logprobs", bool, "a boolean") or False
    top = _opt_int(body, "top_logprobs") or 0
    if top and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs", "invalid_value")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if key != "max_tokens" and body.get("max_tokens") not in (None, body[key]):
        raise bad_request("max_tokens and max_completion_tokens disagree; send one of them",
                          "max_tokens", "invalid_value")
    names = {"prompt_ids": "messages", "max_tokens": key}
    spec = _spec(body, limits, prompt_ids, logprobs, top, names, default_max_tokens=None, constraint=forced)
    return replace(spec, tools=offered)


def chat_ids(messages: list[dict[str, Any]], tok: Tokenizer, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids of checked chat `messages` in the model's template."""
    encode_chat = getattr(tok, "encode_chat", None)  # the real tokenizer: forging-safe ids
    try:
        if encode_chat is not None:
            return encode_chat(messages, add_generation_prompt=add_generation_prompt)
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return tok.encode(text, add_bos=True)
    except ValueError as exc:
        raise bad_request(str(exc), "messages", "invalid_value") from None


def _spec(body: dict[str, Any], limits: Limits, prompt_ids: list[int], logprobs: bool,
          top_logprobs: int, names: dict[str, str], *, default_max_tokens: int | None,
          constraint: Constraint | None = None) -> GenerationSpec:
    """The sampling settings, checked by the engine's own rules (Request.validate).

    An absent max_tokens defaults to `default_max_tokens` (completions: 16, as
    OpenAI) or, for chat, to the room the context leaves after the prompt;
    either is clamped to that room and to the tenant's cap.
    """
    with _naming(names):
        check_prompt_ids(prompt_ids, limits.vocab_size, limits.max_context)
    key = names.get("max_tokens", "max_tokens")
    room = limits.max_context - len(prompt_ids)
    max_tokens = _opt_int(body, key)
    cap = limits.max_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        max_tokens = max_tokens if cap is None else min(max_tokens, cap)
    elif cap is not None and max_tokens > cap:
        raise bad_request(f"{key}={max_tokens} is more than this API key's max_tokens "
                          f"limit of {cap} tokens per request", key, "max_tokens_exceeded")
    stream = optional(body, "stream", bool, "a boolean") or False
    top_k = _opt_int(body, "top_k")
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_opt_number(body, "temperature", 1.0),
        top_p=_opt_number(body, "top_p", 1.0),
        top_k=0 if top_k is None else top_k,
        seed=_opt_int(body, "seed"),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        stop=_stop_strings(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=optional(body, "ignore_eos", bool, "a boolean") or False,  # vLLM's extension
        min_p=_opt_number(body, "min_p", 0.0),
        min_tokens=_opt_int(body, "min_tokens") or 0,
        presence_penalty=_opt_number(body, "presence_penalty", 0.0),
        frequency_penalty=_opt_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_opt_number(body, "repetition_penalty", 1.0),
        constraint=constraint or structured.constraint_of(body),
    )
    with _naming(names):
        Request("parse", prompt_ids, sampling).validate(limits.vocab_size, limits.max_context)
    as_ids = optional(body, "return_tokens_as_token_ids", bool, "a boolean") or False
    return GenerationSpec(prompt_ids, sampling, stream, _include_usage(body, stream),
                          top_logprobs, names, _labels(body), _choices(body, limits), tokens_as_ids=as_ids)


@contextmanager
def _naming(names: dict[str, str]) -> Iterator[None]:
    """Turn an engine.types.ParamError raised inside into the 400 naming the body's key."""
    try:
        yield
    except ParamError as exc:
        raise param_error(exc, names) from None


def param_error(exc: ParamError, names: dict[str, str]) -> ApiError:
    """The 400 for an engine-rule failure, `param` spelled as the client sent it."""
    param = names.get(exc.field, exc.field)
    message = str(exc).replace(exc.field, param, 1) if exc.field != param else str(exc)
    return bad_request(message, param, exc.code)


def check_fields(body: dict[str, Any], honoured: frozenset[str]) -> None:
    """400 unsupported_parameter for a key that is neither honoured nor at its neutral value."""
    for key, value in body.items():
        if key in honoured or value is None:
            continue
        if key in NEUTRAL and any(_same(value, v) for v in NEUTRAL[key]):
            continue
        what = "is not supported by this server" if key in NEUTRAL else "is not a supported parameter"
        shown = f" (only {NEUTRAL[key][0]!r})" if key in NEUTRAL else ""
        raise bad_request(f"{key} {what}{shown}"[:300], key, "unsupported_parameter")


def _same(value: Any, neutral: Any) -> bool:
    """value == neutral with booleans and numbers kept apart (True is not 1)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _choices(body: dict[str, Any], limits: Limits) -> int:
    """`n`: 1..MAX_N, and no more than the tenant's max_concurrent (each choice takes a slot)."""
    n = _opt_int(body, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise _value_error("n", f"must be between 1 and {MAX_N}", n)
    cap = limits.max_concurrent
    if cap is not None and n > cap:
        raise bad_request(f"n={n} is more than this API key's max_concurrent limit of {cap} "
                          "requests in flight (each choice is one)", "n", "invalid_value")
    return n


def _labels(body: dict[str, Any]) -> str | None:
    """Check `user` (a short string) and `metadata` (an object of strings): labels only."""
    user = optional(body, "user", str, "a string")
    if user is not None and len(user) > MAX_USER_CHARS:
        raise _value_error("user", f"must be at most {MAX_USER_CHARS} characters", len(user))
    metadata = optional(body, "metadata", dict, "an object")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise _type_error("metadata", "an object of string values")
    return user


def _completion_batch(body: dict[str, Any], limits: Limits) -> list[str | list[int]]:
    """Each prompt, a string or a list of token ids: `prompt` is one of them or a list of either
    (a batch, at most MAX_PROMPTS); their characters together within max_prompt_chars."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("you must provide a prompt parameter", "prompt", "missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)):
        batch = prompt
    elif isinstance(prompt, list) and not prompt:
        raise _value_error("prompt", "must not be empty", prompt)
    else:
        raise _type_error("prompt", "a string, a list of token ids, or a list of either")
    if len(batch) > MAX_PROMPTS:
        raise _value_error("prompt", f"may hold at most {MAX_PROMPTS} prompts", len(batch))
    chars = sum(len(p) for p in batch if isinstance(p, str))
    if chars > limits.max_prompt_chars:
        raise _too_long("prompt", chars, limits)
    if any(p == "" for p in batch):
        raise _value_error("prompt", "must not be empty", "")
    return batch


def chat_messages(body: dict[str, Any], limits: Limits) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("you must provide a messages parameter", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array")
    if not messages:
        raise _value_error("messages", "must not be empty", messages)
    if len(messages) > limits.max_context:  # each renders a turn of tokens: refused untokenized
        raise bad_request(f"messages holds {len(messages)} messages; the context of "
                          f"{limits.max_context} tokens cannot hold them", "messages",
                          "context_length_exceeded")
    out, chars = [], 0
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _type_error(param, "an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{param}.role", "a string")
        if role in UNSUPPORTED_ROLES:
            raise bad_request(f"{param}.role {role!r} is not supported by this server",
                              f"{param}.role", "unsupported_parameter")
        if role not in ROLES:
            raise _value_error(f"{param}.role", f"must be one of {', '.join(ROLES)}", role)
        _only(message, ROLE_FIELDS.get(role, MESSAGE_FIELDS), param)
        content = _message_text(message.get("content"), f"{param}.content", role)
        chars += len(content)
        turn: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if message.get("tool_calls") is not None:
            turn["tool_calls"] = tools.check_tool_calls(message["tool_calls"], f"{param}.tool_calls")
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise _type_error(f"{param}.tool_call_id", "a string")
            turn["tool_call_id"] = message["tool_call_id"]
        out.append(turn)
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
        _only(part, ("type", "text"), f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or an array of strings")
    return tuple(stops)


def _int_list(body: dict[str, Any], key: str) -> tuple[int, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _type_error(key, "an array of integers")
    return tuple(value)


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options", "invalid_value")
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object")
    _only(options, ("include_usage",), "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _type_error("stream_options.include_usage", "a boolean")
    return include


# ---- small field readers --------------------------------------------------
def _only(obj: dict[str, Any], known: Any, param: str) -> None:
    """400 unsupported_parameter naming `param`.KEY for the first non-null key of `obj` outside
    `known`."""
    extra = next((k for k, v in obj.items() if k not in known and v is not None), None)
    if extra is not None:
        name = f"{param}.{extra}"[:300]
        raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return is_finite_number(value)


def optional(body: dict[str, Any], key: str, kind: type, what: str) -> Any:
    """`body[key]` when it is a `kind`; None when absent or null; else a 400 naming the key."""
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise _type_error(key, what)
    return value


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    """An optional integer (its range is the engine's rule, see _spec)."""
    value = body.get(key)
    if value is not None and not _is_int(value):
        raise _type_error(key, "an integer")
    return value


def _opt_number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value):
        raise _type_error(key, "a number")
    return float(value)


def _type_error(param: str, what: str) -> ApiError:
    return bad_request(f"{param} must be {what}", param, "invalid_type")


def _value_error(param: str, what: str, value: Any) -> ApiError:
    return bad_request(f"{param} {what}, got {value!r}"[:300], param, "invalid_value")


def _too_long(param: str, chars: int, limits: Limits) -> ApiError:
    return bad_request(f"{param} is {chars} characters; the limit is {limits.max_prompt_chars}",
                       param, "context_length_exceeded")
