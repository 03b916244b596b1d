"""Thinking sections on /v1/messages (thinking blocks) and /v1/responses (reasoning items),
with the official `anthropic` and `openai` clients: the block / item holds the reasoning,
streamed == whole, Anthropic's `thinking: disabled` keeps it in the text, a bad `thinking`
is a 400. Real server, real engine on the tiny model behind a Hermes/Qwen-style template
that opens `<think>` in the generation prompt, so the random model's output (it never
writes `</think>`) is all thinking and the text is empty; a closed section followed by
text is covered in tests/server/test_output_blocks.py. One server for the module."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.support.server_harness import parse_sse, templated_server
from tests.server.test_structured import HERMES_TEMPLATE

MESSAGES = [{"role": "user", "content": "Tell me about a person."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    with templated_server(HERMES_TEMPLATE, "tiny-hermes") as url:
        yield url


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def ask(model: str, **fields) -> dict:
    return dict(model=model, max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body={"temperature": 0}, **fields)


# ---------------------------------------------------------------- Anthropic thinking blocks


def test_thinking_block_holds_the_reasoning_whole_and_streamed(claude, model):
    msg = claude.messages.create(**ask(model))
    assert [b.type for b in msg.content] == ["thinking", "text"], "thinking first, then the (empty) text"
    thinking, text = msg.content
    assert thinking.thinking and "<think>" not in thinking.thinking and thinking.signature == ""
    assert text.text == "", "an unclosed section is all thinking"
    with claude.messages.stream(**ask(model)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content], "streamed == whole"
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thinking.thinking
    assert [d.type for d in deltas if d.type != "thinking_delta"] == ["signature_delta"], \
        "one signature_delta, before the thinking block stops"
    starts = [e.content_block.model_dump() for e in events if e.type == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""},
                      {"type": "text", "text": "", "citations": None}]


def test_thinking_enabled_is_the_default_and_disabled_keeps_the_section_in_the_text(claude, model):
    default = claude.messages.create(**ask(model)).content[0].thinking
    enabled = claude.messages.create(**ask(model, thinking={"type": "enabled", "budget_tokens": 1024}))
    assert [(b.type, getattr(b, "thinking", None)) for b in enabled.content] == [("thinking", default), ("text", None)]
    disabled = claude.messages.create(**ask(model, thinking={"type": "disabled"}))
    assert [b.type for b in disabled.content] == ["text"]
    assert disabled.content[0].text.strip() == default, "the same greedy output, left in the text"


@pytest.mark.parametrize("thinking, names", [
    ({"type": "enabled", "budget_tokens": 1023}, "budget_tokens"),
    ({"type": "enabled"}, "budget_tokens"),
    ({"type": "enabled", "budget_tokens": "2048"}, "budget_tokens"),
    ({"type": "sometimes"}, "thinking must be"),
    ("enabled", "thinking must be")])
def test_bad_thinking_is_a_400_in_anthropics_envelope(server, model, thinking, names):
    r = httpx.post(server + "/v1/messages", timeout=60, json={**ask(model), "thinking": thinking})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert names in body["error"]["message"]


# ---------------------------------------------------------------- Responses reasoning items


def test_reasoning_item_holds_the_reasoning_whole_and_streamed(client, model):
    fields = dict(model=model, input="Tell me about a person.", max_output_tokens=MAX_TOKENS, temperature=0)
    whole = client.responses.create(**fields)
    assert [item.type for item in whole.output] == ["reasoning", "message"], "reasoning first, then the message"
    reasoning, message = whole.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [c.type for c in reasoning.content] == ["reasoning_text"]
    text = reasoning.content[0].text
    assert text and "<think>" not in text
    assert message.content[0].text == "" and whole.output_text == "", "an unclosed section is all reasoning"
    with client.responses.stream(**fields) as stream:
        events = list(stream)
    final = events[-1]  # the token limit ends it: response.incomplete, which get_final_response refuses
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert [i.model_dump(exclude={"id"}) for i in final.response.output] == \
        [i.model_dump(exclude={"id"}) for i in whole.output], "streamed == whole"
    assert [i.status for i in whole.output] == ["completed", "incomplete"], "the last item is as complete as the reply"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [text]


def test_reasoning_events_over_raw_sse(server, model):
    r = httpx.post(server + "/v1/responses", timeout=60, json={
        "model": model, "input": "Tell me about a person.", "max_output_tokens": 4, "temperature": 0, "stream": True})
    events = parse_sse(r.text)
    kinds = [e["type"] for e in events]
    first = kinds.index("response.reasoning_text.delta")
    assert kinds[first - 2:first] == ["response.output_item.added", "response.content_part.added"]
    assert events[first - 2]["item"] == {"type": "reasoning", "id": events[first]["item_id"], "summary": [],
                                         "content": [], "status": "in_progress"}
    assert events[first - 1]["part"] == {"type": "reasoning_text", "text": ""}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_reply_sent_back_as_history_is_accepted_and_its_thinking_not_rendered(claude, client, model):
    msg = claude.messages.create(**ask(model))
    history = [*MESSAGES, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
               {"role": "user", "content": "And then?"}]
    without = [*MESSAGES, {"role": "assistant", "content": ""}, {"role": "user", "content": "And then?"}]
    assert claude.messages.count_tokens(model=model, messages=history).input_tokens == \
        claude.messages.count_tokens(model=model, messages=without).input_tokens, "the thinking block is dropped"
    r = client.responses.create(model=model, input="Tell me about a person.", max_output_tokens=4, temperature=0)
    again = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Tell me about a person."}, *[i.model_dump(exclude_none=True) for i in r.output],
        {"role": "user", "content": "And then?"}])
    assert [i.type for i in again.output] == ["reasoning", "message"]
