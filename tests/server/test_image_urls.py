"""Image URLs fetched from the hosts the operator allows (api/image_fetch.py), through a real server
over the tiny random Gemma 3 vision-language checkpoint (tests/support/tiny_vlm.py) and a real HTTP
server on 127.0.0.1 that plays the image host:

- a URL on a listed host is answered, with the text the same bytes inline give (the inline path is
  checked against HF in test_api_images.py), on OpenAI chat, Responses and Anthropic;
- a host not listed, a redirect to another host, a body over the byte limit (cut off: the image host
  could not write it all), a Content-Length over it, a slow host (timed out while a text request is
  answered meanwhile), a name listed but resolving to a loopback address not listed: each a 400 in
  the route's envelope naming what to do, and the server serves on;
- the address rules themselves (which addresses count as internal) on their own.

The tests list 127.0.0.1 explicitly: the image host is a loopback address, which no name reaches.
"""

from __future__ import annotations

import base64
import http.server
import io
import ipaddress
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

import httpx  # noqa: E402

from tests.support.tiny_vlm import make_tiny_vlm  # noqa: E402

MAX_IMAGE_BYTES = 64 * 1024  # the PNG below is ~6 KiB; the big bodies are far over
BIG_BODY_BYTES = 64 * 1024 * 1024  # what /big tries to send: a cut-off reader never lets it finish
SLOW_S = 4.0  # /slow answers after this; the fetch limit below is 1 s
FETCH_TIMEOUT_S = 1.0


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    PIL.fromarray(rng.integers(0, 256, (40, 52, 3)).astype(np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


IMAGE = _png(7)


class ImageHost:
    """A real HTTP server on 127.0.0.1: the image, redirects, a huge body, a slow answer."""

    def __init__(self) -> None:
        host = self
        self.hits: list[str] = []
        self.big_bytes_written = 0
        self.release = threading.Event()  # ends /slow's wait at teardown

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                host.hits.append(self.path)
                if self.path == "/cat.png":
                    self._send(200, IMAGE, {"Content-Type": "image/png"})
                elif self.path == "/same-host":
                    self._send(302, b"", {"Location": "/cat.png"})
                elif self.path == "/other-host":
                    self._send(302, b"", {"Location": f"http://localhost:{host.port}/cat.png"})
                elif self.path == "/declared-big":
                    self.send_response(200)
                    self.send_header("Content-Length", str(BIG_BODY_BYTES))
                    self.end_headers()
                elif self.path == "/big":  # no length: the body runs until the connection closes
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    chunk = b"\x89PNG" + bytes(64 * 1024 - 4)
                    try:
                        while host.big_bytes_written < BIG_BODY_BYTES:
                            self.wfile.write(chunk)
                            host.big_bytes_written += len(chunk)
                    except OSError:  # the reader hung up: the point
                        pass
                elif self.path == "/slow":
                    host.release.wait(SLOW_S)
                    self._send(200, IMAGE, {"Content-Type": "image/png"})
                else:
                    self._send(404, b"no such image", {})

            def _send(self, status, body, headers):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    yield host
    host.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, image_host):
    from api.app import create_app
    from api.config import ServerConfig
    from tests.support.server_harness import ServerThread, tiny_engine

    folder, _ = make_tiny_vlm(tmp_path_factory.mktemp("vlm-urls") / "tiny-gemma3-vlm")
    engine = tiny_engine(folder, block_size=4, kv_blocks=400, max_seqs=8, prefill_chunk=32, max_context=256)
    listed = ServerConfig(allowed_media_domains=("127.0.0.1",), max_image_bytes=MAX_IMAGE_BYTES,
                          media_fetch_timeout_s=FETCH_TIMEOUT_S)
    by_name = ServerConfig(allowed_media_domains=("localhost",), max_image_bytes=MAX_IMAGE_BYTES)
    with ServerThread(create_app(engine, listed)) as base, ServerThread(create_app(engine, by_name)) as named:
        yield base, named, engine, image_host


def _chat(base, engine, url, max_tokens=6):
    return httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": engine.model_name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "What is this?"}]}]})


def _refused(r, *words):
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    assert "Error" not in message and "Exception" not in message, message
    return message


def _serves_on(base, engine):
    ok = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text


def test_a_url_on_a_listed_host_answers_as_the_same_bytes_inline(served):
    base, _, engine, image_host = served
    inline = _chat(base, engine, "data:image/png;base64," + base64.b64encode(IMAGE).decode())
    fetched = _chat(base, engine, image_host.url("/cat.png"))
    assert inline.status_code == fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["message"]["content"] == inline.json()["choices"][0]["message"]["content"]
    assert fetched.json()["usage"]["prompt_tokens"] == inline.json()["usage"]["prompt_tokens"]
    redirected = _chat(base, engine, image_host.url("/same-host"))  # a redirect within the host is followed
    assert redirected.json()["choices"][0]["message"]["content"] == inline.json()["choices"][0]["message"]["content"]
    assert image_host.hits.count("/cat.png") >= 2


def test_responses_and_anthropic_fetch_too(served):
    base, _, engine, image_host = served
    r = httpx.post(base + "/v1/responses", timeout=60, json={
        "model": engine.model_name, "max_output_tokens": 2,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": image_host.url("/cat.png")},
                                               {"type": "input_text", "text": "Name it."}]}]})
    assert r.status_code == 200, r.text
    r = httpx.post(base + "/v1/responses", timeout=60, json={
        "model": engine.model_name, "max_output_tokens": 2,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": image_host.url("/x", "localhost")},
                                               {"type": "input_text", "text": "Name it."}]}]})
    _refused(r, "not among the allowed media domains", "--allowed-media-domains")
    r = httpx.post(base + "/v1/messages", timeout=60, headers={"anthropic-version": "2023-06-01"}, json={
        "model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": image_host.url("/cat.png")}},
            {"type": "text", "text": "Describe it."}]}]})
    assert r.status_code == 200, r.text
    r = httpx.post(base + "/v1/messages", timeout=60, headers={"anthropic-version": "2023-06-01"}, json={
        "model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": image_host.url("/missing.png")}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "answered HTTP 404" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, host, words", [
    ("/cat.png", "localhost", ("not among the allowed media domains", "--allowed-media-domains")),
    ("/other-host", "127.0.0.1", ("redirects to another host (localhost)",)),
    ("/declared-big", "127.0.0.1", (f"larger than {MAX_IMAGE_BYTES} bytes", "--max-image-bytes")),
    ("/cat.png", "[::1", ("not a valid URL",)),
])
def test_refusals_are_400s_and_the_server_serves_on(served, path, host, words):
    base, _, engine, image_host = served
    before = list(image_host.hits)
    _refused(_chat(base, engine, image_host.url(path, host)), *words)
    if host == "localhost":
        assert image_host.hits == before, "a host not listed must not be contacted at all"
    _serves_on(base, engine)


def test_a_body_over_the_limit_is_cut_off_early(served):
    base, _, engine, image_host = served
    _refused(_chat(base, engine, image_host.url("/big")), f"larger than {MAX_IMAGE_BYTES} bytes")
    time.sleep(0.5)  # the image host's writer notices the closed socket
    # Read to the end, the host would have written all 64 MiB; cut off, it stalls once the socket
    # buffers (a few MiB at most) are full and fails on the closed connection.
    assert image_host.big_bytes_written < BIG_BODY_BYTES // 4, image_host.big_bytes_written
    _serves_on(base, engine)


def test_a_slow_host_times_out_while_other_requests_are_answered(served):
    base, _, engine, image_host = served
    done: dict[str, float] = {}
    result = {}

    def slow():
        result["r"] = _chat(base, engine, image_host.url("/slow"))
        done["slow"] = time.monotonic()

    start = time.monotonic()
    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.2)  # the slow fetch is under way
    _serves_on(base, engine)
    done["text"] = time.monotonic()
    thread.join(60)
    assert done["text"] < done["slow"], "the text request waited for the slow image host"
    _refused(result["r"], f"did not arrive within {FETCH_TIMEOUT_S:g} s")
    assert done["slow"] - start < SLOW_S, "the fetch ran past its time limit to the host's answer"


def test_a_listed_name_resolving_to_a_loopback_address_is_refused(served):
    _, named, engine, image_host = served
    before = list(image_host.hits)
    _refused(_chat(named, engine, image_host.url("/cat.png", "localhost")),
             "resolves to", "internal", "--allowed-media-domains")
    assert image_host.hits == before, "an internal address must not be contacted"
    _serves_on(named, engine)


def test_no_url_is_fetched_by_default_and_the_setting_is_named():
    import asyncio

    from api import image_fetch
    from api.config import ServerConfig
    from api.errors import APIError

    assert ServerConfig().allowed_media_domains == ()
    rules = image_fetch.Rules((), MAX_IMAGE_BYTES, 1.0)
    with pytest.raises(APIError) as refused:
        asyncio.run(image_fetch.fetch("https://example.com/cat.png", rules, "messages"))
    assert refused.value.status == 400 and "FERROX_ALLOWED_MEDIA_DOMAINS" in str(refused.value)


@pytest.mark.parametrize("address, internal", [
    ("127.0.0.1", True), ("10.1.2.3", True), ("192.168.0.1", True), ("172.16.5.5", True),
    ("169.254.169.254", True), ("100.64.0.1", True), ("0.0.0.0", True), ("::1", True), ("fe80::1", True),
    ("fc00::1", True), ("::ffff:127.0.0.1", True), ("224.0.0.1", True),
    ("93.184.215.14", False), ("2606:4700::1111", False),
])
def test_internal_addresses(address, internal):
    from api.image_fetch import _is_internal

    assert _is_internal(ipaddress.ip_address(address)) is internal


def test_listed_addresses_and_networks():
    from api.image_fetch import Rules, _address_listed

    rules = Rules(("127.0.0.1", "10.0.0.0/8", ".example.com"), MAX_IMAGE_BYTES, 1.0)
    assert _address_listed(ipaddress.ip_address("127.0.0.1"), rules)
    assert _address_listed(ipaddress.ip_address("10.9.8.7"), rules)
    assert not _address_listed(ipaddress.ip_address("127.0.0.2"), rules), "one address lists that address only"
    assert not _address_listed(ipaddress.ip_address("192.168.1.1"), rules)


def test_fetches_beyond_the_slots_wait_for_one(image_host, monkeypatch):
    """With one slot, a fetch behind a slow one waits (inside its own time limit) and times out;
    alone, the same fetch is answered: the bound is what made it wait."""
    import asyncio

    from api import image_fetch
    from api.errors import APIError

    monkeypatch.setattr(image_fetch, "MAX_CONCURRENT_FETCHES", 1)
    quick, slow = image_fetch.Rules(("127.0.0.1",), MAX_IMAGE_BYTES, 0.5), image_fetch.Rules(("127.0.0.1",),
                                                                                            MAX_IMAGE_BYTES, 1.0)

    async def behind_a_slow_one():
        hold = asyncio.ensure_future(image_fetch.fetch(image_host.url("/slow"), slow, "a"))
        await asyncio.sleep(0.1)  # the slow fetch holds the slot
        try:
            with pytest.raises(APIError, match="did not arrive within 0.5 s"):
                await image_fetch.fetch(image_host.url("/cat.png"), quick, "b")
        finally:
            with pytest.raises(APIError):
                await hold

    asyncio.run(behind_a_slow_one())
    assert asyncio.run(image_fetch.fetch(image_host.url("/cat.png"), quick, "b")) == IMAGE


def test_the_setting_fills_the_config_and_a_bad_entry_stops_start_up():
    from api import cli

    args = cli.build_parser({"FERROX_ALLOWED_MEDIA_DOMAINS": "Images.Example.com, .cdn.example, 10.0.0.0/8"})
    assert cli.server_config(args.parse_args(["serve"])).allowed_media_domains == \
        ("images.example.com", ".cdn.example", "10.0.0.0/8")
    with pytest.raises(SystemExit, match="--allowed-media-domains .FERROX_ALLOWED_MEDIA_DOMAINS. must be host names"):
        cli.server_config(cli.build_parser({}).parse_args(["serve", "--allowed-media-domains", "https://x.com/a"]))
