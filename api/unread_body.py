"""Keep a keep-alive connection usable after a response sent before its request's body was read.

Some answers come before the body has arrived: an unknown route (404), a missing key
(401), the rate limit (429), a body over the limit (413), the guards' refusals (431,
503). Hypercorn closes the connection when a response ends while the request's body is
still unread, but the response does not say so (no `Connection: close`). A client that
pools connections (httpx, under the OpenAI and Anthropic SDKs) then sends its next
request on a socket the server is closing and gets "Server disconnected without sending
a response"; or the close, with the body's bytes unread in the kernel, resets the
connection and the client loses even the error.

So when a response starts, this middleware looks at the request's body:

- all received (every route reads its body before answering): nothing to do;
- a declared `Content-Length` up to `max_drain_bytes` (the server's body limit): the rest
  is read and dropped first, for at most `drain_timeout_s`, and the connection stays
  reusable;
- otherwise (larger, chunked, or a client too slow to send it): the response carries
  `Connection: close`, so the client opens a new connection for its next request. A
  declared length over the limit always does, even when the body was already in.

It wraps the whole ASGI app (outside `api/guards.py`, whose refusals it covers too) and
touches nothing else: a response to a request whose body was read passes through as is.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

DRAIN_TIMEOUT_S = 2.0  # how long an early answer waits for the rest of a small body


class DrainUnreadBody:
    """ASGI middleware (see the module docstring); `app.asgi_app = DrainUnreadBody(app.asgi_app, ...)`."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_drain_bytes: int,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.app = app
        self.max_drain_bytes = max_drain_bytes
        self.drain_timeout_s = drain_timeout_s
        self.num_drained = 0  # early answers whose body was read first (tests read these)
        self.num_closed = 0  # early answers sent with Connection: close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _RequestBody(self, scope, receive, send)
        await self.app(scope, body.receive, body.send_after_body)


class _RequestBody:
    """Watches one request's `receive` for the end of its body, and holds its response's
    start until the body is in (or marks it `Connection: close`).

    `send_after_body` is a bound method whose owner keeps the server's `send` as `send`:
    `api/guards.py:abort_transport` walks such owners down to the connection's transport."""

    def __init__(self, middleware: DrainUnreadBody, scope: dict, receive: Callable[[], Awaitable[dict]],
                 send: Callable[[dict], Awaitable[None]]) -> None:
        self.middleware = middleware
        self._receive = receive
        self.send = send
        headers = dict(scope.get("headers") or ())
        self.declared_bytes = _declared_bytes(headers)  # None: chunked (or a length h11 refuses anyway)
        self.is_complete = self.declared_bytes == 0
        self._completed = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        message = await self._receive()
        if (message["type"] == "http.request" and not message.get("more_body", False)) \
                or message["type"] == "http.disconnect":  # all of it, or nothing more will come
            self.is_complete = True
            self._completed.set()
        return message

    async def send_after_body(self, message: dict) -> None:
        middleware = self.middleware
        over_limit = self.declared_bytes is not None and self.declared_bytes > middleware.max_drain_bytes
        if message["type"] == "http.response.start" and (over_limit or not self.is_complete):
            # Over the limit, the answer says close even when the body happened to arrive
            # whole before it (a fast client on loopback): it never depends on timing.
            if not over_limit and await self.drain(middleware.max_drain_bytes, middleware.drain_timeout_s):
                middleware.num_drained += 1
            else:
                middleware.num_closed += 1
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await self.send(message)

    async def drain(self, max_bytes: int, timeout_s: float) -> bool:
        """Read and drop the rest of the body; True once all of it is in.

        The app may be reading too (Quart's receiver task does until the handler returns):
        whichever of the two takes the last message, the body is complete."""
        if self.declared_bytes is None or self.declared_bytes > max_bytes:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                while not self.is_complete:
                    reader = asyncio.ensure_future(self.receive())
                    completed = asyncio.ensure_future(self._completed.wait())
                    try:
                        await asyncio.wait((reader, completed), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        reader.cancel()
                        completed.cancel()
        except TimeoutError:
            return False
        return True


def _declared_bytes(headers: dict[bytes, bytes]) -> int | None:
    """The body's size as the headers declare it: 0 without one, None when chunked."""
    if b"transfer-encoding" in headers:
        return None
    try:
        return int(headers.get(b"content-length", b"0"))
    except ValueError:
        return None
