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
  job, so its row and KV blocks return to the budget. (Hypercorn keeps the socket itself
  until the client goes away; 0.18 gives the app no way to abort a transport.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from api.errors import error_body
from api.protocol import dumps

logger = logging.getLogger("ferrox.api")

UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})


class RequestGuards:
    """ASGI middleware; wrap the app's `asgi_app` (`app.asgi_app = RequestGuards(...)`)."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_concurrent_requests: int,
                 sse_orphan_timeout_s: float, max_header_bytes: int) -> None:
        self.app = app
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
            await _refuse(send, 431, f"request line and headers are {header_bytes} bytes; the limit is "
                                     f"{self.max_header_bytes} (--max-header-bytes)",
                          "invalid_request_error", "headers_too_large")
            return
        if scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, self._watch_streams(send, scope))
            return
        if self.num_open >= self.max_concurrent_requests:
            self.num_refused += 1
            await _refuse(send, 503, f"too many concurrent requests (limit {self.max_concurrent_requests}); "
                                     "retry shortly", "server_error", "too_many_requests", retry_after=True)
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
                    logger.warning("stream on %s: the client read nothing for %.1f s; cancelling it "
                                   "(--sse-orphan-timeout-ms)", scope["path"], timeout_s)
                    raise
                return
            await send(message)

        return guarded_send


def header_size(scope: dict) -> int:
    """Bytes of the request line and headers as sent (name: value CRLF per header)."""
    line = len(scope["method"]) + len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


async def _refuse(send: Callable, status: int, message: str, type: str, code: str, retry_after: bool = False) -> None:
    body = dumps(error_body(message, type, None, code)).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def install(app: Any, max_concurrent_requests: int, sse_orphan_timeout_s: float,
            max_header_bytes: int) -> RequestGuards:
    """Wrap `app.asgi_app` in the guards; returns them (tests read their counters)."""
    guards = RequestGuards(app.asgi_app, max_concurrent_requests, sse_orphan_timeout_s, max_header_bytes)
    app.asgi_app = guards
    return guards
