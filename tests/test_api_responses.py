"""/v1/responses end to end with the official `openai` client (`responses.create`,
`responses.stream`): the response object, statuses, the event stream with its sequence
numbers, statelessness, errors, cancellation. Real server, tiny Llama, one per module."""

from __future__ import annotations

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.server_harness import CONTEXT_TOKENS, ServerThread, parse_sse, tiny_engine, wait_for

INPUT = "Hello world!"


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
    from ferrox_jax.request import RowEvent, SamplingParams

    class Run:
        api_id, num_prompt_tokens, num_completion_tokens = "resp_x", 3, 1

    reply = _Response(Run(), "m", ResponsesRequest(input="hi"), SamplingParams())
    reply.fold(RowOutput(0, 0, RowEvent("resp_x", 0, (5,), "Hi", None, "stop")))
    body = reply.response()
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["output"][0]["status"] == "completed" and body["output"][0]["content"][0]["text"] == "Hi"
    assert body["output_text"] == "Hi"


def test_stateless_and_unsupported_fields_are_clear_400s(client, model, http):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=INPUT, previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "whole conversation" in e.value.body["message"]
    for body, param in (({"input": INPUT, "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": INPUT, "temperature": 3}, "temperature"),
                        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
                        ({"input": 5}, "input"),
                        ({"input": INPUT, "model": "gpt-x"}, "model")):
        r = http.post("/v1/responses", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


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
