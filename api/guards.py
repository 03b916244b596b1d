"""ASGI guards around the Quart app: header size, the concurrent-request cap, the SSE orphan timeout.

They sit below Quart because they are about the connection, not the request body:

- **Header size.** Hypercorn's `h11_max_incomplete_size` (set to `--max-header-bytes`)
  only bounds headers still arriving: a request whose headers come complete in one read
  (up to 64 KiB) passes it. So the guard measures the request line and headers and
  answers 431 in the OpenAI envelope above `--max-header-bytes` (64 KiB).

- **Concurrent requests.** Hypercorn 0.18 has no cap on open connections (its knobs are
  `backlog`, `keep_alive_timeout`, `h11_max_incomplete_size`; see api/cli.py). So the
  app counts the HTTP requests it is serving and answers the one over
  `--max-concurrent-requests` with a 503 + `Retry-After: 1` in the OpenAI envelope,
  before Quart parses anything. `/health` and `/metrics` are not counted: probes and
  scrapers must answer however busy the server is.
- **SSE orphan timeout.** A streaming client that stops reading without closing its
  connection fills the socket buffers; Hypercorn's `send` then waits on the transport to
  drain, forever. Every body send of a `text/event-stream` response is given
  `--sse-orphan-timeout-ms` (30 s); past it the send raises `TimeoutError`, which Quart
  takes as a response timeout: it closes the body generator, whose `finally` cancels the
  job, so its row and KV blocks return to the budget.
  The socket must go too. When the app returns mid-response Hypercorn ends the stream and
  closes the connection (`writer.close()`), but an asyncio transport closes only after its
  write buffer drains, which a client that reads nothing never lets happen: the socket,
  the connection's task and the app's task would stay until the client leaves. Hypercorn
  0.18 gives the app no handle on the transport, so the guard finds it behind the `send`
  callable (`abort_transport`: the bound methods' owners down to the TCP server's
  `writer`) and aborts it with SO_LINGER 0, which drops both buffers and resets the
  connection at once (a plain close would queue its FIN behind data nobody reads). If a Hypercorn version hides it elsewhere, the guard logs that it
  could not, and the old behaviour remains.

Refusals here are rendered in the envelope of the protocol their path belongs to (the
app's `error_renderer`), like every other error.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any, Awaitable, Callable

from api.errors import APIError
from api.protocol import dumps

Renderer = Callable[[str], Callable[[APIError], "tuple[int, dict]"]]

logger = logging.getLogger("ferrox.api")

UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})


class RequestGuards:
    """ASGI middleware; wrap the app's `asgi_app` (`app.asgi_app = RequestGuards(...)`)."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_concurrent_requests: int,
                 sse_orphan_timeout_s: float, max_header_bytes: int, renderer: Renderer | None = None) -> None:
        self.app = app
        self.renderer = renderer
        self.max_concurrent_requests = max_concurrent_requests
        self.max_header_bytes = max_header_bytes
        self.sse_orphan_timeout_s = sse_orphan_timeout_s
        self.num_open = 0  # event-loop only
        self.num_refused = 0
        self.num_orphaned = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = header_size(scope)
        if header_bytes > self.max_header_bytes:
            await self._refuse(scope, send, APIError(
                431, f"request line and headers are {header_bytes} bytes; the limit is "
                     f"{self.max_header_bytes} (--max-header-bytes)", code="headers_too_large"))
            return
        if scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, self._watch_streams(send, scope))
            return
        if self.num_open >= self.max_concurrent_requests:
            self.num_refused += 1
            await self._refuse(scope, send, APIError(
                503, f"too many concurrent requests (limit {self.max_concurrent_requests}); retry shortly",
                type="server_error", code="too_many_requests", headers={"Retry-After": "1"}))
            return
        self.num_open += 1
        try:
            await self.app(scope, receive, self._watch_streams(send, scope))
        finally:
            self.num_open -= 1

    def _watch_streams(self, send: Callable, scope: dict) -> Callable:
        is_stream = False
        timeout_s = self.sse_orphan_timeout_s

        async def guarded_send(message: dict) -> None:
            nonlocal is_stream
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
                is_stream = content_type.startswith(b"text/event-stream")
            elif is_stream and message["type"] == "http.response.body":
                try:  # asyncio.timeout, not wait_for, which on 3.11 can swallow a disconnect's cancel
                    async with asyncio.timeout(timeout_s):
                        await send(message)
                except TimeoutError:
                    self.num_orphaned += 1
                    logger.warning("stream on %s: the client read nothing for %.1f s; cancelling it and "
                                   "closing the connection (--sse-orphan-timeout-ms)", scope["path"], timeout_s)
                    if not abort_transport(send):
                        logger.warning("could not reach the connection's transport to close it; it stays "
                                       "open until the client leaves")
                    raise
                return
            await send(message)

        return guarded_send

    async def _refuse(self, scope: dict, send: Callable, error: APIError) -> None:
        if self.renderer is not None:
            status, body_obj = self.renderer(scope["path"])(error)
        else:
            status, body_obj = error.status, error.body()
        body = dumps(body_obj).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def header_size(scope: dict) -> int:
    """Bytes of the request line and headers as sent (name: value CRLF per header)."""
    line = len(scope["method"]) + len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


def abort_transport(send: Callable, max_depth: int = 6) -> bool:
    """Abort the TCP transport behind an ASGI `send`; True if one was found.

    Hypercorn's `send` is a bound method of the HTTP stream, whose own `send` is bound to
    the protocol, whose `send` is bound to the TCP server holding the `asyncio.StreamWriter`.
    Walk those owners (at most `max_depth`) until one has a writer with a transport.
    """
    owner = getattr(send, "__self__", None)
    for _ in range(max_depth):
        if owner is None:
            return False
        writer = getattr(owner, "writer", None)
        transport = getattr(writer, "transport", None)
        if transport is not None and hasattr(transport, "abort"):
            sock = transport.get_extra_info("socket")
            if sock is not None:  # linger 0: close() resets at once instead of queueing a FIN behind the data
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return True
        owner = getattr(getattr(owner, "send", None), "__self__", None)
    return False


def install(app: Any, max_concurrent_requests: int, sse_orphan_timeout_s: float,
            max_header_bytes: int, renderer: Renderer | None = None) -> RequestGuards:
    """Wrap `app.asgi_app` in the guards; returns them (tests read their counters)."""
    guards = RequestGuards(app.asgi_app, max_concurrent_requests, sse_orphan_timeout_s, max_header_bytes, renderer)
    app.asgi_app = guards
    return guards
