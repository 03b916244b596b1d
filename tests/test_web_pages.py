"""The chat page and the dashboard in a real browser: headless Chromium (Debian's
`chromium`, which `make test` installs) driven by Playwright, against a real server on
the shared tiny engine.

Every page test fails on any console error or uncaught exception in the page. Without a
Chromium the module skips, except under CI (`CI=true`), where that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.server_harness import ServerThread, tiny_engine, wait_for

playwright_api = pytest.importorskip("playwright.sync_api")
KEY = "web-test-key"
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False}


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "no chromium on PATH (Debian's package; `make test` installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server():
    with ServerThread(create_app(tiny_engine(), ServerConfig(api_key=KEY))) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    with playwright_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start;
        # --disable-dev-shm-usage: containers often give /dev/shm only 64 MiB.
        b = p.chromium.launch(executable_path=path,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


# Chromium logs every 401 answer as a console error; for a keyed server that is how the
# page learns it needs a key, so those (and only those) are expected there.
REFUSED_KEY_LOG = "the server responded with a status of 401"


@pytest.fixture
def page(browser, request):
    """A fresh browser context's page; the test fails on any console error or page exception."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    problems: list[str] = []
    expected = REFUSED_KEY_LOG if "keyed_server" in request.fixturenames else None

    def on_console(message) -> None:
        if message.type == "error" and not (expected and expected in message.text):
            problems.append(f"console.{message.type}: {message.text}")

    tab.on("console", on_console)
    tab.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    yield tab
    context.close()
    assert not problems, f"the page logged errors: {problems}"


def stats(url: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + "/admin/stats", headers=headers, timeout=10).json()


def set_field(tab, selector: str, value: str) -> None:
    tab.fill(selector, value)
    tab.dispatch_event(selector, "input")


def send(tab, text: str) -> None:
    tab.fill("#input", text)
    tab.click("#send")


def add_to_chat_requests(tab, extra: dict) -> None:
    """Merge `extra` into every chat request the page sends (settings the page has no control for)."""
    def handle(route):
        body = {**json.loads(route.request.post_data), **extra}
        route.continue_(post_data=json.dumps(body))

    tab.route("**/v1/chat/completions", handle)


def test_chat_page_loads_with_the_model_card(page, server):
    page.goto(server + "/")
    page.wait_for_function("() => document.querySelectorAll('#card-list dd').length >= 5")
    card = dict(zip(page.locator("#card-list dt").all_inner_texts(), page.locator("#card-list dd").all_inner_texts()))
    assert page.inner_text("#model-name") == card["model"] == "tiny-chat"
    assert card["context"] == "2048 tokens" and card["architecture"] == "LlamaForCausalLM"
    assert page.inner_text("#state") == "ready"


def test_a_message_streams_a_reply_equal_to_the_api_answer(page, server):
    page.goto(server + "/")
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    set_field(page, "#seed", "3")
    set_field(page, "#max_tokens", "40")
    send(page, "Tell me a story")
    reply = page.locator(".msg.assistant").last
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=30_000)
    shown = reply.locator(".bubble").inner_text()
    assert int(reply.get_attribute("data-chunks")) >= 3, "the reply was shown as its chunks arrived"
    assert "tokens" in reply.locator(".meta").inner_text()
    api = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 0.7, "top_p": 0.95,
        "max_tokens": 40, "seed": 3}).json()
    assert shown == api["choices"][0]["message"]["content"], "the page shows what the API answers for its settings"


def test_stop_cancels_the_request_and_its_blocks_come_back(page, server):
    before = stats(server)
    page.goto(server + "/")
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    set_field(page, "#max_tokens", "2000")
    add_to_chat_requests(page, {"ignore_eos": True})  # a reply that would run for 2000 tokens
    send(page, "Go on forever")
    page.wait_for_function("() => (document.querySelector('.msg.assistant .bubble') || {}).textContent?.length > 0")
    assert stats(server)["running_rows"] >= 1
    page.click("#stop")
    reply = page.locator(".msg.assistant").last
    page.wait_for_selector(".msg.assistant[data-state=stopped]")
    assert reply.locator(".meta").inner_text() == "stopped"
    request_id = reply.get_attribute("data-request-id")
    after = wait_for(lambda: (s := stats(server))["running_rows"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
                     and s)
    assert after["aborted"] == before["aborted"] + 1, "the server cancelled the job"
    record = next(r for r in after["recent"] if r["id"] == request_id)
    assert record["status"] == 499 and record["completion_tokens"] < 2000
    assert page.is_visible("#send") and not page.is_visible("#stop")


def test_json_schema_mode_returns_json_matching_the_schema(page, server):
    page.goto(server + "/")
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    page.check("#json-mode")
    page.fill("#schema", json.dumps(SMALL_SCHEMA))
    set_field(page, "#temperature", "0")
    send(page, "Is it ok?")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=30_000)
    assert set(json.loads(page.locator(".msg.assistant .bubble").inner_text())) == {"ok"}
    assert "finish: stop" in page.locator(".msg.assistant .meta").inner_text()
    page.fill("#schema", "{not json")
    send(page, "again")
    assert "does not parse" in page.inner_text("#schema-error")


def test_the_pages_ask_for_the_key_when_the_server_has_one(page, keyed_server):
    page.goto(keyed_server + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "wrong")
    page.click("#key-save")
    page.wait_for_function("() => document.querySelector('#key-note').textContent.includes('refused')")
    page.fill("#key-input", KEY)
    page.click("#key-save")
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    page.goto(keyed_server + "/dashboard")  # the key is kept for this origin
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    assert not page.is_visible("#key-dialog")


def test_the_dashboard_charts_move_while_a_load_runs(page, server):
    page.goto(server + "/dashboard")
    chart = "document.querySelector('[data-chart={}]')"
    page.wait_for_function(f"() => Number({chart.format('kv')}?.dataset.samples) >= 2")

    done = threading.Event()

    def load():  # until the charts have seen it: a loaded machine may poll late
        with httpx.Client(base_url=server, timeout=120) as http:
            while not done.is_set():
                threads = [threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": {
                    "prompt": f"load {i}", "max_tokens": 100, "ignore_eos": True}}) for i in range(6)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

    runner = threading.Thread(target=load)
    runner.start()
    try:
        for name in ("throughput", "scheduler", "itl"):  # output tok/s, running rows, inter-token latency
            page.wait_for_function(f"() => Number({chart.format(name)}.dataset.max) > 0", timeout=180_000)
    finally:
        done.set()
        runner.join()
    page.wait_for_function(f"() => Number({chart.format('ttft')}.dataset.max) > 0", timeout=10_000)
    assert float(page.get_attribute("[data-chart=kv]", "data-max")) > 0
    assert page.locator("[data-chart=throughput] path.line").count() >= 1
    assert page.inner_text("#state") == "ready"


def test_the_pages_are_static_files_with_a_strict_policy(server, keyed_server):
    for url in (server, keyed_server):  # no key needed for the pages themselves
        r = httpx.get(url + "/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert httpx.get(url + "/web/dashboard.js").headers["content-type"].startswith("text/javascript")
        assert httpx.get(url + "/web/app.py").status_code == 404
        assert httpx.get(url + "/web/..%2Fapp.py").status_code == 404
    assert httpx.get(keyed_server + "/v1/models").status_code == 401, "what the pages show stays behind the key"
    assert httpx.get(keyed_server + "/admin/stats").status_code == 401
    before = stats(server)["requests_total"]
    httpx.get(server + "/dashboard")
    assert stats(server)["requests_total"] == before, "page loads are not API requests"


def test_no_web_ui_turns_the_pages_off():
    from api.cli import build_parser, server_config

    assert server_config(build_parser().parse_args(["serve", "--no-web-ui"])).web_ui is False
    assert server_config(build_parser({"FERROX_WEB_UI": "0"}).parse_args(["serve"])).web_ui is False
    assert server_config(build_parser().parse_args(["serve"])).web_ui is True
    with ServerThread(create_app(tiny_engine(), ServerConfig(web_ui=False))) as url:
        for path in ("/", "/dashboard", "/web/chat.js"):
            r = httpx.get(url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
