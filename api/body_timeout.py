"""A request body must keep arriving, or its request ends with a 408 and frees its slot.

Without this, a client that declares a 4 MiB body and sends a byte every two seconds
holds one of `--max-concurrent-requests` slots for as long as it likes: twenty such
connections lock every other client out (503) and can reconnect to keep it that way.

`BodyReadTimeout` wraps the app's `receive`. While the body is incomplete, each message
must arrive by `start + timeout_s + received_bytes / min_rate`: a body gets
`--body-read-timeout` seconds (10) plus one second per `min_rate` bytes received
(64 KiB/s), so a slow but honest upload of the whole 4 MiB limit at 64 KiB/s passes and
a trickle does not. Past the deadline the app is told the client left (an
`http.disconnect`, on which Quart ends the handler) and, once it has returned, the
client gets a 408 in its protocol's envelope with `Connection: close`. A body that is
complete is never timed (the app keeps waiting for the real disconnect after it).

It is the outermost middleware: the 408 goes out after the concurrency guard
(`api/guards.py`) has already released the slot, and the disconnect it hands down marks
the body complete for `api/unread_body.py`, which then does not wait to drain it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from api.errors import APIError
from api.protocol import dumps

logger = logging.getLogger("ferrox.api")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MIN_RATE = 64 << 10  # bytes per second once the first timeout_s is spent

Renderer = Callable[[str], Callable[[APIError], "tuple[int, dict]"]]


class BodyReadTimeout:
    """ASGI middleware (see the module docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]], timeout_s: float = DEFAULT_TIMEOUT_S,
                 min_rate: int = DEFAULT_MIN_RATE, renderer: Renderer | None = None) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.renderer = renderer
        self.num_timed_out = 0  # requests answered 408 (tests and /metrics read it)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _TimedBody(self, receive, send)
        await self.app(scope, body.receive, body.send_watched)
        if body.timed_out and not body.response_started:
            self.num_timed_out += 1
            logger.warning("%s %s: the body did not arrive in time (%d bytes in %.1f s); answered 408",
                           scope["method"], scope["path"], body.received, time.monotonic() - body.start)
            await self._answer_408(scope, send)

    async def _answer_408(self, scope: dict, send: Callable) -> None:
        error = APIError(408, f"the request body did not arrive in time (--body-read-timeout "
                              f"{self.timeout_s:g} s, then at least {self.min_rate} bytes/s)",
                         code="request_timeout")
        status, body_obj = self.renderer(scope["path"])(error) if self.renderer else (error.status, error.body())
        data = dumps(body_obj).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                   (b"connection", b"close")]
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data, "more_body": False})
        except Exception:  # noqa: BLE001 - the client may be gone by now; nothing to tell it
            pass


class _TimedBody:
    def __init__(self, middleware: BodyReadTimeout, receive: Callable[[], Awaitable[dict]],
                 send: Callable[[dict], Awaitable[None]]) -> None:
        self.middleware = middleware
        self._receive = receive
        self.send = send  # the server's: api/guards.py:abort_transport walks `send` owners to the transport
        self.start = time.monotonic()
        self.received = 0
        self.complete = False
        self.timed_out = False
        self.response_started = False

    async def receive(self) -> dict[str, Any]:
        if self.complete:
            return await self._receive()
        if self.timed_out:
            return {"type": "http.disconnect"}
        m = self.middleware
        left = self.start + m.timeout_s + self.received / m.min_rate - time.monotonic()
        try:
            async with asyncio.timeout(max(left, 0.0)):
                message = await self._receive()
        except TimeoutError:
            self.timed_out = True
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.complete = not message.get("more_body", False)
        else:
            self.complete = True
        return message

    async def send_watched(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
        await self.send(message)
