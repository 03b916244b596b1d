"""The protocol-neutral core of structured output (api/structured.py), without a server:
tool choice validation, prompt rendering (template tools or the fallback prompt, history
calls), output plans and the per-choice output parser."""

from __future__ import annotations

import json

import pytest

from api.errors import APIError
from api.structured import (PLAIN_TEXT, OutputPlan, OutputParser, completion_plan, grammar_constraint,
                            json_schema_constraint, parse_output, prepare_chat, tool_request)
from api.tool_calls import TOOLS_PROMPT
from ferrox_jax.constraint import GrammarSpec
from models.tokenizer import Tokenizer

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]
# A Hermes/Qwen-style template: renders `tools`, assistant `tool_calls` and opens a thinking section.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
HISTORY = [{"role": "user", "content": "1+2?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
           {"role": "tool", "content": "3", "tool_call_id": "call_1"}]


@pytest.fixture(scope="module")
def chatml(tiny_llama) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama)  # tests/support/tiny_model.py's ChatML template: no tools


@pytest.fixture(scope="module")
def hermes(tiny_llama) -> Tokenizer:
    tokenizer = Tokenizer.from_hf_dir(tiny_llama)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def test_tool_choice_defaults_and_refusals():
    assert tool_request(None, None, None) is None
    assert tool_request([], "none", None) is None
    auto = tool_request(TOOLS, None, None)
    assert auto.choice == "auto" and auto.is_active and not auto.forces_call and auto.parallel
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "now"}}, False)
    assert named.choice == "function" and named.function == "now" and named.forces_call and not named.parallel
    assert not tool_request(TOOLS, "none", None).is_active
    for tools, choice, message in [
            (None, "required", "needs tools"), (None, {"type": "function", "function": {"name": "add"}}, "no tools"),
            (TOOLS, {"type": "function", "function": {"name": "sub"}}, "'sub', which is not in tools"),
            (TOOLS, "sometimes", "tool_choice must be"), (TOOLS, {"type": "function"}, "tool_choice must be"),
            ([{"type": "function", "function": {"name": "bad name"}}], None, "function name")]:
        with pytest.raises(APIError, match=message) as e:
            tool_request(tools, choice, None)
        assert e.value.status == 400


def test_fallback_prompt_lists_the_tools_and_history_calls_become_json_text(chatml):
    tools = tool_request(TOOLS, "auto", None)
    chat = prepare_chat(chatml, HISTORY, tools=tools)
    assert "You can call the following functions" in chat.text and '"name": "add"' in chat.text
    assert '<|im_start|>assistant\n{"name": "add", "arguments": {"a": 1, "b": 2}}<|im_end|>' in chat.text
    assert "<|im_start|>tool\n3<|im_end|>" in chat.text
    assert chat.plan.tool_format == "json" and chat.plan.grammar is None and not chat.plan.reasoning
    assert not chat.plan.skip_special_tokens, "parsed output keeps special tokens"
    none = prepare_chat(chatml, HISTORY, tools=tool_request(TOOLS, "none", None))
    assert "You can call" not in none.text and none.plan.tool_format is None and none.plan.new_parser() is None
    assert TOOLS_PROMPT.split("{tools}")[0] in chat.text


def test_template_renders_tools_and_history_calls_with_parsed_arguments(hermes):
    chat = prepare_chat(hermes, HISTORY, tools=tool_request(TOOLS, "auto", None))
    assert chat.text.startswith("<|im_start|>system\n<tools>") and "You can call" not in chat.text
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in chat.text
    assert chat.plan.tool_format == "hermes" and chat.plan.reasoning and chat.plan.starts_in_reasoning


def test_forced_calls_use_the_json_format_and_a_grammar(hermes):
    chat = prepare_chat(hermes, HISTORY, tools=tool_request(TOOLS, "required", None))
    assert chat.plan.tool_format == "json" and chat.plan.grammar.kind == "json_schema"
    assert chat.plan.grammar_param == "tools" and not chat.plan.reasoning, "a constrained output has no thinking"
    schema = json.loads(chat.plan.grammar.source)
    assert schema["type"] == "array" and schema["minItems"] == 1
    single = prepare_chat(hermes, HISTORY, tools=tool_request(TOOLS, "required", False))
    assert json.loads(single.plan.grammar.source)["anyOf"][0]["properties"]["name"] == {"const": "add"}
    with pytest.raises(APIError, match="cannot be combined with response_format"):
        prepare_chat(hermes, HISTORY, tools=tool_request(TOOLS, "required", None), constraint=GrammarSpec.json_object())


def test_default_constraint_applies_unless_the_request_gives_one_or_asks_for_text():
    default = GrammarSpec.choice(["a", "b"])
    own = GrammarSpec.regex("[0-9]+")
    assert completion_plan(None, "response_format", default).grammar is default
    assert completion_plan(own, "guided_regex", default).grammar is own
    assert completion_plan(own, "guided_regex", default).grammar_param == "guided_regex"
    assert completion_plan(PLAIN_TEXT, "response_format", default).grammar is None


def test_constraint_helpers_name_their_field():
    with pytest.raises(APIError, match="guided_json must be a JSON schema object") as e:
        json_schema_constraint([1], strict=False, param="guided_json")
    assert e.value.param == "guided_json"
    assert grammar_constraint('root ::= "a" | "b"', param="g").syntax == "gbnf"
    assert grammar_constraint('start: "a" | "b"', param="g").syntax == "lark"


def stream(parser: OutputParser, pieces: list[str]) -> list[dict]:
    return [d for piece in pieces for d in parser.feed(piece)] + parser.finish()


def test_output_parser_splits_reasoning_then_calls_whole_and_streamed():
    plan = OutputPlan(tool_format="hermes", reasoning=True, starts_in_reasoning=True)
    text = 'The user wants a sum.\n</think>\n\nSure.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    whole = parse_output(plan.new_parser(), text)
    assert whole.reasoning == "The user wants a sum." and whole.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("add", {"a": 1, "b": 2})]
    for size in (1, 3, 11):
        parser = plan.new_parser()
        deltas = stream(parser, [text[i:i + size] for i in range(0, len(text), size)])
        assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning
        assert "".join(d.get("content", "") for d in deltas) == whole.content
        calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
        assert calls[0]["function"]["name"] == "add" and calls[0]["id"] == parser.calls[0].id
        assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"a": 1, "b": 2}
        assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


def test_without_parallel_calls_only_the_first_call_is_kept():
    plan = OutputPlan(tool_format="json", parallel_tool_calls=False)
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]'
    parser = plan.new_parser()
    deltas = stream(parser, [text])
    assert [c.name for c in parser.calls] == ["add"]
    assert {tc["index"] for d in deltas for tc in d.get("tool_calls", ())} == {0}
    assert [c.name for c in parse_output(OutputPlan(tool_format="json").new_parser(), text).calls] == ["add", "now"]


def test_plain_text_without_calls_finishes_as_the_engine_said():
    parser = OutputPlan(tool_format="json").new_parser()
    assert stream(parser, ["Hello ", "there"]) == [{"content": "Hello"}, {"content": " there"}]
    assert parser.calls == [] and parser.finish_reason("stop") == "stop"
