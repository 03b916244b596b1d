"""Thinking-section splitting, whole text and streamed at every split position."""

from __future__ import annotations

import pytest

from api.reasoning import ReasoningStreamParser, held_prefix_len, prompt_opens_reasoning, split_reasoning

CASES = [
    # (text, starts_in_reasoning, expected reasoning, expected content)
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, "The user wants 2+2.", "It is 4."),
    ("  <think>a < b, and </thin is not a tag</think>Answer", False, "a < b, and </thin is not a tag", "Answer"),
    ("No thinking here, <think> only at the start counts.", False, "", "No thinking here, <think> only at the start counts."),
    ("\n  plain answer with leading whitespace\n", False, "", "\n  plain answer with leading whitespace\n"),
    ("<thinking is not the tag", False, "", "<thinking is not the tag"),
    ("<think>cut off by max_tokens  ", False, "cut off by max_tokens", ""),
    ("already inside\n</think>\nthe answer", True, "already inside", "the answer"),
    ("never closed", True, "never closed", ""),
    ("<think></think>", False, "", ""),
    ("<thi", False, "", "<thi"),
]


@pytest.mark.parametrize("text, starts_in_reasoning, reasoning, content", CASES)
def test_whole_text_split(text, starts_in_reasoning, reasoning, content):
    assert split_reasoning(text, starts_in_reasoning=starts_in_reasoning) == (reasoning, content)


def stream(deltas, starts_in_reasoning: bool) -> tuple[list[str], list[str]]:
    parser = ReasoningStreamParser(starts_in_reasoning=starts_in_reasoning)
    pairs = [parser.feed(d) for d in deltas] + [parser.finish()]
    return [r for r, _ in pairs], [c for _, c in pairs]


@pytest.mark.parametrize("text, starts_in_reasoning, reasoning, content", CASES)
def test_streamed_split_matches_whole_text_at_every_split(text, starts_in_reasoning, reasoning, content):
    # Every pair of cut points (so every single cut too), and one character per delta.
    splits = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    splits.append(list(text))
    for deltas in splits:
        r, c = stream(deltas, starts_in_reasoning)
        assert ("".join(r), "".join(c)) == (reasoning, content), deltas


def test_stream_never_emits_part_of_a_tag():
    text = "<think>weighing options</think>done"
    r, c = stream(list(text), False)
    for piece in r + c:
        assert "<" not in piece and ">" not in piece, f"tag fragment emitted: {piece!r}"
    assert "".join(r) == "weighing options" and "".join(c) == "done"


def test_reasoning_is_emitted_incrementally_not_only_at_the_end():
    parser = ReasoningStreamParser()
    assert parser.feed("<think>first ") == ("first", "")
    assert parser.feed("second") == (" second", "")


def test_held_prefix_len_counts_only_proper_marker_prefixes():
    assert held_prefix_len("abc</th", ["</think>"]) == 4
    assert held_prefix_len("abc<", ["</think>", "<think>"]) == 1
    assert held_prefix_len("abc", ["</think>"]) == 0
    assert held_prefix_len("x</think>", ["</think>"]) == 0, "a whole marker is found, not held"


def test_prompt_opens_reasoning_when_the_template_leaves_a_section_open():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
