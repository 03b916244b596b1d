"""Abuse that must not lock others out: slow bodies get a 408 and free their slot, wrong
keys are rate limited before the key check (a missing key is not a wrong one), a non-UTF-8
admin body is a 400, and a request with more items than the whole queue is a 400 (it could
never be admitted), not a 503."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine

KEY = "sk-abuse-0123456789"


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(api_key=KEY, max_concurrent_requests=3, body_read_timeout_s=0.5,
                          auth_failures_per_minute=5)
    with ServerThread(create_app(tiny_engine(), config)) as url:
        yield url


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def slow_uploader(url: str) -> socket.socket:
    """A connection that declares a 4 MB body and sends one byte of it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 4000000\r\n\r\n{{".encode())
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float = 5.0) -> str:
    """What the server sends before it closes the connection (or `timeout_s` passes)."""
    sock.settimeout(timeout_s)
    chunks = []
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_slow_bodies_get_408_and_free_their_slots(server):
    uploaders = [slow_uploader(server) for _ in range(3)]  # every slot taken
    try:
        start = time.monotonic()
        while True:  # within the body timeout (0.5 s) the slots come back
            r = httpx.get(server + "/v1/models", headers=auth(), timeout=10)
            if r.status_code == 200 or time.monotonic() - start > 5:
                break
        assert r.status_code == 200, r.text
        assert time.monotonic() - start < 3
        for sock in uploaders:
            reply = read_until_closed(sock)  # the head and the body may come in separate reads
            assert reply.startswith("HTTP/1.1 408"), reply
            assert "connection: close" in reply.lower() and "request_timeout" in reply
    finally:
        for sock in uploaders:
            sock.close()


def test_wrong_keys_are_limited_before_the_key_is_checked(server):
    with httpx.Client(base_url=server) as client:
        codes = [client.get("/v1/models", headers=auth(f"guess-{i}")).status_code for i in range(8)]
        assert codes[:5] == [401] * 5 and codes[5:] == [429] * 3, codes
        limited = client.get("/v1/models", headers=auth())  # even the right key, until the window passes
        assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert client.get("/health").status_code == 200  # probes are never limited


def test_missing_keys_are_plain_401s_that_never_lock_out_the_right_key():
    config = ServerConfig(api_key=KEY, auth_failures_per_minute=3)
    with ServerThread(create_app(tiny_engine(), config)) as url, httpx.Client(base_url=url) as client:
        forgotten = [client.get("/v1/models", headers=headers) for headers in
                     [{}] * 4 + [{"Authorization": "Bearer"}, {"Authorization": KEY}, {"x-api-key": ""}]]
        assert [r.status_code for r in forgotten] == [401] * 7, \
            f"a request without a key is a 401, never counted: {[r.status_code for r in forgotten]}"
        assert "Authorization: Bearer" in forgotten[0].json()["error"]["message"], "the 401 says how to send the key"
        assert client.get("/v1/models", headers=auth()).status_code == 200, "forgetting the key locks nobody out"
        wrong = [client.get("/v1/models", headers=auth(f"guess-{i}")).status_code for i in range(4)]
        assert wrong == [401, 401, 401, 429], f"wrong keys still count (3 a minute): {wrong}"


def test_non_utf8_admin_load_body_is_400():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        r = httpx.post(url + "/admin/models/load", content=b'{"model": "\xff\xfe"}',
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "model" in r.json()["error"]["message"], r.text


def test_more_inputs_than_the_queue_is_400_not_503():
    engine = tiny_engine()
    with ServerThread(create_app(engine, ServerConfig())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        too_many = engine.config.max_queue + 1
        with pytest.raises(openai.BadRequestError, match="--max-queue") as e:
            client.embeddings.create(model=model, input=["hi"] * too_many)
        assert e.value.body["code"] == "too_many_inputs"
        with pytest.raises(openai.BadRequestError, match="--max-queue"):
            client.completions.create(model=model, prompt=["hi"] * too_many, max_tokens=1)
        assert len(client.embeddings.create(model=model, input=["hi", "there"]).data) == 2


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/cache/rebuild",
                                  "/v1/admin/prepare-stop"])
def test_non_utf8_bodies_on_the_dict_routes_are_4xx(path):
    # Found by the 200-example fuzz run: Quart's get_json(silent=True) lets a
    # UnicodeDecodeError out, so these routes answered 500.
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        r = httpx.post(url + path, content=b'\xbd9V', headers={"content-type": "application/json"})
        assert r.status_code in (400, 403) and r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health").status_code == 200
