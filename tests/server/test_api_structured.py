"""Structured output and tool calls end to end: a real server over the real engine (tiny
random Llama), driven with the official `openai` client and httpx.

The tiny random model writes garbage unless masked, so every document and call that
parses below is the grammar's doing. Schemas are bounded (strings, integers, arrays) so
each sampled document ends well within max_tokens.
"""

from __future__ import annotations

import json

import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from ferrox_jax.constraint import GrammarSpec
from tests.support.schema_check import check
from tests.support.server_harness import ServerThread, parse_sse, templated_server, tiny_engine
from tests.server.test_structured import HERMES_TEMPLATE
from tests.server.test_tool_calls import ADD, TOOLS, WEATHER

MESSAGES = [{"role": "user", "content": "Tell me about a person."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls, "a forced call was made"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        check(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---------------------------------------------------------------- response_format


def test_json_schema_choices_sampled_at_temperature_1_all_validate(client, model):
    for seed in (1, 2):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, n=16, temperature=1.0, seed=seed,
                                               max_tokens=250, response_format=schema_format(PERSON))
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            check(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed_deltas_make_a_valid_document(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0, seed=5,
                                                 max_tokens=250, response_format=schema_format(PERSON), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    check(json.loads(text), PERSON)


def test_json_object_closed_objects_parse(client, model):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, n=8, temperature=0.7, seed=3,
                                           max_tokens=300, response_format={"type": "json_object"})
    closed = [json.loads(c.message.content) for c in reply.choices if c.finish_reason == "stop"]
    assert closed and all(isinstance(doc, dict) for doc in closed)


def test_completions_take_a_response_format_too(http):
    r = http.post("/v1/completions", json={"prompt": "A person:", "max_tokens": 250, "temperature": 1.0, "seed": 4,
                                           "response_format": schema_format(PERSON)})
    assert r.status_code == 200, r.text
    check(json.loads(r.json()["choices"][0]["text"]), PERSON)


@pytest.mark.parametrize("field, value, matches", [
    ("guided_regex", r"[a-c]{2}-[0-9]{3}", lambda t: len(t) == 6 and t[2] == "-" and t[3:].isdigit()),
    ("guided_choice", ["sunny", "rainy day", "snow"], lambda t: t in ("sunny", "rainy day", "snow")),
    ("guided_grammar", 'start: "x" NUM "y"\nNUM: /[0-9]{1,3}/', lambda t: t[0] == "x" and t[-1] == "y" and t[1:-1].isdigit()),
    ("guided_grammar", 'root ::= "<" [a-z] [a-z]? [a-z]? ">"', lambda t: t[0] == "<" and t[-1] == ">" and t[1:-1].isalpha()),
    ("guided_json", json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}),
     lambda t: all(type(x) is bool for x in json.loads(t))),
])
def test_guided_extensions(client, model, field, value, matches):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, n=4, temperature=1.0, seed=9, max_tokens=60,
                                           extra_body={field: value})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and matches(choice.message.content), choice.message.content


@pytest.mark.parametrize("body, status_message", [
    ({"response_format": schema_format({"type": "objectx"})}, "invalid JSON schema: Invalid type: objectx"),
    ({"response_format": schema_format({"type": "string", "minLength": -1})}, "minLength"),
    ({"response_format": schema_format({"type": "object", "dependentRequired": {"a": ["b"]}})},
     "unsupported keyword(s): dependentRequired"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "at most one output constraint"),
    ({"guided_regex": "(unclosed"}, "invalid regex"),
    ({"guided_grammar": "start: undefined_rule"}, "invalid lark grammar"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_constraints_the_engine_cannot_enforce_are_400s(http, body, status_message):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert status_message in r.json()["error"]["message"]


def optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": 0, "maximum": 9}
                                             for i in range(n)}}


# One step past what llguidance's parser runs (its row limit, `LLParserLimits`): refused
# when the request arrives, in words about what it sent, never the parser's state dump.
@pytest.mark.parametrize("body, param, words", [
    ({"guided_choice": [f"option {i}" for i in range(2001)]}, "guided_choice", "2,001 choices; at most 1,999"),
    ({"response_format": schema_format(optional_properties(499), strict=False)},
     "response_format.json_schema.schema", "499 optional properties before its first required one"),
])
def test_constraints_too_wide_to_run_are_400s_before_generating(http, body, param, words):
    before = http.get("/admin/stats").json()["tokens_generated"]
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, f"a constraint the parser cannot follow must be refused up front: {r.text[:300]}"
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_grammar") and words in error["message"], error
    for internal in ("Parser Error", "<state>", "left-recursive", "Tokens:"):
        assert internal not in error["message"], f"the refusal must not carry the parser's {internal!r}"
    assert http.get("/admin/stats").json()["tokens_generated"] == before, "refused before generating"
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("body, check_reply", [
    ({"guided_choice": [f"option {i}" for i in range(1999)]}, lambda t: t.startswith("option ")),
    ({"response_format": schema_format(optional_properties(498), strict=False)},
     lambda t: t.startswith("{")),
])
def test_the_widest_accepted_constraints_run_to_a_reply(http, body, check_reply):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 40, "seed": 3,
                                                "temperature": 1.0, **body})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and check_reply(choice["message"]["content"]), choice


def test_non_strict_schema_ignores_what_it_cannot_enforce(client, model):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False, "dependentRequired": {"a": []}}
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=100, seed=1,
                                           response_format=schema_format(schema, strict=False))
    assert 0 <= json.loads(reply.choices[0].message.content)["a"] <= 9


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize("tool_choice, names", [
    ("required", ("get_weather", "add")), ({"type": "function", "function": {"name": "add"}}, ("add",))])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_parse_and_validate(client, model, tool_choice, names, parallel):
    # With parallel calls the random model keeps extending the list (seed 2 writes 8 calls
    # in ~420 tokens), so max_tokens leaves room for that.
    for seed in range(3):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                               parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=1000)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, names)
        assert parallel or len(choice.message.tool_calls) == 1


def test_forced_calls_stream_name_then_arguments(client, model):
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=4, max_tokens=400, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or ():
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None, "the name comes once, first"
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        check(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_none_makes_no_call_and_renders_no_tools(client, model):
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0)
    none = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=5, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens, "tools left out of the prompt"
    auto = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=5, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens, "the fallback tools prompt"


def test_auto_parses_a_call_the_model_writes(client, model):
    """The model is steered into writing a call (guided_regex); tool_choice auto parses it."""
    call = r'\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}'
    reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                           extra_body={"guided_regex": call})
    check_calls(reply.choices[0].message.tool_calls, ("add",))
    assert reply.choices[0].finish_reason == "tool_calls"


def test_history_with_calls_and_tool_results_renders(client, model):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    bare = client.chat.completions.create(model=model, messages=MESSAGES + [history[2]], tools=TOOLS, max_tokens=4,
                                          temperature=0)
    assert reply.usage.prompt_tokens > bare.usage.prompt_tokens, "the earlier call is in the prompt"


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "'f': parameters are not a usable JSON schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_tool_refusals_are_400s(http, body, message):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- counters, recompiles


def test_metrics_and_stats_count_constrained_requests_and_mask_time(http):
    stats = http.get("/admin/stats").json()
    assert stats["constrained_requests"] > 0 and stats["grammar_mask_s"] > 0 and stats["grammar_mask_rows"] > 0
    assert stats["grammar_errors"] == 0 and stats["recompiles_after_warmup"] == 0
    metrics = http.get("/metrics").text
    for name in ("ferrox_constrained_requests_total", "ferrox_grammar_mask_seconds_total",
                 "ferrox_grammar_mask_rows_total", "ferrox_grammar_errors_total"):
        assert f"\n{name} " in metrics, name


# ---------------------------------------------------------------- server default constraint


def test_server_default_constraint_applies_to_requests_without_one():
    default = GrammarSpec.choice(["alpha", "beta"])
    with ServerThread(create_app(tiny_engine(), ServerConfig(default_grammar=default))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        ask = dict(model=model, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=3)
        assert client.chat.completions.create(**ask).choices[0].message.content in ("alpha", "beta")
        own = client.chat.completions.create(**ask, extra_body={"guided_choice": ["gamma"]})
        assert own.choices[0].message.content == "gamma", "a request's own constraint wins"
        text = client.chat.completions.create(**ask, response_format={"type": "text"})
        assert text.choices[0].message.content not in ("alpha", "beta"), "text opts out"
        completion = client.completions.create(model=model, prompt="Pick:", max_tokens=20, seed=1)
        assert completion.choices[0].text in ("alpha", "beta")


# ---------------------------------------------------------------- a template with tools and thinking


@pytest.fixture(scope="module")
def hermes_client():
    """The tiny model behind a Hermes/Qwen-style template (renders tools, opens <think>)."""
    with templated_server(HERMES_TEMPLATE, "tiny-hermes") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_template_format_calls_are_parsed_from_the_output(hermes_client):
    model = hermes_client.models.list().data[0].id
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "C"\}\}</tool_call>'
    reply = hermes_client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                  extra_body={"guided_regex": call})
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Oslo", "unit": "C"})]


def test_reasoning_content_is_split_whole_and_streamed(hermes_client):
    """The template opens <think> in the prompt, so unclosed output is all reasoning."""
    model = hermes_client.models.list().data[0].id
    ask = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = hermes_client.chat.completions.create(**ask).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and whole.content == "" and "<think>" not in reasoning
    chunks = list(hermes_client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert not "".join(d.content or "" for d in deltas)


def test_reasoning_fields_over_raw_sse(hermes_client):
    import httpx

    r = httpx.post(str(hermes_client.base_url) + "chat/completions", timeout=60, json={
        "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True})
    events = [e for e in parse_sse(r.text) if e != "[DONE]"]
    keys = {k for e in events for k in e["choices"][0]["delta"]}
    assert "reasoning_content" in keys and "tool_calls" not in keys
