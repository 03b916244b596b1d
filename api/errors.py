"""`APIError`: a refusal with its HTTP status, in any protocol; and OpenAI's error envelope.

Handlers and the generation core raise `APIError(status, message, type=, param=, code=)`;
`api/app.py` renders it in the envelope of the protocol the route speaks (OpenAI's
`{"error": {"message", "type", "param", "code"}}` unless an adapter registers its own).
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A refusal with its HTTP status; `body()` is the OpenAI envelope (the default one)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def unavailable(message: str, code: str = "unavailable") -> APIError:
    """503 for shedding (queue full, loading, draining, dead loop): the client retries in 1 s."""
    return APIError(503, message, type="server_error", code=code, headers={"Retry-After": "1"})
