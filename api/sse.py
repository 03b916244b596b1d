"""Server-sent events framing for the streaming routes.

Each event is one `data: {json}\\n\\n` line; a stream ends with `data: [DONE]\\n\\n`.
Idle streams get a comment line (`: keep-alive`) every `ServerConfig.sse_keepalive_s`
(15 s) so proxies and clients do not time out while a request waits in the queue.
A mid-stream failure is one `data: {"error": {...}}` event, then the stream closes.

Quart applies `RESPONSE_TIMEOUT` to sending a response body; a stream may rightly
last longer, so `sse_response` turns the timeout off on that response only.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from quart import Response

from api.protocol import dumps

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE_COMMENT = b": keep-alive\n\n"


def event(obj: Any) -> bytes:
    """One SSE data event carrying `obj` as compact JSON."""
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


def named_event(kind: str, obj: Any) -> bytes:
    """One named SSE event: `event: <kind>`, then `obj` as compact JSON."""
    return b"event: " + kind.encode("utf-8") + b"\ndata: " + dumps(obj).encode("utf-8") + b"\n\n"


def sse_response(body: AsyncIterator[bytes], request_id: str) -> Response:
    """A text/event-stream response over `body`, with no response timeout."""
    response = Response(body, status=200, content_type="text/event-stream; charset=utf-8")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # nginx: do not buffer the stream
    response.headers["X-Request-Id"] = request_id
    response.timeout = None
    return response
