"""API key, CORS and the per-minute rate limit on a real server; the non-loopback guard."""

from __future__ import annotations

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine

KEY = "sk-test-0123456789"
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def server():
    # 40+ wrong keys from one address below: the failed-key limit (tests/server/test_api_abuse.py) is raised.
    config = ServerConfig(api_key=KEY, cors_origins=(ORIGIN,), auth_failures_per_minute=1000)
    with ServerThread(create_app(tiny_engine(), config)) as url:
        yield url


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/metrics").status_code == 200


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/cancel"), ("GET", "/admin/stats"),
    ("GET", "/openapi.json"),
])
@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": KEY}, auth(KEY + "x"),
                                     {"Authorization": "Bearer"}],
                         ids=["none", "wrong", "no-scheme", "longer", "no-token"])
def test_every_other_route_needs_the_key(server, method, path, headers):
    r = httpx.request(method, server + path, headers=headers, json={"prompt": "Hi"})
    assert r.status_code == 401
    message = r.json()["error"]["message"]
    expected = "invalid API key" if headers.get("Authorization", "").startswith("Bearer ") else "missing API key"
    assert message.startswith(expected), f"a wrong key and a missing one are told apart: {message!r}"
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_the_key_opens_the_routes(server):
    assert httpx.get(server + "/v1/models", headers=auth()).status_code == 200
    assert httpx.get(server + "/admin/stats", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0).models.list()


def test_cors_only_for_listed_origins(server):
    pre = httpx.options(server + "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "Authorization" in pre.headers["access-control-allow-headers"]
    r = httpx.get(server + "/v1/models", headers={**auth(), "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server + "/v1/models", headers={**auth(), "Origin": "https://evil.example.com"})
    assert "access-control-allow-origin" not in other.headers
    assert httpx.options(server + "/v1/completions", headers={"Origin": "https://evil.example.com"}).status_code != 204


def test_rate_limit_answers_429():
    config = ServerConfig(rate_limit_per_minute=3)
    with ServerThread(create_app(tiny_engine(), config)) as url:
        codes = [httpx.post(url + "/v1/tokenize", json={"prompt": "Hi"}).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 429 and r.json()["error"]["message"] == "rate limit exceeded"
        assert r.headers["retry-after"]
        assert httpx.get(url + "/health").status_code == 200, "probes are never rate limited"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::"])
def test_non_loopback_bind_needs_a_key_or_an_explicit_opt_out(host):
    with pytest.raises(ValueError, match="without an API key"):
        ServerConfig(host=host)
    assert ServerConfig(host=host, api_key="k").host == host
    assert ServerConfig(host=host, allow_unauthenticated_remote=True).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_needs_no_key(host):
    assert ServerConfig(host=host).api_key is None


def test_cors_wildcard_is_refused():
    with pytest.raises(ValueError, match="never"):
        ServerConfig(cors_origins=("*",))
