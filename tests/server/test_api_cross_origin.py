"""What a web page on another origin can make a keyless server do (api/same_origin.py), on a
real server: the no-cors attack on /sleep and /v1/cache/rebuild is refused and nothing
changes; JSON bodies from clients, our own pages and listed CORS origins still work; a
Host header the server does not answer to (DNS rebinding) is a 421.

The requests carry the headers Chromium sends for
`fetch(url, {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body})`
from a page at http://attacker.example.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from api import cli
from api.app import create_app
from api.config import ServerConfig
from api.errors import APIError
from api.same_origin import SameOrigin
from tests.support.server_harness import ServerThread, tiny_engine

ATTACKER = "http://attacker.example"
LISTED = "https://app.example.com"  # in --cors-origins
NO_CORS = {"Origin": ATTACKER, "Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site",
           "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "empty"}


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig(cors_origins=(LISTED,)))) as url:
        yield url


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client
        if is_sleeping(client):  # a server that obeyed a refused /sleep: wake the engine the others share
            client.post("/wake_up")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def is_sleeping(http: httpx.Client) -> bool:
    return http.get("/is_sleeping").json()["is_sleeping"]


def test_no_cors_text_plain_post_cannot_put_the_server_to_sleep(http):
    r = http.post("/sleep", content="x", headers=NO_CORS)
    assert r.status_code == 403, f"a cross-site no-cors POST /sleep is refused: {r.status_code} {r.text}"
    assert r.json()["error"]["code"] == "origin_not_allowed"
    assert "--cors-origins" in r.json()["error"]["message"], "the refusal says how to allow an origin"
    assert not is_sleeping(http), "the refused /sleep did not put the engine to sleep"
    assert http.get("/health").status_code == 200


def test_no_cors_text_plain_post_cannot_rebuild_the_cache(http):
    before = http.get("/v1/cache/status").json()["blocks_total"]
    r = http.post("/v1/cache/rebuild", content=json.dumps({"kv_blocks": before // 2}), headers=NO_CORS)
    assert r.status_code == 403, f"a cross-site no-cors POST /v1/cache/rebuild is refused: {r.status_code} {r.text}"
    assert http.get("/v1/cache/status").json()["blocks_total"] == before, "the refused rebuild resized nothing"


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_body_not_declared_as_json_is_415_naming_the_header(http, content_type):
    # A browser that sent no Origin would get this far; so does curl's -d without -H.
    r = http.post("/sleep", content='{"x": 1}', headers={"Content-Type": content_type})
    assert r.status_code == 415, f"a {content_type} body is refused: {r.status_code} {r.text}"
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert "-H 'Content-Type: application/json'" in error["message"], "the message tells curl users what to add"
    assert not is_sleeping(http), "the refused /sleep did not put the engine to sleep"


def test_an_empty_body_may_carry_any_content_type(http):
    r = http.post("/wake_up", headers={"Content-Type": "application/x-www-form-urlencoded", "Content-Length": "0"})
    assert r.status_code == 200, f"an empty POST labelled as a form is served: {r.status_code} {r.text}"


@pytest.mark.parametrize("path,envelope", [("/v1/messages", "anthropic"), ("/completion", "llamacpp"),
                                           ("/v1/chat/completions", "openai")])
def test_refusals_come_in_the_routes_own_envelope(http, path, envelope):
    body = json.dumps({"model": "m", "max_tokens": 1, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]})
    for status, headers in ((415, {"Content-Type": "text/plain"}), (403, NO_CORS)):
        r = http.post(path, content=body, headers=headers)
        assert r.status_code == status, f"{path} refuses with {status}: {r.status_code} {r.text}"
        if envelope == "anthropic":
            assert r.json()["type"] == "error" and r.json()["error"]["message"], r.text
        elif envelope == "llamacpp":
            assert r.json()["error"]["code"] == status, r.text
        else:
            assert r.json()["error"]["code"] in ("unsupported_media_type", "origin_not_allowed"), r.text
    assert http.get("/health").status_code == 200, "the server keeps serving"


@pytest.mark.parametrize("headers", [{"Content-Type": "application/json"},
                                     {"Content-Type": "application/json; charset=utf-8"},
                                     {"Content-Type": "application/vnd.api+json"}, {}],
                         ids=["json", "json-charset", "plus-json", "no-content-type"])
def test_json_bodies_and_untyped_bodies_are_accepted(http, headers):
    r = http.post("/v1/tokenize", content=json.dumps({"prompt": "Hello"}), headers=headers)
    assert r.status_code == 200, f"a JSON body with {headers} is read: {r.status_code} {r.text}"
    assert r.json()["count"] > 0


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_page_served_by_the_server_may_post(server, host):
    own = f"http://{host}:{port_of(server)}"  # the page's origin: where the browser loaded it from
    r = httpx.post(server + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                   headers={"Host": f"{host}:{port_of(server)}", "Origin": own, "Sec-Fetch-Site": "same-origin",
                            "Sec-Fetch-Mode": "cors"})
    assert r.status_code == 200, f"our own page's POST from {own} is served: {r.status_code} {r.text}"


def test_a_listed_cors_origin_may_post(http):
    r = http.post("/v1/tokenize", json={"prompt": "Hi"},
                  headers={"Origin": LISTED, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"})
    assert r.status_code == 200, f"a --cors-origins page may POST: {r.status_code} {r.text}"
    assert r.headers["access-control-allow-origin"] == LISTED


@pytest.mark.parametrize("headers", [
    {"Origin": "null"},  # a sandboxed frame, or a no-cors request under referrerPolicy "no-referrer"
    {"Origin": "http://127.0.0.1:1"},  # another port on the same host is another origin
    {"Origin": "https://app.example.com.attacker.example"},
    {"Sec-Fetch-Site": "cross-site"},  # a browser that left Origin out still says where it came from
], ids=["null", "other-port", "lookalike", "no-origin-cross-site"])
def test_other_origins_cannot_post_even_json(http, headers):
    r = http.post("/v1/tokenize", json={"prompt": "Hi"}, headers=headers)
    assert r.status_code == 403, f"a state-changing request from {headers} is refused: {r.status_code} {r.text}"


def test_other_origins_may_still_read_without_cors_headers(http):
    r = http.get("/v1/models", headers={"Origin": ATTACKER})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, \
        "GETs change nothing; the browser keeps their answers from the page"


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/"])
def test_a_host_this_server_does_not_answer_to_is_421(http, server, path):
    # DNS rebinding: attacker.example now resolves to 127.0.0.1, so its page is "same-origin".
    r = http.get(path, headers={"Host": f"attacker.example:{port_of(server)}"})
    assert r.status_code == 421, f"Host attacker.example is refused on {path}: {r.status_code} {r.text[:200]}"
    assert "--allowed-hosts" in r.json()["error"]["message"], "the refusal names the setting"
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": []},
                  headers={"Host": "attacker.example"})
    assert r.status_code == 421 and r.json()["type"] == "error", f"Anthropic's envelope: {r.text}"
    for host in ("localhost", "127.0.0.1", "[::1]", "10.1.2.3"):  # the local names, any IP (a probe's pod IP)
        assert http.get("/health", headers={"Host": f"{host}:{port_of(server)}"}).status_code == 200, host


def test_the_official_clients_still_work(server):
    base = f"http://localhost:{port_of(server)}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.usage.completion_tokens >= 1, "the openai client is served"
    reply = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0).messages.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.output_tokens >= 1, "the anthropic client is served"


def test_a_listed_name_is_served_and_others_are_not():
    config = ServerConfig(allowed_hosts=("llm.example.com", ".svc.cluster.local"))
    with ServerThread(create_app(tiny_engine(), config)) as url:
        def status(host: str) -> int:
            return httpx.get(url + "/v1/models", headers={"Host": host}).status_code

        assert status("llm.example.com") == 200 and status("LLM.example.com:8383") == 200, "a listed name"
        assert status("ferrox.default.svc.cluster.local:8383") == 200, "a name under a listed domain"
        assert status("attacker.example") == 421, "a name not listed"
        assert status("localhost") == 200, "the local names stay"


def refusal(policy: SameOrigin, method: str, headers: dict) -> int | None:
    try:
        policy.check(method, headers)
    except APIError as e:
        return e.status
    return None


def test_default_allowed_hosts_follow_the_bind():
    loopback = SameOrigin(ServerConfig(host="127.0.0.1"))
    assert refusal(loopback, "GET", {"Host": "rebound.example:8383"}) == 421, "a loopback server answers no names"
    assert refusal(loopback, "GET", {"Host": "localhost:8383"}) is None
    for bind in ("0.0.0.0", "::", "192.168.1.10"):
        remote = SameOrigin(ServerConfig(host=bind, api_key="k"))
        assert refusal(remote, "GET", {"Host": "llm.internal:8383"}) is None, \
            f"a server bound to {bind} is reached by whatever names its clients use"
    listed = SameOrigin(ServerConfig(host="0.0.0.0", api_key="k", allowed_hosts=("llm.internal",)))
    assert refusal(listed, "GET", {"Host": "other.internal"}) == 421, "--allowed-hosts narrows a remote bind"
    assert refusal(listed, "GET", {"Host": "10.4.0.7:8383"}) is None, "Kubernetes probes by pod IP pass"


def test_allowed_hosts_setting_is_validated_and_read_from_flag_and_variable():
    environ = {"FERROX_ALLOWED_HOSTS": "LLM.example.com, .svc.cluster.local"}
    config = cli.server_config(cli.build_parser(environ).parse_args(["serve"]))
    assert config.allowed_hosts == ("llm.example.com", ".svc.cluster.local"), "FERROX_ALLOWED_HOSTS reaches the server"
    args = cli.build_parser(environ).parse_args(["serve", "--allowed-hosts", "a.example"])
    assert cli.server_config(args).allowed_hosts == ("a.example",), "the flag wins over the variable"
    for bad in ("https://llm.example.com", "llm.example.com:8383", "*.example.com"):
        with pytest.raises(ValueError, match="allowed_hosts"):
            ServerConfig(allowed_hosts=(bad,))
