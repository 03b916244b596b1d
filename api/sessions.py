"""Server-side chat history: a chat request's `session_id`.

A chat completion that names a `session_id` is answered as if its `messages` followed the
session's earlier turns: the stored turns are prepended, and when the reply finishes
normally (not cancelled, not failed) the request's own messages and the assistant's reply
(its first choice's text, as generated) are appended as one *exchange*. A client then
sends only its new user message each turn.

What is kept of a turn is what the chat template can use, and nothing else: `role`,
`content` (text), `name`, `tool_call_id`, and `tool_calls` as `{"id", "type", "function":
{"name", "arguments"}}` (arguments as JSON text, as the template's history path reads
them). Unknown fields of a call are dropped; identifiers (`name`, `tool_call_id`, a
call's `id` and function name) longer than `MAX_IDENTIFIER_CHARS` are a 400 naming the
field, so a field no template renders cannot smuggle megabytes into the history
(`kept_turns` checks them when the request arrives, before anything is generated).

Bounds, each counted in the bytes the kept turns really take in this process (the
strings' own sizes, `sys.getsizeof`, plus the containers around them):
  * a session holds at most `max_session_bytes`: appending an exchange drops the session's
    oldest exchanges until it fits (whole exchanges, so a history never starts with a
    reply or a tool result). A request whose own messages are over the cap is a 400 when
    it arrives; an exchange that its reply takes over the cap by itself ends the session
    (the next turn under the id starts a new one);
  * all sessions together hold at most `max_total_bytes`: the least recently used ones go;
  * at most `max_sessions` sessions (the least recently used one makes room), none older
    than `ttl_s` since its last turn (swept before every lookup).
A history is also bounded by the context itself: one that no longer fits is the usual 400.

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
import json
import sys
import time
from typing import Any, Mapping, Sequence

from api.errors import APIError

MAX_SESSION_ID_CHARS = 256
MAX_IDENTIFIER_CHARS = 256  # a turn's name and tool_call_id, a call's id and function name
# What a session costs besides its turns: its record, its key (a 64-character hash and
# the id) and its slot in the store's ordered dict. An estimate on the high side.
_SESSION_OVERHEAD_BYTES = 512
_TEXT_FIELDS = ("content", "name", "tool_call_id")


@dataclasses.dataclass
class _Session:
    exchanges: collections.deque[tuple[list[dict[str, Any]], int]]  # (turns, their bytes), oldest first
    num_bytes: int  # the exchanges' bytes plus the session's own overhead
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


def _identifier(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{param} must be a string", param=param, code="invalid_value")
    if len(value) > MAX_IDENTIFIER_CHARS:
        raise APIError(400, f"{param} is {len(value):,} characters; a chat session keeps names and ids of at "
                            f"most {MAX_IDENTIFIER_CHARS} characters (send a shorter one, or the request "
                            "without session_id)", param=param, code="invalid_value")
    return value


def _kept_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise APIError(400, f'{param} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                       param=param, code="invalid_value")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):  # the template's history path parses JSON text back
        arguments = json.dumps(arguments, ensure_ascii=False)
    kept = {"type": "function",
            "function": {"name": _identifier(function.get("name"), f"{param}.function.name"),
                         "arguments": arguments}}
    if call.get("id") is not None:
        kept["id"] = _identifier(call["id"], f"{param}.id")
    return kept


def kept_turn(message: Mapping[str, Any], param: str = "messages[0]") -> dict[str, Any]:
    """The part of one template message (`ChatMessage.template_dict()`) a session keeps
    (the module docstring); a 400 naming the field for an overlong identifier."""
    turn: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            turn[key] = _identifier(message[key], f"{param}.{key}")
    calls = message.get("tool_calls")
    if calls:
        turn["tool_calls"] = [_kept_call(call, f"{param}.tool_calls[{i}]") for i, call in enumerate(calls)]
    return turn


def turn_bytes(turn: Mapping[str, Any]) -> int:
    """What a kept turn takes in memory: its dict, its strings (`sys.getsizeof`: a string
    with one character outside Latin-1 takes 2 or 4 bytes for each of its characters) and
    its calls. The keys are the literals above, shared by every turn."""
    size = sys.getsizeof(turn) + sys.getsizeof(turn["role"])
    size += sum(sys.getsizeof(turn[key]) for key in _TEXT_FIELDS if key in turn)
    calls = turn.get("tool_calls")
    if calls:
        size += sys.getsizeof(calls)
        for call in calls:
            function = call["function"]
            size += sys.getsizeof(call) + sys.getsizeof(function) + sys.getsizeof(call["type"])
            size += sys.getsizeof(function["name"]) + sys.getsizeof(function["arguments"])
            size += sys.getsizeof(call["id"]) if "id" in call else 0
    return size


class SessionStore:
    """The sessions of one app: bounded in number, age and bytes (see the module docstring)."""

    def __init__(self, max_sessions: int, ttl_s: float, max_session_bytes: int = 1 << 20,
                 max_total_bytes: int = 64 << 20) -> None:
        if max_session_bytes > max_total_bytes:
            raise ValueError(f"max_session_bytes ({max_session_bytes}) must not exceed max_total_bytes "
                             f"({max_total_bytes})")
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self.max_session_bytes, self.max_total_bytes = max_session_bytes, max_total_bytes
        self._sessions: collections.OrderedDict[tuple[str, str], _Session] = collections.OrderedDict()
        self.num_bytes = 0  # every session's bytes, as counted

    def __len__(self) -> int:
        return len(self._sessions)

    def _sweep(self, now: float) -> None:
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if now - oldest.last_used_s < self.ttl_s:
                break
            self._forget(key)

    def _forget(self, key: tuple[str, str]) -> None:
        self.num_bytes -= self._sessions.pop(key).num_bytes

    def kept_turns(self, messages: Sequence[Mapping[str, Any]], param: str = "messages") -> list[dict[str, Any]]:
        """A session request's messages as the session will keep them. A 400 naming the
        field for an overlong identifier, and naming `param` when the messages alone take
        more than one session may hold (checked when the request arrives, so nothing is
        generated for an exchange that could not be kept)."""
        turns = [kept_turn(m, f"{param}[{i}]") for i, m in enumerate(messages)]
        size = sum(turn_bytes(t) for t in turns) + _SESSION_OVERHEAD_BYTES
        if size > self.max_session_bytes:
            raise APIError(400, f"{param} take {size:,} bytes; a chat session holds at most {self.max_session_bytes:,} "
                                "(--session-max-bytes): send shorter messages, or the request without session_id",
                           param=param, code="session_too_large")
        return turns

    def history(self, namespace: str, session_id: str, now: float | None = None) -> list[dict[str, Any]]:
        """The session's turns so far, oldest first (copies; empty for a new or expired session)."""
        now = time.monotonic() if now is None else now
        self._sweep(now)
        session = self._sessions.get((namespace, session_id))
        if session is None:
            return []
        return [dict(turn) for turns, _ in session.exchanges for turn in turns]

    def append(self, namespace: str, session_id: str, turns: Sequence[Mapping[str, Any]],
               now: float | None = None) -> None:
        """Adds a finished exchange (kept as `kept_turn` keeps it); the session becomes the
        most recently used. Older exchanges, then other sessions, make room (module docstring)."""
        now = time.monotonic() if now is None else now
        self._sweep(now)
        key = (namespace, session_id)
        session = self._sessions.pop(key, None)
        if session is None:
            session = _Session(collections.deque(), _SESSION_OVERHEAD_BYTES, now)
        else:
            self.num_bytes -= session.num_bytes
        kept = [kept_turn(t, f"turns[{i}]") for i, t in enumerate(turns)]
        size = sum(turn_bytes(t) for t in kept)
        session.exchanges.append((kept, size))
        session.num_bytes += size
        while session.exchanges and session.num_bytes > self.max_session_bytes:
            session.num_bytes -= session.exchanges.popleft()[1]
        session.last_used_s = now
        if session.exchanges:  # an exchange over the cap by itself ends the session
            self._sessions[key] = session
            self.num_bytes += session.num_bytes
        while len(self._sessions) > self.max_sessions or self.num_bytes > self.max_total_bytes:
            self._forget(next(iter(self._sessions)))

    def clear(self) -> None:
        self._sessions.clear()
        self.num_bytes = 0
