"""Client connections: how many may be open, and how long one may take to ask.

`make_runner(app, settings)` is the aiohttp runner every server of the daemon uses
(`crossover serve`, the tests' live servers):

1. A connection has `header_timeout_s` to send a complete request line and headers,
   and may stay idle that long between requests; then it is closed. (aiohttp's own
   default is an hour, so a client trickling header bytes held its connection that
   long, before any authentication.)
2. At most `max_connections` are open at once: one more is answered 503 with an
   OpenAI-style error body and closed at once, before aiohttp parses anything, so
   descriptors and memory stay bounded however many sockets a client opens.
3. A request's body must arrive within `body_timeout_s` (`read_body` in
   daemon/openai_params.py answers 408 past it), so a stalled body holds no handler.
4. `origin_middleware`: a daemon bound to a loopback address answers only requests
   that name a loopback host (`Host`) and, when a browser says where the request
   comes from (`Origin`), come from a loopback page. A web page the user visits can
   otherwise drive it: by DNS rebinding (its own name resolving to 127.0.0.1, so
   `Host` is that name) or by a cross-site POST with a plain-text body, which a
   browser sends without asking first (a CORS "simple request", carrying `Origin`).
   Both get 403 `forbidden_origin`. A daemon bound elsewhere is reached by names
   this cannot know, and checks neither; `check_origin = false` turns it off (a
   proxy that forwards its clients' Host can instead set Host to the daemon's).
5. A request aiohttp cannot parse (a control byte in a header, a bad request line)
   gets a 400 with an OpenAI-style error body (`malformed_request`) and the connection
   closes (`_JsonErrors`; aiohttp's own answer is plain text); `quiet_malformed_requests`
   makes its log record one warning line instead of an error with a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from daemon import state as st
from daemon.errors import ApiError
from daemon.settings import is_loopback

FULL = ApiError(503, "too many open connections; retry later", code="too_many_connections")


class _Refused(asyncio.Protocol):
    """A connection past the cap: one 503 and the socket closes (nothing is read)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = json.dumps(FULL.body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(head + body)
        transport.close()


class _JsonErrors(RequestHandler):
    """aiohttp's connection handler, answering the errors it raises itself (a request it
    cannot parse; a handler that failed outside the middleware) with an OpenAI-style error
    body instead of plain text."""

    __slots__ = ()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises once bytes went out
        if status >= 500:
            error = ApiError(status, "internal error; see the server log", code="internal_error")
        else:
            detail = (str(message or "").strip().splitlines() or ["the request could not be parsed"])[0]
            error = ApiError(status, f"malformed HTTP request: {detail[:200]}", code="malformed_request")
        response = error.response()
        response.force_close()
        return response


class _Capped:
    """aiohttp's protocol factory (web.Server), refusing connections past `limit`."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self._server, self._limit = server, limit
        self.refused = 0

    def __call__(self) -> asyncio.Protocol:
        if len(self._server.connections) >= self._limit:
            self.refused += 1
            return _Refused()
        server = self._server  # what web.Server.__call__ makes, with the JSON error answers
        return _JsonErrors(server, loop=server._loop, **server._kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose sites get the capped protocol factory (module docstring)."""

    def __init__(self, app: web.Application, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._max_connections = max_connections
        self._capped: _Capped | None = None

    @property
    def server(self) -> Any:  # the sites' protocol factory; the runner keeps the real one
        real = super().server
        if real is None:
            return None
        if self._capped is None or self._capped._server is not real:
            self._capped = _Capped(real, self._max_connections)
        return self._capped

    @property
    def refused(self) -> int:
        """Connections answered 503 for the cap so far."""
        return 0 if self._capped is None else self._capped.refused


def make_runner(app: web.Application, settings: Any, shutdown_timeout: float, **kwargs: Any) -> GuardedRunner:
    """The runner of `app` under `settings`' connection limits (module docstring)."""
    return GuardedRunner(app, settings.max_connections, access_log=None, handler_cancellation=True,
                         shutdown_timeout=shutdown_timeout, keepalive_timeout=settings.header_timeout_s,
                         **kwargs)


def _loopback_name(netloc: str) -> bool:
    """Whether a `Host` value or an Origin's host[:port] names this machine's loopback."""
    host = urlsplit(f"//{netloc}").hostname
    return host is not None and is_loopback(host)


@web.middleware
async def origin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """403 for a loopback daemon's requests from elsewhere (module docstring, 4)."""
    settings = request.app[st.SETTINGS]
    if settings.check_origin and is_loopback(settings.host):
        host, origin = request.headers.get("Host"), request.headers.get("Origin")
        if host is not None and not _loopback_name(host):
            raise ApiError(403, f"this daemon listens on a loopback address and serves only requests "
                           f"to it; Host {host[:100]!r} is not one", code="forbidden_origin")
        if origin is not None and not (origin.startswith(("http://", "https://"))
                                       and _loopback_name(urlsplit(origin).netloc)):
            raise ApiError(403, f"requests from web pages other than this machine's are refused; "
                           f"Origin {origin[:100]!r}", code="forbidden_origin")
    return await handler(request)


class _MalformedRequests(logging.Filter):
    """aiohttp.server's record of a request it could not parse, as one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            detail = (str(exc.message).strip().splitlines() or [type(exc).__name__])[0][:200]
            record.msg, record.args = f"malformed HTTP request refused (400): {detail}", ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def quiet_malformed_requests() -> None:
    """Install `_MalformedRequests` on aiohttp's server logger (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _MalformedRequests) for f in logger.filters):
        logger.addFilter(_MalformedRequests())

