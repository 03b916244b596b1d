"""Server-side chat history: a chat request's `session_id`.

A chat completion that names a `session_id` is answered as if its `messages` followed the
session's earlier turns: the stored turns are prepended, and when the reply finishes
normally (not cancelled, not failed) the request's own messages and the assistant's reply
(its first choice's text, as generated) are appended. A client then sends only its new
user message each turn.

Bounds: at most `max_sessions` sessions (the least recently used one makes room) and none
older than `ttl_s` since its last turn (swept before every lookup); a session's history is
bounded by the context itself (a history that no longer fits is the usual 400).

Privacy: a session belongs to the credential that created it. Sessions are keyed by
(a SHA-256 of the API key the request presented, the session id), so a request with
another key, or none, never reads or extends it; it starts a session of its own under the
same id. With one server-wide key every holder of that key shares the namespace, as they
share everything else; without a key, a client's bearer token, if it sends one, still
separates its sessions from other clients'. Sessions live in memory only: a restart or a
model swap forgets them (a swap: the turns were rendered for another model's template).

Event-loop only, like the rest of `AppState`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from typing import Any, Mapping

from api.errors import APIError

MAX_SESSION_ID_CHARS = 256


@dataclasses.dataclass
class _Session:
    turns: list[dict[str, Any]]
    last_used_s: float


def credential_namespace(headers: Mapping[str, str]) -> str:
    """The hash sessions are filed under: the bearer token or `x-api-key` the request presented."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    given = given or headers.get("x-api-key", "").strip()
    return hashlib.sha256(given.encode("utf-8")).hexdigest()


def check_session_id(session_id: Any) -> str | None:
    """The id, or a 400 naming `session_id` for an empty or overlong one."""
    if session_id is None:
        return None
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise APIError(400, f"session_id must be a string of 1 to {MAX_SESSION_ID_CHARS} characters",
                       param="session_id", code="invalid_value")
    return session_id


class SessionStore:
    """The sessions of one app: bounded in number and age (see the module docstring)."""

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self._sessions: collections.OrderedDict[tuple[str, str], _Session] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def _sweep(self, now: float) -> None:
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if now - oldest.last_used_s < self.ttl_s:
                break
            del self._sessions[key]

    def history(self, namespace: str, session_id: str, now: float | None = None) -> list[dict[str, Any]]:
        """The session's turns so far (a copy; empty for a new or expired session)."""
        now = time.monotonic() if now is None else now
        self._sweep(now)
        session = self._sessions.get((namespace, session_id))
        return [dict(turn) for turn in session.turns] if session is not None else []

    def append(self, namespace: str, session_id: str, turns: list[dict[str, Any]],
               now: float | None = None) -> None:
        """Adds a finished exchange; the session becomes the most recently used."""
        now = time.monotonic() if now is None else now
        self._sweep(now)
        key = (namespace, session_id)
        session = self._sessions.pop(key, None) or _Session([], now)
        session.turns.extend(dict(turn) for turn in turns)
        session.last_used_s = now
        self._sessions[key] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def clear(self) -> None:
        self._sessions.clear()
