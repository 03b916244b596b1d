"""Tool calls: parsers per format, the streaming parser at every split, the tools prompt,
tool validation, and forced-call grammars walked on the real default tokenizer."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from api.tool_call_parser import ToolCallStreamParser, detect_tool_call_format, new_call_id, parse_tool_calls
from api.tool_calls import (TOOLS_PROMPT_PARALLEL, ToolDefinitionError, add_tools_to_messages, render_tools_prompt,
                            template_renders_tools, tool_call_grammar, validate_tools)
from ferrox_jax.grammar import GrammarCompiler, bitmask_words
from tests.support import nested_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]

# (format, output text, expected content, expected [(name, arguments as parsed JSON)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "C"}), ("add", {"a": 1, "b": [2, {"c": "}"}]})]),
    ("hermes", "No call, and <tool_ is only text.\n", "No call, and <tool_ is only text.\n", []),
    ("hermes", '<tool_call>\nget_weather(city="Paris")\n</tool_call>', '<tool_call>\nget_weather(city="Paris")\n</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {"x": "a\\"b"}, "name": "f"}</tool_call>\nDone.', "Done.", [("f", {"x": 'a"b'})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}',
     "", [("get_weather", {"city": "Oslo", "unit": "F"})]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": -2.5e3}}',
     "", [("a", {"x": 1}), ("b", {"y": -2500.0})]),
    ("llama3_json", '{"answer": 42} is my reply', '{"answer": 42} is my reply', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": "{\\"n\\": 2}"}]',
     "Sure.", [("f", {"q": "x"}), ("g", {"n": 2})]),
    ("json", '[{"name": "f", "arguments": {"a": true}}, {"name": "g", "arguments": {"b": null}}]',
     "", [("f", {"a": True}), ("g", {"b": None})]),
    ("json", '  {"name": "f", "arguments": {}}\n', "", [("f", {})]),
    ("json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("json", 'Hello {"name": "f", "arguments": {}}', 'Hello {"name": "f", "arguments": {}}', []),
]


@pytest.fixture(scope="module")
def tokenizer():
    from models.loaders.gguf import default_model_path, open_gguf
    from models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(open_gguf(default_model_path()))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 49152)


@pytest.mark.parametrize("tool_format, text, content, calls", CASES)
def test_whole_text_parser_finds_calls_and_content(tool_format, text, content, calls):
    parsed_content, parsed = parse_tool_calls(text, tool_format)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    for call in parsed:
        assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def stream(deltas: list[str], tool_format: str) -> tuple[str, list[tuple[str, str, str]], list[dict]]:
    """Feed deltas; returns (content, [(id, name, arguments)] assembled from tool_calls deltas, payloads)."""
    parser = ToolCallStreamParser(tool_format)
    payloads = [p for d in deltas for p in parser.feed(d)] + parser.finish()
    calls: list[list[str]] = []
    for p in payloads:
        assert set(p) in ({"content"}, {"tool_calls"}), p
        for tc in p.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == "", tc
                calls.append([tc["id"], tc["function"]["name"], ""])
            else:
                assert tc["index"] == len(calls) - 1 and set(tc["function"]) == {"arguments"}, tc
                calls[-1][2] += tc["function"]["arguments"]
    assert [c.id for c in parser.calls] == [c[0] for c in calls]
    return "".join(p.get("content", "") for p in payloads), [tuple(c) for c in calls], payloads


@pytest.mark.parametrize("tool_format, text, content, calls", CASES)
def test_streaming_parser_matches_whole_text_at_every_split(tool_format, text, content, calls):
    # Every single cut, cuts 7 characters apart at every offset, and one character per delta.
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [[text[:start]] + [text[i:i + 7] for i in range(start, len(text), 7)] for start in range(7)]
    splits.append(list(text))
    for deltas in splits:
        streamed_content, streamed_calls, _ = stream(deltas, tool_format)
        assert streamed_content == content, deltas
        assert [(name, json.loads(args)) for _, name, args in streamed_calls] == calls, deltas


def test_stream_never_emits_a_marker_prefix_as_content():
    text = 'Checking <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    content, calls, payloads = stream(list(text), "hermes")
    pieces = [p["content"] for p in payloads if "content" in p]
    assert "".join(pieces) == "Checking" and all("<" not in p for p in pieces), pieces
    assert calls[0][1:] == ("f", '{"a": 1}')


def test_stream_sends_the_name_then_arguments_as_they_arrive():
    parser = ToolCallStreamParser("hermes")
    assert parser.feed('<tool_call>{"name": "get_weather", ') == []
    first = parser.feed('"arguments": {"city": "Pa')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"city": "Pa'}, "arguments stream before the call closes"
    assert parser.feed('ris"}}</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert parser.finish() == [] and [c.name for c in parser.calls] == ["get_weather"]


def test_call_ids_are_openai_style_and_unique():
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


def test_format_is_detected_from_the_chat_template(tokenizer):
    assert detect_tool_call_format("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>{% endfor %}") == "hermes"
    assert detect_tool_call_format("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert detect_tool_call_format("{{ '<|python_tag|>' + tool_call.arguments | tojson }}") == "llama3_json"
    assert detect_tool_call_format(tokenizer.chat_template) == "json", "SmolLM2 has no call markers"
    assert detect_tool_call_format(None) == "json"


def test_tools_prompt_lists_every_tool_and_asks_for_the_json_format(tokenizer):
    specs = validate_tools(TOOLS)
    assert not template_renders_tools(tokenizer.chat_template), "SmolLM2's template ignores tools"
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    prompt = render_tools_prompt(specs)
    tool_lines = [json.loads(line) for line in prompt.splitlines() if line.startswith('{"name"')]
    assert tool_lines == [{"name": t["function"]["name"], "description": t["function"]["description"],
                           "parameters": t["function"]["parameters"]} for t in TOOLS]
    assert '{"name": <function name>, "arguments": <object of arguments>}' in prompt
    assert TOOLS_PROMPT_PARALLEL.strip() in prompt
    assert TOOLS_PROMPT_PARALLEL.strip() not in render_tools_prompt(specs, parallel=False)
    with_system = add_tools_to_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], specs)
    assert with_system[0]["content"] == "Be brief.\n\n" + prompt and len(with_system) == 2
    without = add_tools_to_messages([{"role": "user", "content": "hi"}], specs)
    assert without[0] == {"role": "system", "content": prompt} and without[1]["role"] == "user"


def test_invalid_tool_definitions_raise_naming_the_tool(compiler):
    def function(**fields):
        return [{"type": "function", "function": fields}]

    with pytest.raises(ToolDefinitionError, match=r"tools\[0\].*name"):
        validate_tools(function(name="has space"))
    with pytest.raises(ToolDefinitionError, match=r"tools\[0\].*type"):
        validate_tools([{"type": "retrieval"}])
    with pytest.raises(ToolDefinitionError, match="'lookup'.*parameters must be a JSON schema object"):
        validate_tools(function(name="lookup", parameters=["q"]))
    with pytest.raises(ToolDefinitionError, match="'lookup'.*not a usable JSON schema.*objectx"):
        validate_tools(function(name="lookup", parameters={"type": "objectx"}), compiler.compile)
    with pytest.raises(ToolDefinitionError, match="'add' is defined twice"):
        validate_tools(TOOLS + TOOLS[1:])
    with pytest.raises(ToolDefinitionError, match="'nope'.*not in tools"):
        tool_call_grammar(validate_tools(TOOLS), {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolDefinitionError, match="tool_choice"):
        tool_call_grammar(validate_tools(TOOLS), "auto")


def check_arguments(name: str, args: dict) -> None:
    """Hand validation against WEATHER / ADD (jsonschema is not installed)."""
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str), args
        assert 1 <= len(args["city"]) <= 10 and args["unit"] in ("C", "F"), args
    else:
        assert name == "add" and set(args) == {"a", "b"}, (name, args)
        assert all(type(args[k]) is int and -99 <= args[k] <= 99 for k in "ab"), args


def walk(compiled, tokenizer, seed: int, max_tokens: int = 600) -> str:
    """Sample uniformly among allowed tokens until the grammar finishes."""
    rng, matcher, out = np.random.default_rng(seed), compiled.new_matcher(), []
    row = np.zeros(bitmask_words(49152), np.int32)
    while not matcher.is_finished and len(out) < max_tokens:
        matcher.fill_mask(row)
        token = int(rng.choice(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))))
        assert matcher.accept(token)
        if token in tokenizer.stop_token_ids:
            break
        out.append(token)
    assert matcher.is_finished, tokenizer.decode(out)
    return tokenizer.decode(out)


@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True), ("required", False), ({"type": "function", "function": {"name": "add"}}, True)])
def test_forced_call_grammar_walks_always_parse_into_valid_calls(compiler, tokenizer, tool_choice, parallel):
    specs = validate_tools(TOOLS, compiler.compile)
    compiled = compiler.compile(tool_call_grammar(specs, tool_choice, parallel_tool_calls=parallel, max_calls=3))
    names = set()
    for seed in range(25):
        text = walk(compiled, tokenizer, seed)
        content, calls = parse_tool_calls(text, "json")
        assert content == "" and calls, text
        assert parallel or len(calls) == 1, text
        assert len(calls) <= 3
        for call in calls:
            check_arguments(call.name, json.loads(call.arguments))
            names.add(call.name)
    expected = {"add"} if isinstance(tool_choice, dict) else {"add", "get_weather"}
    assert names == expected, f"walks should reach every allowed tool; got {names}"


# ---------------------------------------------------------------- parameters with $ref


def resolve(document: dict, ref: str) -> Any:
    """The subschema a root-relative `$ref` names in `document` (KeyError if none)."""
    node = document
    for token in ref.removeprefix("#").split("/")[1:]:
        node = node[token.replace("~1", "/").replace("~0", "~")]
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref" and isinstance(v, str)] + \
            [r for k, v in node.items() if k != "$ref" for r in refs(v)]
    return [r for v in node for r in refs(v)] if isinstance(node, list) else []


def test_forced_call_schema_moves_each_tools_definitions_into_its_own_defs():
    specs = validate_tools(nested_tools.TOOLS)
    wrapper = json.loads(tool_call_grammar(specs, "required").source)
    defs = wrapper["$defs"]
    # Person's and LEGACY's "Address" clash by name; each keeps its own shape.
    assert defs["save_person.Address"]["required"] == ["street", "city"]
    assert defs["mail.Address"]["required"] == ["zip"], "draft-7 `definitions` are moved too"
    assert defs["plant_tree.Node"]["properties"]["children"]["items"] == {"$ref": "#/$defs/plant_tree.Node"}
    # Refs into the document itself ("#", "#/properties/to") point at a copy of it.
    assert defs["chain"]["properties"]["next"] == {"$ref": "#/$defs/chain"}
    assert resolve(wrapper, defs["mail"]["properties"]["copy"]["$ref"]) == {"$ref": "#/$defs/mail.Address"}
    for ref in refs(wrapper):
        assert ref.startswith("#/$defs/") and resolve(wrapper, ref), f"{ref} resolves in the wrapper"
    arguments = {call["properties"]["name"]["const"]: call["properties"]["arguments"] for call in wrapper["items"]["anyOf"]}
    assert "$defs" not in arguments["save_person"] and arguments["chain"] == {"$ref": "#/$defs/chain"}
    assert arguments["plant_tree"] == {"$ref": "#/$defs/plant_tree.Node"}, "a root $ref is rewritten too"
    untouched = validate_tools(TOOLS)
    assert "$defs" not in json.loads(tool_call_grammar(untouched, "required").source), "no refs, no $defs"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "plant_tree"}}])
def test_forced_calls_with_refs_walk_into_calls_valid_against_each_tools_schema(compiler, tokenizer, tool_choice):
    specs = validate_tools(nested_tools.TOOLS, compiler.compile)
    compiled = compiler.compile(tool_call_grammar(specs, tool_choice, parallel_tool_calls=False))
    names = set()
    for seed in range(30):
        content, calls = parse_tool_calls(walk(compiled, tokenizer, seed, max_tokens=2000), "json")
        assert content == "" and len(calls) == 1
        nested_tools.check_call(calls[0].name, calls[0].arguments)
        names.add(calls[0].name)
    expected = {"plant_tree"} if isinstance(tool_choice, dict) else set(nested_tools.SCHEMAS)
    assert names == expected, f"walks should reach every allowed tool; got {names}"
