"""The harmony output format (gpt-oss, api/harmony.py): channels into reasoning, content
and tool calls, whole text and streamed at every split position, and the chat plan that
picks it from the template."""

from __future__ import annotations

import json

import pytest

from api.harmony import HarmonyStreamParser, is_harmony_template
from api.structured import parse_output, prepare_chat, tool_request
from models.tokenizer import Tokenizer

ANALYSIS = "<|channel|>analysis<|message|>The user asks 2+2. Easy.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
CALL_RECIPIENT_FIRST = '<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>'
CASES = [
    # (text, tools, reasoning, content, calls as (name, arguments))
    (ANALYSIS + FINAL, True, "The user asks 2+2. Easy.", "It is 4.", []),
    (ANALYSIS + CALL, True, "The user asks 2+2. Easy.", "", [("get_weather", '{"city": "Paris"}')]),
    (ANALYSIS + CALL + CALL_RECIPIENT_FIRST, True, "The user asks 2+2. Easy.", "",
     [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    # without tools in the request a call body is the text it is
    (ANALYSIS + CALL, False, "The user asks 2+2. Easy.", '{"city": "Paris"}', []),
    # a preamble on the commentary channel (no recipient) is content
    ("<|channel|>commentary<|message|>Checking.<|end|>" + FINAL, True, "", "Checking.It is 4.", []),
    # cut off by max_tokens inside the analysis: all reasoning so far
    ("<|channel|>analysis<|message|>still thinking <|", True, "still thinking <|", "", []),
    # cut off inside a call: closed with what it got
    ("<|channel|>commentary to=functions.now<|message|>{\"a\"", True, "", "", [("now", '{"a"')]),
    # no harmony at all: the text, verbatim
    ("plain answer <b>bold</b>", True, "", "plain answer <b>bold</b>", []),
]


def run(deltas, tools):
    parser = HarmonyStreamParser(tools=tools)
    out = [d for piece in deltas for d in parser.feed(piece)] + parser.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in out)
    content = "".join(d.get("content", "") for d in out)
    return reasoning, content, [(c.name, c.arguments) for c in parser.calls], out


@pytest.mark.parametrize("text, tools, reasoning, content, calls", CASES)
def test_whole_text(text, tools, reasoning, content, calls):
    assert run([text], tools)[:3] == (reasoning, content, calls)


@pytest.mark.parametrize("text, tools, reasoning, content, calls", CASES)
def test_streamed_matches_whole_text_at_every_split(text, tools, reasoning, content, calls):
    for deltas in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        assert run(deltas, tools)[:3] == (reasoning, content, calls), deltas


def test_stream_never_emits_part_of_a_marker_and_calls_stream_in_openai_shape():
    text = ANALYSIS + CALL
    _, _, _, out = run(list(text), True)
    for d in out:
        for piece in (d.get("reasoning_content", ""), d.get("content", "")):
            assert "<|" not in piece and "|>" not in piece, f"marker fragment emitted: {d}"
    head = next(d["tool_calls"][0] for d in out if "tool_calls" in d)
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"].startswith("call_")
    pieces = "".join(d["tool_calls"][0]["function"]["arguments"] for d in out if "tool_calls" in d)
    assert json.loads(pieces) == {"city": "Paris"}


# A harmony-shaped chat template (gpt-oss's renders the same markers).
HARMONY_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message.role }}"
    "{% if message.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ message.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def harmony(tiny_llama) -> Tokenizer:
    tokenizer = Tokenizer.from_hf_dir(tiny_llama)
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def test_chat_plan_parses_harmony_channels(harmony):
    """A harmony template makes the plan parse channels and keep special tokens (the markers
    are special tokens); the control: the same text under a ChatML template is all content,
    markers included."""
    assert is_harmony_template(HARMONY_TEMPLATE) and not is_harmony_template("<|im_start|>{{ x }}")
    chat = prepare_chat(harmony, [{"role": "user", "content": "Weather in Paris?"}],
                        tools=tool_request(TOOLS, "auto", None))
    assert chat.plan.harmony and chat.plan.reasoning and not chat.plan.skip_special_tokens
    assert chat.text.endswith("<|start|>assistant")
    parsed = parse_output(chat.plan.new_parser(), ANALYSIS + CALL)
    assert parsed.reasoning == "The user asks 2+2. Easy." and parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    assert chat.plan.new_parser().finish_reason("stop") == "stop"  # no calls fed yet
    plain = prepare_chat(harmony, [{"role": "user", "content": "2+2?"}], split_reasoning=False)
    assert not plain.plan.harmony and plain.plan.new_parser() is None


def test_without_a_harmony_template_the_markers_stay_text(tiny_llama):
    chatml = Tokenizer.from_hf_dir(tiny_llama)
    chat = prepare_chat(chatml, [{"role": "user", "content": "2+2?"}])
    assert not chat.plan.harmony
    parser = chat.plan.new_parser()
    text = ANALYSIS + FINAL
    content = text if parser is None else parse_output(parser, text).content
    assert content == text
