"""Every refusal on the wire: status, the OpenAI envelope, the `param` it names — and the
server still serving afterwards (each case is followed by a successful request)."""

from __future__ import annotations

import json
from http.client import HTTPConnection

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, tiny_engine

MAX_BODY_BYTES = 64 * 1024  # small, so the 413 case sends little


DRAIN_TIMEOUT_S = 0.3  # the module's: a client that never sends its body waits this long for the answer


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(max_body_bytes=MAX_BODY_BYTES, max_n=4, max_stop_strings=2, max_stop_chars=8)
    app = create_app(tiny_engine(), config)
    app.asgi_app.drain_timeout_s = DRAIN_TIMEOUT_S  # api/unread_body.py, the outermost middleware
    with ServerThread(app) as url:
        yield url


def assert_envelope(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


COMPLETION_CASES = [
    # (body, param) -> 400 naming param
    ({"prompt": "Hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "Hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "Hi", "top_k": -2}, "top_k"),
    ({"prompt": "Hi", "min_p": 2}, "min_p"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "n": 5}, "n"),  # max_n = 4
    ({"prompt": "Hi", "n": 1.0}, "n"),
    ({"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "Hi", "stop": ["a", "b", "c"]}, "stop"),  # max_stop_strings = 2
    ({"prompt": "Hi", "stop": "toolongstop"}, "stop"),  # max_stop_chars = 8
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "stop": 5}, "stop"),
    ({"prompt": "Hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "Hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "Hi", "seed": "7"}, "seed"),
    ({"prompt": "Hi", "echo": "yes"}, "echo"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "Hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "Hi", "best_of": 3}, "best_of"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": {"text": "Hi"}}, "prompt"),
]


@pytest.mark.parametrize("body,param", COMPLETION_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_CASES)])
def test_completion_validation_names_the_param(http, body, param):
    error = assert_envelope(http.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert_still_serving(http)


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}, {"role": "user", "content": "hi", "name": 3}]}, "messages[1].name"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
]


@pytest.mark.parametrize("body,param", CHAT_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_CASES)])
def test_chat_validation_names_the_param(http, body, param):
    assert_envelope(http.post("/v1/chat/completions", json=body), 400, param)
    assert_still_serving(http)


@pytest.mark.parametrize("raw,what", [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b"[1, 2]", "JSON object"),
    (b"", "empty"),
])
def test_malformed_bodies(http, raw, what):
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert what in assert_envelope(r, 400)["message"]
    assert_still_serving(http)


def test_unknown_model_is_404(http, server):
    error = assert_envelope(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi"}), 404,
                            "model", "model_not_found")
    assert "gpt-9" in error["message"]
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert_still_serving(http)


def test_unknown_route_and_wrong_method(http):
    assert_envelope(http.get("/v1/nothing-here"), 404, None, "not_found")
    r = http.get("/v1/completions")
    assert_envelope(r, 405, None, "method_not_allowed")
    assert "POST" in r.headers["allow"]
    assert_still_serving(http)


def test_body_over_the_limit_is_413(http):
    r = http.post("/v1/completions", json={"prompt": "x" * MAX_BODY_BYTES})
    assert_envelope(r, 413, None, "request_too_large")
    assert_still_serving(http)


def test_prompt_at_the_context_is_context_length_exceeded(http):
    ids = [5] * CONTEXT_TOKENS
    error = assert_envelope(http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}), 400,
                            "prompt", "context_length_exceeded")
    assert str(CONTEXT_TOKENS) in error["message"] and f"{len(ids)} tokens" in error["message"], \
        "the message names both the ceiling and the prompt's count"
    long_chat = [{"role": "user", "content": "Hello world! " * CONTEXT_TOKENS}]
    assert_envelope(http.post("/v1/chat/completions", json={"messages": long_chat}), 400, "messages",
                    "context_length_exceeded")
    assert_still_serving(http)


def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", temperature=5)
    assert info.value.body["param"] == "temperature"


def test_errors_are_counted(http):
    before = http.get("/admin/stats").json()["errors_total"]
    http.post("/v1/completions", json={"prompt": "Hi", "n": 0})
    assert http.get("/admin/stats").json()["errors_total"] == before + 1


# ---------------------------------------------------------------- errors answered before the body is read


def connection(server: str) -> HTTPConnection:
    host, port = server.removeprefix("http://").split(":")
    return HTTPConnection(host, int(port), timeout=30)


def send_headers(conn: HTTPConnection, path: str, num_body_bytes: int) -> None:
    conn.putrequest("POST", path)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(num_body_bytes))
    conn.endheaders()  # the headers alone: the server can answer before the body arrives


def test_an_error_before_the_body_is_read_drains_it_and_keeps_the_connection(server):
    body = json.dumps({"prompt": "x" * 4000}).encode()
    conn = connection(server)
    for path, status in (("/v1/nowhere", 404), ("/v1/models", 405)):
        send_headers(conn, path, len(body))
        conn.send(body)  # arrives after the route was refused
        reply = conn.getresponse()
        assert reply.status == status and reply.getheader("connection") is None, "kept alive"
        assert json.loads(reply.read())["error"]["code"] in ("not_found", "method_not_allowed")
        socket_used = conn.sock
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 2}),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().read() and conn.sock is socket_used, "the next request reuses the connection"
    conn.close()


def test_a_client_that_waits_for_the_answer_gets_connection_close(server):
    conn = connection(server)
    send_headers(conn, "/v1/nowhere", 100)  # and never sends the body: the answer comes after the drain timeout
    reply = conn.getresponse()
    assert reply.status == 404 and reply.getheader("connection") == "close", "the connection is not reused"
    reply.read()
    conn.close()


def test_a_body_over_the_limit_is_refused_with_connection_close_and_the_pool_recovers(http):
    r = http.post("/v1/completions", json={"prompt": "x" * MAX_BODY_BYTES})
    assert_envelope(r, 413, None, "request_too_large")
    assert r.headers["connection"] == "close", "too large to read: the connection closes, and says so"
    for _ in range(3):
        assert_still_serving(http)


class JaxRuntimeError(RuntimeError):
    """Named as jax's own: a name the client must never see."""


@pytest.mark.parametrize("method,path,body,exc", [
    ("GET", "/v1/models", None, ZeroDivisionError("division by zero")),
    ("POST", "/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
     JaxRuntimeError("INTERNAL: device lost")),
    ("POST", "/completion", {"prompt": "Hi", "n_predict": 2}, KeyError("row")),
], ids=["openai", "anthropic", "llamacpp"])
def test_an_unexpected_exception_is_a_500_naming_a_request_id_not_the_exception(http, monkeypatch, caplog, method,
                                                                              path, body, exc):
    """The catch-all used to answer 'internal error: ZeroDivisionError' (the class name, and
    nothing to find the traceback by)."""
    from api.state import AppState

    def raise_it(self):
        raise exc

    monkeypatch.setattr(AppState, "require_engine", raise_it)  # every route asks for the engine first
    r = http.request(method, path, json=body)
    monkeypatch.undo()
    assert r.status_code == 500, r.text
    request_id = r.headers["x-request-id"]
    assert type(exc).__name__ not in r.text and "Error" not in r.text, f"no exception class name in the body: {r.text}"
    assert f"the server log has the details under request id {request_id}" in r.text, r.text
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and logged[0].exc_info and logged[0].exc_info[1] is exc, "the log has the traceback under that id"
    assert_still_serving(http)
