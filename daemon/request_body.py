"""A request's body: read within a size and a time bound, then decoded as one JSON object.

`read_body` answers 413 past `max_bytes` and 408 when the body has not all arrived within
its timeout; `decode_json_object` answers 400 for bad UTF-8, bad JSON, NaN or Infinity, a
lone UTF-16 surrogate escape, or anything but an object.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from daemon.errors import ApiError, bad_request


async def read_body(request: web.Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The raw body, or 413 when it is larger than `max_bytes`, or 408 when it has not all
    arrived within `timeout_s` (a client stalling its body holds no handler)."""
    too_large = ApiError(413, f"request body is larger than {max_bytes} bytes",
                         code="request_too_large")
    if (request.content_length or 0) > max_bytes:
        raise too_large
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None


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
    if "\\ud" in text or "\\uD" in text:  # a \uXXXX escape of a surrogate: paired, or a 400
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                              "without its pair): strings must be valid Unicode",
                              code="invalid_json") from None
    return body


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")
