"""/v1/messages end to end with the official `anthropic` client: the message shape, stop
reasons (which stop sequence matched), the event stream, count_tokens, tools (forced
calls as tool_use blocks, whole and streamed; tool_result history; their 400s),
Anthropic's error envelope on every error of its routes (auth included), cancellation and
the counters. Real Hypercorn server, real engine on a tiny Llama; one server for the
module. The random model writes garbage unless masked, so every tool input that
validates below is the forced-call grammar's doing."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.schema_check import check
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, tiny_engine, wait_for
from tests.server.test_api_structured import ADD, SCHEMAS, TOOLS as CHAT_TOOLS, WEATHER

KEY = "sk-ant-test-key"
MESSAGES = [{"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0}  # recent clients send sampling fields only through extra_body
MAX_BODY_BYTES = 64 * 1024
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "add", "description": "Add two integers", "input_schema": ADD}]  # CHAT_TOOLS, Anthropic's shape


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(api_key=KEY, max_body_bytes=MAX_BODY_BYTES)
    with ServerThread(create_app(tiny_engine(), config)) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60, headers={"x-api-key": KEY}) as client:
        yield client


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def prompt_tokens(usage) -> int:
    """The whole prompt: computed (`input_tokens`) plus served by the prefix cache."""
    return usage.input_tokens + usage.cache_read_input_tokens


def idle(http) -> bool:
    s = http.get("/admin/stats").json()
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["generating_now"] == 0


def test_create_message_with_the_client(claude, model, http):
    msg = claude.messages.create(model=model, max_tokens=6, messages=MESSAGES, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None, "greedy here never ends by itself"
    assert msg.usage.output_tokens == 6
    count = claude.messages.count_tokens(model=model, messages=MESSAGES)
    assert prompt_tokens(msg.usage) == count.input_tokens
    assert count.input_tokens == http.post("/v1/tokenize", json={"messages": MESSAGES}).json()["count"]


def test_stop_sequence_reports_which_one_matched(claude, model):
    text = claude.messages.create(model=model, max_tokens=24, messages=MESSAGES, extra_body=GREEDY).content[0].text
    stop = text[4:7]  # greedy again reaches it; the text is cut where it first starts
    assert len(stop) == 3 and stop.strip()
    msg = claude.messages.create(model=model, max_tokens=24, messages=MESSAGES, extra_body=GREEDY,
                                 stop_sequences=["never-there", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.find(stop)]


def test_sampling_defaults_and_extra_body_fields(claude, model, http):
    body = {"model": model, "max_tokens": 4, "messages": MESSAGES}
    for extra in ({"temperature": 0.7, "top_p": 0.9, "top_k": 5}, {"metadata": {"user_id": "u1"}}):
        assert http.post("/v1/messages", json={**body, **extra}).status_code == 200

    def text(**extra) -> str:
        r = http.post("/v1/messages", json={**body, "max_tokens": 12, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["content"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1.0, top_k=1) == greedy, "top_k 1 keeps only the greedy token"
    assert text(temperature=1.0, top_p=1e-6) == greedy, "a tiny top_p keeps only the greedy token"
    r = http.post("/v1/messages", json={**body, "temperature": 1.5})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"], "Anthropic's range is [0, 1]"


def test_stream_matches_the_whole_message(claude, model):
    whole = claude.messages.create(model=model, max_tokens=12, messages=MESSAGES, extra_body=GREEDY)
    with claude.messages.stream(model=model, max_tokens=12, messages=MESSAGES, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_stream_event_sequence_and_framing(http, model):
    r = http.post("/v1/messages", json={"model": model, "max_tokens": 5, "messages": MESSAGES, "stream": True,
                                        "temperature": 0})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["request-id"].startswith("msg_")
    kinds = []
    for block in r.text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        kind = event_line.removeprefix("event: ")
        assert httpx.Response(200, content=data_line.removeprefix("data: ")).json()["type"] == kind
        kinds.append(kind)
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}, "only text deltas in between"


def test_system_blocks_tool_use_and_tool_results_render_like_chat(claude, model, http):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me add."},
                                          {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4"},
                                     {"type": "text", "text": "Thanks"}]},
    ]
    system = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    count = claude.messages.count_tokens(model=model, messages=messages, system=system).input_tokens
    chat = [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "Let me add.", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
            {"role": "tool", "content": "4", "tool_call_id": "t1"}, {"role": "user", "content": "Thanks"}]
    assert count == http.post("/v1/tokenize", json={"messages": chat}).json()["count"]
    msg = claude.messages.create(model=model, max_tokens=2, messages=messages, system=system, extra_body=GREEDY)
    assert prompt_tokens(msg.usage) == count


# ---------------------------------------------------------------- tools


def tool_blocks(msg) -> list[tuple[str, dict]]:
    """(name, input) of each tool_use block; every block must be one, with Anthropic's id."""
    assert [b.type for b in msg.content] == ["tool_use"] * len(msg.content) and msg.content, msg.content
    for block in msg.content:
        assert block.id.startswith("toolu_") and len(block.id) == len("toolu_") + 24, block.id
        check(block.input, SCHEMAS[block.name])
    return [(b.name, b.input) for b in msg.content]


@pytest.mark.parametrize("tool_choice, names", [
    ({"type": "any"}, ("get_weather", "add")), ({"type": "tool", "name": "get_weather"}, ("get_weather",))])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_use_blocks_validate_against_the_input_schema(claude, model, tool_choice, names, parallel):
    msg = claude.messages.create(model=model, max_tokens=1000, messages=MESSAGES, tools=TOOLS, extra_body=GREEDY,
                                 tool_choice={**tool_choice, "disable_parallel_tool_use": not parallel})
    calls = tool_blocks(msg)
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert {name for name, _ in calls} <= set(names)
    assert parallel or len(calls) == 1, "disable_parallel_tool_use leaves one call"


def test_forced_tool_use_streams_to_the_whole_message(claude, model):
    ask = dict(model=model, max_tokens=1000, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "any"},
               extra_body=GREEDY)
    whole = claude.messages.create(**ask)
    partial: dict[int, str] = {}
    with claude.messages.stream(**ask) as stream:
        for e in stream:
            if e.type == "content_block_start":
                assert e.content_block.type == "tool_use" and e.content_block.input == {}, "starts empty"
                partial[e.index] = ""
            elif e.type == "content_block_delta":
                assert e.delta.type == "input_json_delta"
                partial[e.index] += e.delta.partial_json
        final = stream.get_final_message()
    assert tool_blocks(final) == tool_blocks(whole) == [(b.name, json.loads(partial[i]))
                                                         for i, b in enumerate(final.content)]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_result_history_round_trip(claude, model, http):
    call = claude.messages.create(model=model, max_tokens=200, messages=MESSAGES, tools=TOOLS, extra_body=GREEDY,
                                  tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True})
    (block,) = call.content
    history = MESSAGES + [{"role": "assistant", "content": [b.model_dump() for b in call.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                        "content": "5"}]}]
    reply = claude.messages.create(model=model, max_tokens=3, messages=history, tools=TOOLS, extra_body=GREEDY,
                                   tool_choice={"type": "none"})
    assert reply.content[0].type == "text" and reply.stop_reason in ("end_turn", "max_tokens")
    chat = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": block.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(block.input)}}]},
        {"role": "tool", "tool_call_id": block.id, "content": "5"}]
    rendered = http.post("/v1/tokenize", json={"messages": chat}).json()["count"]
    assert prompt_tokens(reply.usage) == rendered, "tool_choice none: the history as chat renders it, no tools"


def test_count_tokens_counts_the_tools(claude, model, http):
    plain = claude.messages.count_tokens(model=model, messages=MESSAGES).input_tokens
    with_tools = claude.messages.count_tokens(model=model, messages=MESSAGES, tools=TOOLS).input_tokens
    as_chat = http.post("/v1/tokenize", json={"messages": MESSAGES, "tools": CHAT_TOOLS}).json()["count"]
    assert with_tools == as_chat > plain, "tools render into the prompt as on chat"
    msg = claude.messages.create(model=model, max_tokens=2, messages=MESSAGES, tools=TOOLS, extra_body=GREEDY)
    assert prompt_tokens(msg.usage) == with_tools


@pytest.mark.parametrize("tools, tool_choice, message", [
    ([{"description": "no name", "input_schema": ADD}], None, "function name must be"),
    ([{"name": "add"}], None, "tools[0].input_schema"),
    ([{"name": "add", "input_schema": "not a schema"}], None, "parameters must be a JSON schema object"),
    ([{"name": "f", "input_schema": {"type": "objectx"}}], {"type": "any"}, "'f': parameters are not a usable"),
    (TOOLS, {"type": "tool", "name": "sub"}, "'sub', which is not in tools"),
    (TOOLS, {"type": "required"}, "tool_choice must be"),
    (None, {"type": "any"}, "tool_choice 'any' needs tools"),
    ([{"type": "web_search_20250305", "name": "web_search"}], None, "'web_search_20250305' are not supported"),
])
def test_unusable_tools_are_400s_in_the_anthropic_envelope(http, model, tools, tool_choice, message):
    body = {"model": model, "max_tokens": 4, "messages": MESSAGES, "tools": tools, "tool_choice": tool_choice}
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        got = assert_anthropic_error(http.post(route, json=body), 400, "invalid_request_error")
        assert message in got, got


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("method,path,kwargs,status,kind", [
    ("POST", "/v1/messages", {"content": b"{not json"}, 400, "invalid_request_error"),
    ("POST", "/v1/messages", {"json": {"model": "m", "messages": MESSAGES}}, 400, "invalid_request_error"),
    ("POST", "/v1/messages", {"json": {"max_tokens": 4, "messages": [], "model": "x"}}, 400, "invalid_request_error"),
    ("POST", "/v1/messages/nowhere", {"json": {}}, 404, "not_found_error"),
    ("GET", "/v1/messages", {}, 405, "invalid_request_error"),
    ("POST", "/v1/messages", {"content": b"x" * (MAX_BODY_BYTES + 1)}, 413, "request_too_large"),
])
def test_every_error_on_the_route_is_in_the_anthropic_envelope(http, method, path, kwargs, status, kind):
    assert_anthropic_error(http.request(method, path, **kwargs), status, kind)


def test_unknown_model_and_missing_key(http, claude, server, model):
    body = {"model": model, "max_tokens": 4, "messages": MESSAGES}
    assert_anthropic_error(http.post("/v1/messages", json={**body, "model": "claude-x"}), 404, "not_found_error")
    assert_anthropic_error(httpx.post(server + "/v1/messages", json=body), 401, "authentication_error")
    bearer = httpx.post(server + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200, "the key works as a Bearer token too"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=2, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=2, messages=MESSAGES, stop_sequences=[""])
    other = httpx.post(server + "/v1/completions", json={"prompt": "Hi"})
    assert other.status_code == 401 and "code" in other.json()["error"], "other routes keep the OpenAI envelope"


def test_rate_limit_and_header_limit_answer_in_the_anthropic_envelope(model):
    config = ServerConfig(rate_limit_per_minute=1, max_header_bytes=2048)
    with ServerThread(create_app(tiny_engine(), config)) as url:
        body = {"model": model, "max_tokens": 1, "messages": MESSAGES}
        big = httpx.post(url + "/v1/messages", json=body, headers={"x-padding": "p" * 4096})
        assert_anthropic_error(big, 431, "invalid_request_error")  # refused below Quart, by the guards
        httpx.post(url + "/v1/messages", json=body)
        assert_anthropic_error(httpx.post(url + "/v1/messages", json=body), 429, "rate_limit_error")


def test_queue_full_is_an_overloaded_529():
    from api.anthropic_routes import error_response
    from api.errors import unavailable

    assert error_response(unavailable("queue full", code="queue_full")) == (
        529, {"type": "error", "error": {"type": "overloaded_error", "message": "queue full"}})


def test_cancel_by_request_id_and_disconnect_free_every_block(http, server, model):
    long = {"model": model, "max_tokens": CONTEXT_TOKENS - 64, "messages": MESSAGES, "stream": True,
            "temperature": 0}
    before = http.get("/admin/stats").json()
    with httpx.Client(base_url=server, timeout=60, headers={"x-api-key": KEY}) as streamer:
        with streamer.stream("POST", "/v1/messages", json=long) as r:
            lines = r.iter_lines()
            next(line for line in lines if '"content_block_delta"' in line)
            cancelled = http.post("/v1/cancel", json={"request_id": r.headers["request-id"]})
            assert cancelled.json()["cancelled"] is True
            rest = "\n".join(lines)
        assert '"stop_reason":"cancelled"' in rest and rest.rstrip().endswith('data: {"type":"message_stop"}')
        with streamer.stream("POST", "/v1/messages", json=long) as r:
            next(line for line in r.iter_lines() if '"content_block_delta"' in line)
        # leaving the block closed the connection mid-stream
    wait_for(lambda: http.get("/admin/stats").json()["aborted"] == before["aborted"] + 2)
    wait_for(lambda: idle(http))
    after = http.get("/admin/stats").json()
    recent = [rec for rec in after["recent"] if rec["route"] == "/v1/messages"]
    assert recent[-1]["status"] == 499 and recent[-2]["status"] == 200, "disconnect, then the cancelled one"
    assert after["requests_total"] > before["requests_total"]
    metrics = http.get("/metrics").text
    assert "ferrox_requests_total" in metrics and "ferrox_time_to_first_token_seconds_count" in metrics
