"""Tool calls in model output: find them in a whole text or a stream, in the format the
chat template teaches.

Where it sits: `api/structured.py:OutputParser` feeds each choice's text (decoded with
special tokens kept: `[TOOL_CALLS]` and `<|python_tag|>` are special tokens) to
`parse_tool_calls` or, streamed, a `ToolCallStreamParser`, whose deltas are OpenAI
`choices[].delta` payloads. A response with calls finishes with "tool_calls". Tool
definitions, the tools prompt and the forced-call grammar are `api/tool_calls.py`.

Formats (`detect_tool_call_format` picks one from the chat template's source):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen; repeated)
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}        (Llama 3.x; `;` between calls)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    json         {"name": ..., "arguments": {...}}  or a list of them     (the fallback, and forced calls)

In every format "arguments" and "parameters" are synonyms, and arguments given as a JSON
string are unwrapped. A bare JSON start (json, llama3_json) counts only at the start of
the output and only for an object with both a name and arguments; anything else is text.
Content is the text outside calls verbatim, except whitespace touching a call, which is
dropped. The whole-text parser is the streaming parser fed once, so both agree exactly.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from api.reasoning import held_prefix_len

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral", "json")
_START_MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",), "json": ()}
_END_MARKERS = {"hermes": "</tool_call>"}
_BARE_JSON_STARTS = {"llama3_json": "{", "json": "{["}  # first character of the output
_SEPARATORS = {"llama3_json": ";", "json": ";"}  # between top-level call objects
_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The `message.tool_calls[]` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def detect_tool_call_format(chat_template: str | None) -> str:
    """The call format a chat template teaches its model, from the template's source."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template:
        return "llama3_json"
    return "json"


def _unwrap_json_string(raw: str) -> str:
    """Arguments sent as a JSON string ("{\\"a\\": 1}") -> the string's text; others unchanged."""
    if not raw.startswith('"'):
        return raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, str) else raw


def parse_tool_calls(text: str, tool_format: str) -> tuple[str, list[ToolCall]]:
    """Split a whole output into (content outside calls, calls) in `tool_format`."""
    parser = ToolCallStreamParser(tool_format)
    deltas = parser.feed(text) + parser.finish()
    return "".join(d.get("content", "") for d in deltas), parser.calls


class _CallScanner:
    """Scans one call object `{"name": ..., "arguments": ...}` a character at a time,
    keeping each top-level key's raw value text and streaming a non-string arguments
    value out as it arrives."""

    def __init__(self) -> None:
        self.phase = "open"  # open key_or_close key colon value string nested scalar after done error
        self.depth = 0
        self.in_string = self.escape = False
        self.key_raw, self.key, self.value_raw = "", "", ""
        self.values: dict[str, str] = {}  # key -> raw JSON text of its value
        self.streamed_args = ""  # raw argument characters not yet taken by the parser
        self.is_streaming_args = False

    def feed(self, c: str) -> None:
        if self.in_string:
            self._append(c)
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.phase == "key":
                    try:
                        self.key, self.phase = json.loads(self.key_raw), "colon"
                    except json.JSONDecodeError:
                        self.phase = "error"
                elif self.phase == "string":
                    self._end_value()
            return
        if self.phase == "nested":
            self._append(c)
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._end_value()
            return
        if self.phase == "scalar" and (c in _WHITESPACE or c in ",}"):
            self._end_value()
        if c in _WHITESPACE:
            return
        phase = self.phase
        if phase == "open" and c == "{":
            self.depth, self.phase = 1, "key_or_close"
        elif phase in ("key_or_close", "key") and c == '"':
            self.key_raw, self.phase, self.in_string = '"', "key", True
        elif phase in ("key_or_close", "after") and c == "}":
            self.depth, self.phase = 0, "done"
        elif phase == "colon" and c == ":":
            self.phase = "value"
        elif phase == "value":
            self.value_raw = ""
            self.is_streaming_args = self.key in _ARGUMENT_KEYS and c != '"'
            self._append(c)
            self.phase = "string" if c == '"' else "nested" if c in "{[" else "scalar"
            self.in_string = c == '"'
            self.depth += c in "{["
        elif phase == "scalar":
            self._append(c)
        elif phase == "after" and c == ",":
            self.phase = "key"
        else:
            self.phase = "error"

    def _append(self, c: str) -> None:
        if self.phase == "key":
            self.key_raw += c
            return
        self.value_raw += c
        if self.is_streaming_args:
            self.streamed_args += c

    def _end_value(self) -> None:
        self.values.setdefault(self.key, self.value_raw)
        self.phase, self.is_streaming_args = "after", False

    @property
    def name(self) -> str | None:
        try:
            name = json.loads(self.values["name"]) if "name" in self.values else None
        except json.JSONDecodeError:
            return None
        return name if isinstance(name, str) else None

    @property
    def has_arguments(self) -> bool:
        return self.key in _ARGUMENT_KEYS and self.phase not in ("key", "colon") or \
            any(k in self.values for k in _ARGUMENT_KEYS)


class ToolCallStreamParser:
    """Turns streamed text deltas into OpenAI delta payloads: {"content": text} while the
    text is not a call; for each call {"tool_calls": [{"index", "id", "type":
    "function", "function": {"name", "arguments": ""}}]} first, then {"tool_calls":
    [{"index", "function": {"arguments": piece}}]}. Text that may still turn out to be a
    call marker (or whitespace touching a call) is held back until it is decided."""

    def __init__(self, tool_format: str) -> None:
        if tool_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_CALL_FORMATS}; got {tool_format!r}")
        self.format = tool_format
        self._markers = _START_MARKERS[tool_format]
        self._end_marker = _END_MARKERS.get(tool_format)
        self._bare_starts = _BARE_JSON_STARTS.get(tool_format, "")
        self.calls: list[ToolCall] = []
        self._buf = ""  # received, not yet processed
        self._mode = "content"  # content | region
        self._has_seen_text = False  # bare JSON counts only as the output's first text
        self._after_call = False  # drop whitespace right after a call
        self._out: list[dict[str, Any]] = []
        self._region_raw = ""  # a region's text so far, released as content if it is no call
        self._region_is_explicit = self._region_in_list = self._region_has_calls = False
        self._rphase = "start"
        self._scanner: _CallScanner | None = None
        self._open_call: list[str] | None = None  # [id, name, arguments so far]

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Add a text delta; returns the delta payloads now safe to send."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The output ended: release held text (a cut-off call stays as far as it got)."""
        out = self._run(final=True)
        if self._mode == "region":
            if self._open_call is not None:
                self._close_call()
            elif not self._region_has_calls:
                self._emit_content(self._region_raw)
            self._mode = "content"
        return out + self._take_out()

    @property
    def has_calls(self) -> bool:
        return bool(self.calls) or self._open_call is not None

    def _run(self, final: bool) -> list[dict[str, Any]]:
        while self._buf and (self._step_content(final) if self._mode == "content" else self._step_region()):
            pass
        return self._take_out()

    def _take_out(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _step_content(self, final: bool) -> bool:
        """Emit safe content; returns True when a call region was entered."""
        buf = self._buf
        if self._after_call:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._after_call = False
        if self._bare_starts and not self._has_seen_text:
            stripped = buf.lstrip()
            if not stripped and not final:
                self._buf = buf
                return False
            self._has_seen_text = bool(stripped)
            if stripped and stripped[0] in self._bare_starts:
                self._enter_region(raw=buf[:len(buf) - len(stripped)], is_explicit=False)
                self._buf = stripped
                return True
        found = [(i, m) for m in self._markers if (i := buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            before = buf[:i].rstrip()
            self._emit_content(before)
            self._enter_region(raw=buf[len(before):i + len(marker)], is_explicit=True)
            self._buf = buf[i + len(marker):]
            return True
        if final:
            safe = buf
        else:  # hold a possible marker start, and trailing whitespace a call would drop
            safe = buf[:len(buf) - held_prefix_len(buf, self._markers)].rstrip()
        self._emit_content(safe)
        self._buf = buf[len(safe):]
        return False

    def _enter_region(self, raw: str, is_explicit: bool) -> None:
        self._mode, self._rphase, self._region_raw = "region", "start", raw
        self._region_is_explicit = is_explicit  # began at a marker (else bare JSON)
        self._region_in_list = self._region_has_calls = False

    def _exit_region(self) -> None:
        self._mode, self._after_call = "content", self._region_has_calls

    def _step_region(self) -> bool:
        """Consume region text; returns True if it switched back to content mode."""
        buf, i = self._buf, 0
        while i < len(buf) and self._mode == "region":
            if self._rphase == "end_marker":
                end = buf.find(self._end_marker, i)
                if end >= 0:  # anything between the calls and the end marker is dropped
                    i = end + len(self._end_marker)
                    self._exit_region()
                else:
                    i = len(buf) - held_prefix_len(buf[i:], (self._end_marker,))
                break
            c = buf[i]
            i += 1
            self._region_raw += c
            if self._rphase == "object":
                self._scanner.feed(c)
                self._after_scanner_step()
            elif c in _WHITESPACE:
                continue
            elif c == "{" and self._rphase in ("start", "list_start", "list_next"):
                self._scanner, self._rphase = _CallScanner(), "object"
                self._scanner.feed(c)
            elif c == "[" and self._rphase == "start":
                self._rphase, self._region_in_list = "list_start", True
            elif c == "]" and self._rphase in ("list_start", "list_after"):
                self._end_values()
            elif c == "," and self._rphase == "list_after":
                self._rphase = "list_next"
            elif c == _SEPARATORS.get(self.format) and self._rphase == "after":
                self._rphase = "start"
            elif self._rphase == "after":  # the calls are over; c is content again
                i -= 1
                self._region_raw = self._region_raw[:-1]
                self._end_values()
            else:
                self._invalid()
        self._buf = buf[i:]
        return self._mode == "content"

    def _after_scanner_step(self) -> None:
        scanner = self._scanner
        if scanner.phase == "error":
            self._invalid()
            return
        if self._open_call is None and scanner.name is not None and (
                scanner.has_arguments or (scanner.phase == "done" and self._region_is_explicit)):
            call_id = new_call_id()
            self._open_call = [call_id, scanner.name, ""]
            self._out.append({"tool_calls": [{"index": len(self.calls), "id": call_id, "type": "function",
                                              "function": {"name": scanner.name, "arguments": ""}}]})
        if self._open_call is not None and scanner.streamed_args:
            self._emit_arguments(scanner.streamed_args)
            scanner.streamed_args = ""
        if scanner.phase != "done":
            return
        if self._open_call is None:
            self._invalid()  # an object that is not a call
            return
        if not self._open_call[2]:  # no arguments streamed: a string value, or none at all
            raw = next((scanner.values[k] for k in _ARGUMENT_KEYS if k in scanner.values), "{}")
            self._emit_arguments(_unwrap_json_string(raw))
        self._close_call()
        self._rphase = "list_after" if self._region_in_list else "after"

    def _emit_arguments(self, piece: str) -> None:
        if not piece:
            return
        self._open_call[2] += piece
        index = len(self.calls)
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += piece
        else:
            self._out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})

    def _close_call(self) -> None:
        call_id, name, arguments = self._open_call
        self.calls.append(ToolCall(call_id, name, arguments))
        self._open_call, self._region_has_calls = None, True

    def _end_values(self) -> None:
        if self._end_marker and self._region_has_calls:
            self._rphase = "end_marker"
        else:
            self._exit_region()

    def _invalid(self) -> None:
        """The region's text is not (or no longer) calls."""
        if self._open_call is not None:
            self._close_call()  # keep what was already streamed
        if self._region_has_calls:
            self._end_values()
        else:  # nothing was a call: the region's text was content after all
            self._emit_content(self._region_raw)
            self._mode = "content"
