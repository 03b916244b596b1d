"""/v1/responses end to end with the official `openai` client (`responses.create`,
`responses.stream`): the response object, statuses, the event stream with its sequence
numbers, statelessness, function tools (forced calls as function_call items, whole and
streamed; function_call_output history), text.format json_schema / json_object, errors,
cancellation. Real server, tiny Llama, one per module. The random model writes garbage
unless masked, so every document and call that validates below is the grammar's doing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.schema_check import check
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, parse_sse, tiny_engine, wait_for
from tests.server.test_api_structured import ADD, PERSON, SCHEMAS, TOOLS as CHAT_TOOLS, WEATHER

INPUT = "Hello world!"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD, "strict": True}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def idle(http) -> bool:
    s = http.get("/admin/stats").json()
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["generating_now"] == 0


def count(http, messages) -> int:
    return http.post("/v1/tokenize", json={"messages": messages}).json()["count"]


def test_create_with_the_client(client, model, http):
    r = client.responses.create(model=model, input=INPUT, max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    item = r.output[0]
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text and r.output_text
    assert r.usage.output_tokens == 6
    assert r.usage.input_tokens == count(http, [{"role": "user", "content": INPUT}])
    assert r.usage.total_tokens == r.usage.input_tokens + 6


def test_message_items_and_instructions_render_like_chat(client, model, http):
    items = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}]
    r = client.responses.create(model=model, input=items, instructions="Be brief.", max_output_tokens=2,
                                temperature=0, store=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks"}]
    assert r.usage.input_tokens == count(http, chat)
    assert r.store is False, "store is accepted; nothing is kept"


def test_stream_events_sequence_numbers_and_text(client, model):
    whole = client.responses.create(model=model, input=INPUT, max_output_tokens=10, temperature=0)
    with client.responses.stream(model=model, input=INPUT, max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], "a truncated answer ends as OpenAI's does"
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.usage.output_tokens == 10
    raw = client.responses.create(model=model, input=INPUT, max_output_tokens=3, temperature=0, stream=True)
    assert [e.type for e in raw][0] == "response.created"


def test_a_row_that_ends_by_itself_is_completed():
    from api.generation import RowOutput
    from api.responses_routes import ResponsesRequest, _Response
    from ferrox_jax.request import RowEvent, RowSampling

    class Run:
        api_id, num_prompt_tokens, num_completion_tokens, num_cached_tokens = "resp_x", 3, 1, 0

    reply = _Response(Run(), "m", ResponsesRequest(input="hi"), RowSampling())
    reply.fold(RowOutput(0, 0, RowEvent("resp_x", 0, (5,), "Hi", None, "stop")))
    body = reply.response()
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["output"][0]["status"] == "completed" and body["output"][0]["content"][0]["text"] == "Hi"
    assert body["output_text"] == "Hi"


def test_stateless_and_unsupported_fields_are_clear_400s(client, model, http):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=INPUT, previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "whole conversation" in e.value.body["message"]
    for body, param in (({"input": INPUT, "temperature": 3}, "temperature"),
                        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
                        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # dropped: nothing left
                        ({"input": 5}, "input"),
                        ({"input": INPUT, "model": "gpt-x"}, "model")):
        r = http.post("/v1/responses", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------- tools and text.format


def calls_of(response) -> list[tuple[str, dict]]:
    """(name, arguments) of each function_call item; every item must be one."""
    assert [item.type for item in response.output] == ["function_call"] * len(response.output) and response.output
    for item in response.output:
        assert item.status == "completed" and item.call_id.startswith("call_") and item.id.startswith("fc_")
        check(json.loads(item.arguments), SCHEMAS[item.name])
    return [(item.name, json.loads(item.arguments)) for item in response.output]


@pytest.mark.parametrize("tool_choice, names", [
    ("required", ("get_weather", "add")), ({"type": "function", "name": "get_weather"}, ("get_weather",))])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_function_calls_validate_against_the_parameters(client, model, tool_choice, names, parallel):
    r = client.responses.create(model=model, input=INPUT, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                                parallel_tool_calls=parallel, max_output_tokens=1000)
    calls = calls_of(r)
    assert r.status == "completed" and r.output_text == "", "calls alone: no message item"
    assert {name for name, _ in calls} <= set(names)
    assert parallel or len(calls) == 1
    assert r.tool_choice == tool_choice or r.tool_choice.name == tool_choice["name"]
    assert [t.name for t in r.tools] == ["get_weather", "add"] and r.parallel_tool_calls is parallel


def test_forced_function_calls_stream_to_the_whole_response(client, model):
    ask = dict(model=model, input=INPUT, tools=TOOLS, tool_choice="required", temperature=0, max_output_tokens=1000)
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    per_call = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done"]
    assert [k for k in dict.fromkeys(kinds[2:-1])] == per_call, "call items only, each added, grown, done"
    for index, item in enumerate(final.output):
        added = next(e for e in events if e.type == "response.output_item.added" and e.output_index == index)
        assert added.item.type == "function_call" and added.item.arguments == "" and added.item.id == item.id
        deltas = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta" and e.output_index == index)
        done = next(e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index)
        assert deltas == done.arguments == item.arguments
    assert calls_of(final) == calls_of(whole) and final.usage.output_tokens == whole.usage.output_tokens


def test_function_call_output_history_round_trip(client, model, http):
    first = client.responses.create(model=model, input=INPUT, tools=TOOLS, temperature=0, max_output_tokens=200,
                                    tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False)
    (call,) = first.output
    history = [{"role": "user", "content": INPUT}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    r = client.responses.create(model=model, input=history, tools=TOOLS, max_output_tokens=3, temperature=0)
    assert r.output[0].type == "message" and r.status in ("completed", "incomplete")
    chat = [{"role": "user", "content": INPUT},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "5"}]
    rendered = http.post("/v1/tokenize", json={"messages": chat, "tools": CHAT_TOOLS}).json()["count"]
    assert r.usage.input_tokens == rendered, "the call and its output render as chat's tool turns, tools included"


def test_json_schema_format_makes_a_valid_document_whole_and_streamed(client, model):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    ask = dict(model=model, input=INPUT, text={"format": fmt}, temperature=0, max_output_tokens=300)
    r = client.responses.create(**ask)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    check(json.loads(r.output_text), PERSON)
    with client.responses.stream(**ask) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == r.output_text
    # json_object bounds nothing: greedy on INPUT is still writing at 300 tokens, on "Hi" it closes.
    doc = client.responses.create(model=model, input="Hi", text={"format": {"type": "json_object"}},
                                  temperature=0, max_output_tokens=300)
    assert doc.status == "completed" and isinstance(json.loads(doc.output_text), dict)


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' are not supported"),
    ({"tools": [{"type": "function", "parameters": ADD}]}, "tools", "function name must be"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objectx"}}], "tool_choice": "required"},
     "tools", "'f': parameters are not a usable JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice", "not in tools"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "cannot be combined"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "is required"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, "text.format.schema",
     "Invalid type: objectx"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "must be text, json_schema or json_object"),
    ({"input": [{"type": "function_call", "name": "add"}]}, "input[0]", "needs call_id, name and arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]", "needs call_id and output"),
])
def test_unusable_tools_and_formats_are_400s(http, body, param, message):
    r = http.post("/v1/responses", json={"input": INPUT, "max_output_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and message in r.json()["error"]["message"], \
        r.text


def test_server_default_constraint_applies_unless_text_format_is_text(model):
    from ferrox_jax.constraint import GrammarSpec

    config = ServerConfig(default_grammar=GrammarSpec.choice(["alpha", "beta"]))
    with ServerThread(create_app(tiny_engine(), config)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=model, input=INPUT, max_output_tokens=20, temperature=0)
        assert client.responses.create(**ask).output_text in ("alpha", "beta")
        text = client.responses.create(**ask, text={"format": {"type": "text"}}).output_text
        assert text not in ("alpha", "beta"), "text opts out"


def test_cancel_and_disconnect_free_every_block(http, server, model):
    long = {"input": INPUT, "max_output_tokens": CONTEXT_TOKENS - 64, "temperature": 0, "stream": True}
    before = http.get("/admin/stats").json()["aborted"]
    with httpx.Client(base_url=server, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/responses", json=long) as r:
            lines = r.iter_lines()
            next(line for line in lines if "output_text.delta" in line)
            assert http.post("/v1/cancel", json={"request_id": r.headers["x-request-id"]}).json()["cancelled"]
            events = parse_sse("\n".join(lines) + "\n\n")
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "cancelled"
        with streamer.stream("POST", "/v1/responses", json=long) as r:
            next(line for line in r.iter_lines() if "output_text.delta" in line)
    wait_for(lambda: http.get("/admin/stats").json()["aborted"] == before + 2)
    wait_for(lambda: idle(http))
    assert http.get("/admin/stats").json()["recent"][-1]["route"] == "/v1/responses"
