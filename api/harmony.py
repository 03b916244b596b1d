"""The harmony output format (gpt-oss): channels into reasoning, content and tool calls.

gpt-oss's chat template ends the prompt with `<|start|>assistant`; the model then writes
one or more messages, each a header, `<|message|>`, a body and a terminator:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 4.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient `to=functions.NAME` may also stand before `<|channel|>`). A body on the
`analysis` channel is reasoning (`reasoning_content`); one addressed to `functions.NAME`
is a tool call with the body as its arguments; any other (`final`, and `commentary`
without a recipient: a preamble the user may see) is content. The markers are special
tokens, so the text is decoded with special tokens kept (`api/structured.py`).

`HarmonyStreamParser` turns streamed text deltas into the OpenAI delta payloads
`api/structured.py:OutputParser` sends (`{"reasoning_content"}`, `{"content"}`, and the
`{"tool_calls"}` pair `api/tool_call_parser.py` defines); whole text is the parser fed
once, so both agree exactly, whatever the delta boundaries. A header is held until its
`<|message|>`; a body is emitted as it comes except a suffix that may still grow into a
terminator. Text that never reaches a `<|message|>` (no harmony at all) is content,
verbatim; a body cut off by max_tokens stays what its channel made it (a cut-off call is
closed with the arguments it got).
"""

from __future__ import annotations

import re
from typing import Any

from api.reasoning import held_prefix_len
from api.tool_call_parser import ToolCall, new_call_id

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
START = "<|start|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>", START)  # a new <|start|> also ends a body
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


def is_harmony_template(chat_template: str | None) -> bool:
    """Whether a chat template renders harmony (gpt-oss's): it writes channel markers."""
    return CHANNEL in (chat_template or "") and MESSAGE in (chat_template or "")


class HarmonyStreamParser:
    """Streamed harmony text -> OpenAI delta payloads (module docstring).

    `tools`: bodies addressed to `functions.NAME` become calls; without tools (the
    request had none) such a body is content, as the text it is."""

    def __init__(self, tools: bool = True) -> None:
        self._tools = tools
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._state = "header"  # header: before a message's <|message|>; body: inside one
        self._kind = "content"  # the body's: reasoning | content | call
        self._open_call: list[str] | None = None  # [id, name, arguments so far]
        self._saw_message = False  # any <|message|> yet (else the text is not harmony)
        self._out: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Add a text delta; returns the delta payloads now safe to send."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """The output ended: release what was held (a header never finished is content only
        when no message came before it: then the text was not harmony)."""
        self._run(final=True)
        if self._state == "header" and self._buf and not self._saw_message:
            self._emit("content", self._buf)
        elif self._state == "body" and self._buf:
            self._emit(self._kind, self._buf)
        self._buf = ""
        if self._open_call is not None:
            self._close_call()
        return self._take()

    def _take(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        while True:
            if self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    return  # the header is held whole until its <|message|>
                self._open_body(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE):]
                continue
            ends = [(i, m) for m in TERMINATORS if (i := self._buf.find(m)) >= 0]
            if not ends:
                keep = 0 if final else held_prefix_len(self._buf, TERMINATORS)
                self._emit(self._kind, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            at, marker = min(ends)
            self._emit(self._kind, self._buf[:at])
            # <|start|> opens the next header itself; the other terminators are dropped.
            self._buf = self._buf[at:] if marker == START else self._buf[at + len(marker):]
            if self._open_call is not None:
                self._close_call()
            self._state = "header"

    def _open_body(self, header: str) -> None:
        self._saw_message, self._state = True, "body"
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self._tools:
            self._kind = "call"
            self._open_call = [new_call_id(), recipient.group(1), ""]
            self._out.append({"tool_calls": [{"index": len(self.calls), "id": self._open_call[0], "type": "function",
                                              "function": {"name": self._open_call[1], "arguments": ""}}]})
        else:
            self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        if kind == "call":
            self._open_call[2] += text
            self._out.append({"tool_calls": [{"index": len(self.calls), "function": {"arguments": text}}]})
        else:
            self._out.append({"reasoning_content" if kind == "reasoning" else "content": text})

    def _close_call(self) -> None:
        call_id, name, arguments = self._open_call
        self.calls.append(ToolCall(call_id, name, arguments.strip() or "{}"))
        self._open_call = None
