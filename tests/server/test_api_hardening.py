"""Every request limit with its flag, connection limits through the real Hypercorn config
(`api.cli.hypercorn_config`), the non-streaming request timeout, the SSE orphan timeout,
and security: keys never logged, TLS with a self-signed certificate, the chat template
sandbox reached through the API. Real servers over the shared tiny engine."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import ssl
import subprocess
import threading

import httpx
import pytest

from api import cli
from api.app import create_app
from api.config import ServerConfig
from api.settings import env_defaults
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, parse_sse, tiny_engine, wait_for

LIMITS = ServerConfig(max_prompt_tokens=32, max_output_tokens=64, max_logprobs=5, max_n=2, max_stop_strings=2,
                      max_stop_chars=8, max_body_bytes=8192, max_header_bytes=4096, max_concurrent_requests=3)
LONG = dict(prompt="Hello world", max_tokens=CONTEXT_TOKENS - 16, temperature=0, ignore_eos=True)
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def serve(config: ServerConfig) -> ServerThread:
    return ServerThread(create_app(tiny_engine(), config), hypercorn_config=cli.hypercorn_config(config))


@pytest.fixture(scope="module")
def limited():
    with serve(LIMITS) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


def stats(http) -> dict:
    return http.get("/admin/stats").json()


def idle(http) -> bool:
    s = stats(http)
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["queue_depth"] == 0 and s["generating_now"] == 0


# ---------------------------------------------------------------- request limits


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/completions", {"prompt": [5] * 33, "max_tokens": 1}, "prompt", "prompt_too_long"),
    ("/v1/completions", {"prompt": [[5] * 3, [5] * 33], "max_tokens": 1}, "prompt", "prompt_too_long"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 40}]}, "messages",
     "prompt_too_long"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 65}, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 65}, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 65}, "max_completion_tokens", None),
    ("/v1/completions", {"prompt": "Hi", "n": 3}, "n", None),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c"]}, "stop", None),
    ("/v1/chat/completions", {**CHAT, "stop": "123456789"}, "stop", None),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 6}, "top_logprobs", None),
], ids=["prompt-ids", "one-of-prompts", "chat-prompt", "max_tokens", "chat-max_tokens", "max_completion_tokens",
        "n", "stop-count", "stop-length", "logprobs", "top_logprobs"])
def test_each_limit_is_a_400_naming_its_param(limited, path, body, param, code):
    r = limited.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [5] * 32, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 64, "n": 2, "stop": ["12345678", "x"], "logprobs": 5}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 64, "logprobs": True, "top_logprobs": 5}),
], ids=["prompt-at-limit", "completion-at-limits", "chat-at-limits"])
def test_requests_at_the_limits_are_served(limited, path, body):
    assert limited.post(path, json=body).status_code == 200


def test_output_cap_clamps_the_default_max_tokens(limited):
    r = limited.post("/v1/chat/completions", json={**CHAT, "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 64, "no max_tokens: room left, capped by --max-output-tokens"


def test_body_over_the_limit_is_413(limited):
    r = limited.post("/v1/completions", content=json.dumps({"prompt": "x" * 9000}),
                     headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_headers_over_the_limit_are_431_and_the_server_keeps_serving(limited):
    r = limited.get("/v1/models", headers={"X-Padding": "a" * 5000})  # arrives whole: the app's guard
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large", r.text
    try:  # headers larger than one read stay incomplete: Hypercorn's h11 limit answers first
        huge = limited.get("/v1/models", headers={"X-Padding": "a" * 200_000})
        assert huge.status_code in (400, 431)
    except httpx.TransportError:
        pass  # or it closes the connection: either way nothing reached the handlers
    assert limited.get("/v1/models", headers={"X-Padding": "a" * 1000}).status_code == 200


def test_concurrent_requests_over_the_cap_get_503_and_probes_still_answer(limited):
    wait_for(lambda: idle(limited))
    url = str(limited.base_url)
    with httpx.Client(base_url=url, timeout=60) as a, httpx.Client(base_url=url, timeout=60) as b, \
            a.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 64, "stream": True}) as one, \
            b.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 64, "stream": True}) as two:
        assert one.status_code == two.status_code == 200
        # two streams + this request = the cap of 3; the fourth is refused before Quart
        r = limited.get("/v1/models")
        assert r.status_code == 200
        with httpx.Client(base_url=url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 64, "stream": True}) as three:
            assert three.status_code == 200
            r = limited.get("/v1/models")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_requests"
            assert limited.get("/health").status_code == 200, "probes are not counted"
            three.read()
        one.read()
        two.read()
    assert stats(limited)["http_refused_concurrency"] >= 1
    wait_for(lambda: limited.get("/v1/models").status_code == 200)


def test_safe_defaults():
    config = ServerConfig()
    assert (config.max_body_bytes, config.max_n, config.max_stop_strings, config.max_stop_chars) == (
        4 * 1024 * 1024, 16, 16, 256)
    assert (config.max_logprobs, config.max_concurrent_requests, config.max_header_bytes) == (20, 1024, 65536)
    assert (config.request_timeout_s, config.sse_orphan_timeout_ms) == (600.0, 30_000)
    assert config.max_prompt_tokens == config.max_output_tokens == 0, "0: the context ceiling decides"
    hc = cli.hypercorn_config(config)
    assert (hc.backlog, hc.h11_max_incomplete_size, hc.keep_alive_timeout) == (128, 65536, 5.0)
    assert hc.read_timeout is None, "a read timeout would close clients reading long streams"


def test_limit_variables_reach_the_config():
    environ = {"FERROX_MAX_PROMPT_TOKENS": "100", "FERROX_MAX_OUTPUT_TOKENS": "50", "FERROX_MAX_LOGPROBS": "3",
               "FERROX_MAX_CONCURRENT_REQUESTS": "9", "FERROX_MAX_HEADER_BYTES": "2048", "FERROX_BACKLOG": "7",
               "FERROX_KEEP_ALIVE_TIMEOUT": "2.5", "FERROX_REQUEST_TIMEOUT": "30",
               "FERROX_SSE_ORPHAN_TIMEOUT_MS": "1500"}
    config = cli.server_config(cli.build_parser(environ).parse_args(["serve"]))
    assert (config.max_prompt_tokens, config.max_output_tokens, config.max_logprobs) == (100, 50, 3)
    assert (config.max_concurrent_requests, config.max_header_bytes, config.backlog) == (9, 2048, 7)
    assert (config.keep_alive_timeout_s, config.request_timeout_s, config.sse_orphan_timeout_ms) == (2.5, 30.0, 1500)
    hc = cli.hypercorn_config(config)
    assert (hc.backlog, hc.h11_max_incomplete_size, hc.keep_alive_timeout) == (7, 2048, 2.5)


@pytest.mark.parametrize("name,value", [("FERROX_SSE_ORPHAN_TIMEOUT_MS", "0"), ("FERROX_REQUEST_TIMEOUT", "0"),
                                        ("FERROX_MAX_CONCURRENT_REQUESTS", "none")])
def test_bad_limit_variables_stop_start_up_naming_them(name, value):
    with pytest.raises(SystemExit, match=name):
        env_defaults({name: value})


def test_max_logprobs_cannot_exceed_the_engine():
    with pytest.raises(ValueError, match="max_logprobs"):
        ServerConfig(max_logprobs=21)


# ---------------------------------------------------------------- timeouts


def test_a_slow_whole_request_is_504_and_cancelled_streams_are_not_timed():
    with serve(ServerConfig(request_timeout_s=0.3)) as url, httpx.Client(base_url=url, timeout=60) as http:
        wait_for(lambda: idle(http))
        before = stats(http)["aborted"]
        r = http.post("/v1/completions", json=LONG)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "request_timeout" and "0.3 s" in r.json()["error"]["message"]
        wait_for(lambda: idle(http) and stats(http)["aborted"] == before + 1)
        events = parse_sse(http.post("/v1/completions", json={**LONG, "max_tokens": 600, "stream": True}).text)
        assert events[-1] == "[DONE]", "--request-timeout does not apply to streams"


def test_a_stream_whose_client_reads_nothing_is_cancelled_after_the_orphan_timeout():
    with serve(ServerConfig(sse_orphan_timeout_ms=300)) as url, httpx.Client(base_url=url, timeout=60) as http:
        wait_for(lambda: idle(http))
        before = stats(http)
        # 4 choices x 2000 tokens x ~0.7 KB per event (20 logprobs): ~6 MB, more than Linux's
        # socket buffers take (server send buffer up to 4 MiB), so the server's sends block.
        # (4 x ceil(2005 / 16) = 504 blocks: within the shared engine's 511)
        body = json.dumps({**LONG, "max_tokens": 2000, "stream": True, "logprobs": 20, "n": 4}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill the buffers fast
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            # ...and never read, never close
            wait_for(lambda: stats(http)["sse_orphaned"] == before["sse_orphaned"] + 1, timeout_s=30)
            wait_for(lambda: idle(http))
            s = stats(http)
            assert s["aborted"] == before["aborted"] + 1, "the job was cancelled, not finished"
            record = s["recent"][-1]
            assert record["stream"] and record["status"] == 499
            assert record["completion_tokens"] < 4 * 2000, "cut short, not run to the end"
            # Without reading: a read would drain the buffers and let a graceful close finish.
            wait_for(lambda: not is_established(sock), timeout_s=10)
        finally:
            sock.close()
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def is_established(sock: socket.socket) -> bool:
    """The client side's TCP state (Linux TCP_INFO): ESTABLISHED until the server's reset
    arrives, and also while a graceful close waits forever for the client to read."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 1  # TCP_ESTABLISHED


# ---------------------------------------------------------------- security


def test_api_keys_are_never_logged(caplog, capfd):
    key, wrong = "sk-live-7d1e0c5aa9", "sk-wrong-0b9f3e2d"
    caplog.set_level(logging.DEBUG)
    config = ServerConfig(api_key=key)
    with serve(config) as url:
        good, bad = {"Authorization": f"Bearer {key}"}, {"Authorization": f"Bearer {wrong}"}
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, headers=bad).status_code == 401
        assert httpx.get(url + "/admin/stats", headers={"Authorization": wrong}).status_code == 401
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=good).status_code == 200
        stream = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True}, headers=good)
        assert parse_sse(stream.text)[-1] == "[DONE]"
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "n": 0}, headers=good).status_code == 400
        assert httpx.get(url + "/admin/stats", headers=good).status_code == 200
    captured = capfd.readouterr()
    logged = caplog.text + captured.out + captured.err
    assert caplog.records, "the check needs log records to look at"
    assert key not in logged and wrong not in logged


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        from cryptography import x509  # noqa: F401
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available to make a certificate")
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        return cert, key
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now)
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key


def test_tls_serves_https_with_the_given_certificate(tmp_path):
    cert, key = _self_signed(tmp_path)
    config = ServerConfig(tls_cert=str(cert), tls_key=str(key))
    assert config.url.startswith("https://")
    with serve(config) as url:
        assert url.startswith("https://")
        with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(cert)), timeout=30) as https:
            assert https.get("/health").status_code == 200
            r = https.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)


def test_tls_needs_cert_and_key_together():
    for half in ({"tls_cert": "c.pem"}, {"tls_key": "k.pem"}):
        with pytest.raises(ValueError, match="together"):
            ServerConfig(**half)


@pytest.fixture(scope="module")
def plain():
    with serve(ServerConfig()) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield http


def test_template_syntax_in_a_message_is_only_text(plain):
    attack = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for x in range(10**9) %}{% endfor %}"
    r = plain.post("/v1/tokenize", json={"messages": [{"role": "user", "content": attack}]})
    assert r.status_code == 200
    text = plain.post("/v1/detokenize", json={"tokens": r.json()["tokens"]}).json()["text"]
    assert attack in text, "message content is data, never evaluated"
    assert plain.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": attack}],
                                                     "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
])
def test_a_template_reaching_python_internals_is_a_clean_400(plain, monkeypatch, template):
    tokenizer = tiny_engine().tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", template)
    monkeypatch.setattr(tokenizer, "_compiled_template", None)
    r = plain.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "chat_template_error" and r.json()["error"]["param"] == "messages"
    assert plain.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    monkeypatch.undo()
    assert plain.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200


def test_a_stream_started_in_another_thread_is_unaffected_by_limits_checks(limited):
    # A refusal on one connection never disturbs a stream on another.
    url = str(limited.base_url)
    out: list = []
    t = threading.Thread(target=lambda: out.append(httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "Hi", "max_tokens": 32, "ignore_eos": True, "stream": True}).text))
    t.start()
    for _ in range(5):
        assert limited.post("/v1/completions", json={"prompt": "Hi", "n": 3}).status_code == 400
    t.join(60)
    assert parse_sse(out[0])[-1] == "[DONE]"
