"""A reply's output as ordered blocks, thinking, text and tool calls, whole or streamed.

The protocol-neutral half of the protocols whose replies are lists of blocks: Anthropic
Messages (`content` blocks: thinking, text, tool_use) and OpenAI Responses (`output`
items: reasoning, message, function_call). It sits between the output parser
(`api/structured.py`: `OutputParser` turns a row's text into reasoning, content and
tool-call deltas) and the adapter, which renders each event in its wire format:

    RowEvent.text ──▶ OutputParser ──▶ {"reasoning_content"} / {"content"} / {"tool_calls": [...]} deltas
                                                  │
                                                  ▼
    per block:  BlockEvent start ── delta* ── stop        (index = the block's position)

A whole reply is the same fold with the events ignored, then `blocks` read, so a stream's
blocks accumulate to exactly the whole reply's. Rules:
  * blocks come in the order the output has them (the thinking section first, then
    text, then the calls after it, as a model writes them); a block stops when the next
    one starts or the output ends;
  * a thinking block (plans that split thinking sections: `plan.reasoning`) holds the
    parser's `reasoning_content`, the section without its tags; it opens at its first
    character, so a reply whose section is empty or absent has none;
  * a reply that can have no calls (no tool format in its plan) always has exactly one
    text block, possibly empty, as before tools: opened at once, or, when a thinking
    block may come first, at its first character or else empty at the end; with tools a
    text block opens at its first character, so a reply of calls has none;
  * a call block carries the parser's id (`call_…`) and name from its start; its deltas
    are pieces of the arguments' JSON text.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from api.structured import OutputPlan


@dataclasses.dataclass
class Block:
    """One block of a reply, as far as it has come."""

    kind: Literal["thinking", "text", "call"]
    text: str = ""  # thinking: the reasoning text; text: the text; call: the arguments' JSON text
    call_id: str = ""  # call: the parser's id, "call_…"
    name: str = ""  # call: the function's name
    is_open: bool = True

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object; {} when they are not one (a call cut off by the
        token limit, or an unforced call whose arguments are not an object)."""
        try:
            value = json.loads(self.text) if self.text.strip() else {}
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclasses.dataclass(frozen=True)
class BlockEvent:
    """A block starts (render it empty: text "", no arguments), grows by `delta`, or stops."""

    kind: Literal["start", "delta", "stop"]
    index: int  # the block's position in the reply
    block: Block
    delta: str = ""  # "delta": the reasoning, text or arguments piece


class OutputBlocks:
    """One row's output folded into `blocks` (see the module docstring)."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self._parser = plan.new_parser()  # None: the text is plain content
        self.blocks: list[Block] = [] if self._parser is not None else [Block("text")]
        # No calls can come, but a thinking block may come first: the text block opens late.
        self._has_late_text = self._parser is not None and plan.tool_format is None

    def start(self) -> list[BlockEvent]:
        """The events before any output: the start of a text block opened at once."""
        return [BlockEvent("start", i, b) for i, b in enumerate(self.blocks)]

    def feed(self, text: str) -> list[BlockEvent]:
        """A row's text delta in; the block events it makes."""
        if self._parser is None:
            return self._events([{"content": text}] if text else [])
        return self._events(self._parser.feed(text))

    def finish(self) -> list[BlockEvent]:
        """The row ended: what the parser held back, then the last block's stop."""
        events = self._events(self._parser.finish() if self._parser is not None else [])
        if self._has_late_text and not any(b.kind == "text" for b in self.blocks):
            events += self._stop() + self._open(Block("text"))
        return events + self._stop()

    @property
    def calls(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "call"]

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's finish reason, or "tool_calls" for a reply with calls that ended normally."""
        return self._parser.finish_reason(reason) if self._parser is not None else reason

    def _events(self, deltas: list[dict[str, Any]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._grow("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._grow("text", delta["content"])
            for call in delta.get("tool_calls", ()):
                if "id" in call:  # a call starts: the parser sends its id and name first
                    events += self._stop()
                    events += self._open(Block("call", call_id=call["id"], name=call["function"]["name"]))
                if call["function"].get("arguments"):
                    events += self._grow("call", call["function"]["arguments"])
        return events

    def _grow(self, kind: str, piece: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if not self.blocks or not self.blocks[-1].is_open or self.blocks[-1].kind != kind:
            assert kind != "call", "arguments only follow their call's start"
            events = self._stop() + self._open(Block(kind))
        block = self.blocks[-1]
        block.text += piece
        return events + [BlockEvent("delta", len(self.blocks) - 1, block, piece)]

    def _open(self, block: Block) -> list[BlockEvent]:
        self.blocks.append(block)
        return [BlockEvent("start", len(self.blocks) - 1, block)]

    def _stop(self) -> list[BlockEvent]:
        if not self.blocks or not self.blocks[-1].is_open:
            return []
        self.blocks[-1].is_open = False
        return [BlockEvent("stop", len(self.blocks) - 1, self.blocks[-1])]
