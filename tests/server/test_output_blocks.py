"""`api/output_blocks.py`: parsed output as ordered blocks, whole or streamed. Plain Python:
the real parser over hand-written model text, no engine."""

from __future__ import annotations

import dataclasses

import pytest

from api.output_blocks import OutputBlocks
from api.structured import OutputPlan

CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
TOOLS_PLAN = OutputPlan(tool_format="json")


def fold(plan: OutputPlan, pieces: list[str]) -> tuple[OutputBlocks, list]:
    blocks = OutputBlocks(plan)
    events = blocks.start()
    for piece in pieces:
        events += blocks.feed(piece)
    return blocks, events + blocks.finish()


def summary(blocks: OutputBlocks) -> list[tuple]:
    return [(b.kind, b.text, b.name, b.is_open) for b in blocks.blocks]


@pytest.mark.parametrize("text", [CALL, f"[{CALL}, {CALL}]", f"{CALL}\nthen some text", "just text"])
def test_streamed_per_character_matches_whole(text):
    whole, _ = fold(TOOLS_PLAN, [text])
    streamed, events = fold(TOOLS_PLAN, list(text))
    assert summary(streamed) == summary(whole)
    for i, block in enumerate(streamed.blocks):  # the events rebuild each block
        assert "".join(e.delta for e in events if e.index == i and e.kind == "delta") == block.text
        assert [e.kind for e in events if e.index == i and e.kind != "delta"] == ["start", "stop"]


def test_calls_and_text_come_in_output_order_and_stop_before_the_next_starts():
    blocks, events = fold(TOOLS_PLAN, [f"[{CALL}, {CALL}] and text"])
    assert [(b.kind, b.text) for b in blocks.blocks] == [
        ("call", '{"a": 1, "b": 2}'), ("call", '{"a": 1, "b": 2}'), ("text", "and text")]
    assert [(e.kind, e.index) for e in events if e.kind != "delta"] == [
        ("start", 0), ("stop", 0), ("start", 1), ("stop", 1), ("start", 2), ("stop", 2)]
    assert blocks.blocks[0].arguments() == {"a": 1, "b": 2} and blocks.finish_reason("stop") == "tool_calls"


def test_a_reply_that_can_have_no_calls_has_one_text_block_from_the_start():
    blocks, events = fold(OutputPlan(), [])
    assert summary(blocks) == [("text", "", "", False)], "opened at once, empty, stopped at the end"
    assert [e.kind for e in events] == ["start", "stop"]
    tools, events = fold(TOOLS_PLAN, [])
    assert tools.blocks == [] and events == [], "with tools a text block opens only at its first character"


def test_without_parallel_calls_only_the_first_is_kept():
    blocks, _ = fold(dataclasses.replace(TOOLS_PLAN, parallel_tool_calls=False), [f"[{CALL}, {CALL}]"])
    assert [b.kind for b in blocks.blocks] == ["call"]


def test_a_call_cut_off_keeps_its_text_and_has_no_arguments_object():
    blocks, _ = fold(TOOLS_PLAN, ['{"name": "add", "arguments": {"a": 1'])
    assert blocks.blocks[0].text == '{"a": 1' and blocks.blocks[0].arguments() == {}
    assert blocks.finish_reason("length") == "length"


THINKING_PLAN = OutputPlan(reasoning=True)


@pytest.mark.parametrize("plan", [THINKING_PLAN, dataclasses.replace(TOOLS_PLAN, reasoning=True)])
@pytest.mark.parametrize("text", ["<think>\nplan it\n</think>\n\nthe answer", "<think>only thinking",
                                  f"<think>a call</think>{CALL}", "no section"])
def test_thinking_streamed_per_character_matches_whole(plan, text):
    whole, _ = fold(plan, [text])
    streamed, events = fold(plan, list(text))
    assert summary(streamed) == summary(whole)
    for i, block in enumerate(streamed.blocks):
        assert "".join(e.delta for e in events if e.index == i and e.kind == "delta") == block.text
        assert [e.kind for e in events if e.index == i and e.kind != "delta"] == ["start", "stop"]


def test_thinking_comes_first_then_text():
    blocks, events = fold(THINKING_PLAN, ["<think>\nplan it\n</think>\n\nthe answer"])
    assert [(b.kind, b.text) for b in blocks.blocks] == [("thinking", "plan it"), ("text", "the answer")], \
        "the section without its tags and the whitespace around them, then the rest"
    assert [(e.kind, e.index) for e in events if e.kind != "delta"] == [
        ("start", 0), ("stop", 0), ("start", 1), ("stop", 1)]


def test_thinking_without_calls_still_ends_with_one_text_block():
    blocks, events = fold(THINKING_PLAN, ["<think>only thinking"])
    assert summary(blocks) == [("thinking", "only thinking", "", False), ("text", "", "", False)], \
        "an unclosed section is all thinking; the text block opens empty at the end"
    assert [e.kind for e in events if e.index == 1] == ["start", "stop"]
    plain, _ = fold(THINKING_PLAN, ["no section"])
    assert summary(plain) == [("text", "no section", "", False)], "no section, no thinking block"
    opened, _ = fold(dataclasses.replace(THINKING_PLAN, starts_in_reasoning=True), ["in it</think>out"])
    assert [(b.kind, b.text) for b in opened.blocks] == [("thinking", "in it"), ("text", "out")]


def test_thinking_then_calls_has_no_text_block():
    blocks, _ = fold(dataclasses.replace(TOOLS_PLAN, reasoning=True), [f"<think>a call</think>{CALL}"])
    assert [(b.kind, b.text) for b in blocks.blocks] == [("thinking", "a call"), ("call", '{"a": 1, "b": 2}')]
    assert blocks.finish_reason("stop") == "tool_calls"
