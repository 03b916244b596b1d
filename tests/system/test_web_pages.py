"""The chat page and the dashboard in a real browser: headless Chromium (Debian's
`chromium`, which `make test` installs) driven by Playwright, against a real server on
the shared tiny engine.

Every page test fails on any console error or uncaught exception in the page. Without a
Chromium the module skips, except under CI (`CI=true`), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading

import httpx
import numpy as np
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine, wait_for

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
def lora_server(tmp_path_factory):
    """A keyless server over a tiny base model with LoRA adapter `a1` loaded at start-up and
    `a2` under --model-dir for loading at runtime (test_api_lora's engine limits: its
    compiles are cached)."""
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from tests.support.lora_helpers import make_peft_adapter
    from tests.support.tiny_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("web-lora")
    base = make_tiny_checkpoint(root / "tiny-base", max_position_embeddings=256)
    adapter = make_peft_adapter(base, root / "a1", seed=1, r=4)
    make_peft_adapter(base, root / "a2", seed=2, r=8)
    engine = Engine.load(EngineConfig(model=str(base), dtype="float32", block_size=16, kv_blocks=64, max_seqs=4,
                                      max_queue=8, prefill_chunk=32, max_context=256, max_loras=3, max_lora_rank=8,
                                      lora_modules=(("a1", str(adapter)),)))
    engine.warmup()
    engine.start()
    try:
        with ServerThread(create_app(engine, ServerConfig(model_dir=str(root), enable_runtime_lora=True))) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    """A keyless server over the tiny Gemma 3 vision-language checkpoint (tests/support/tiny_vlm.py)."""
    from tests.support.tiny_vlm import make_tiny_vlm

    folder, _ = make_tiny_vlm(tmp_path_factory.mktemp("web-vlm") / "tiny-gemma3-vlm")
    engine = tiny_engine(folder, block_size=4, kv_blocks=400, max_seqs=8, prefill_chunk=32, max_context=256)
    with ServerThread(create_app(engine, ServerConfig())) as url:
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


def test_an_idle_dashboards_axes_read_as_plain_numbers(page, server):
    """With nothing to draw, a chart's value axis was scaled to 1e-9 and its ticks read
    "0.0000000015", clipped to "000015" by the margin."""
    page.goto(server + "/dashboard")
    page.wait_for_function("() => Number(document.querySelector('[data-chart=kv]')?.dataset.samples) >= 2")
    charts = page.evaluate("""() => [...document.querySelectorAll('[data-chart]')].map((chart) => ({
        id: chart.dataset.chart, max: Number(chart.dataset.max),
        ticks: [...chart.querySelectorAll('.axis text')].filter((t) => t.getAttribute('x') === '40')
                                                        .map((t) => t.textContent)}))""")  # x = PLOT.left - 6
    for chart in charts:
        assert chart["ticks"] and all(re.fullmatch(r"\d{1,4}(\.\d{1,2})?[kM%]?", t) for t in chart["ticks"]), \
            f"plain, short tick labels: {chart}"
    idle = [c for c in charts if c["max"] == 0 and c["id"] not in ("prefix", "scheduler")]  # neither has its own floor
    assert idle, f"no chart is idle: {charts}"
    for chart in idle:
        assert chart["ticks"] == ["0", "0.5", "1"], f"an idle chart gets a 0..1 axis: {chart}"


def test_a_keyless_server_offers_no_key_controls_unless_a_key_is_stored(page, server):
    """A server without a key used to offer "Forget key" on both pages."""
    for path in ("/", "/dashboard"):
        page.goto(server + path)
        page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
        assert not page.is_visible("#forget-key"), f"{path}: no key was asked for or stored"
    page.evaluate("localStorage.setItem('ferrox.apiKey', 'left from another server')")
    page.reload()
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    assert page.is_visible("#forget-key"), "a stored key can be forgotten"
    page.click("#forget-key")
    assert not page.is_visible("#forget-key") and page.evaluate("localStorage.getItem('ferrox.apiKey')") is None


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
    assert page.is_visible("#forget-key"), "a server that asked for a key offers to forget it"
    page.goto(keyed_server + "/dashboard")  # the key is kept for this origin
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    assert not page.is_visible("#key-dialog") and page.is_visible("#forget-key")


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


def test_the_chat_page_picks_a_lora_adapter_from_v1_models(page, lora_server):
    """The chat page had no model picker: a loaded adapter could not be chosen there."""
    page.goto(lora_server + "/")
    page.wait_for_function("() => document.querySelectorAll('#model-picker option').length === 2")
    options = page.eval_on_selector_all("#model-picker option", "(os) => os.map((o) => o.value)")
    assert options == ["tiny-base", "a1"], "the base model first, then its adapters"
    page.select_option("#model-picker", "a1")
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'a1'")
    assert "tiny-base" in page.inner_text("#card-list"), "the card names the adapter's base model"
    set_field(page, "#temperature", "0")
    set_field(page, "#max_tokens", "8")
    with page.expect_request("**/v1/chat/completions") as sent:
        send(page, "Hello adapter")
    assert json.loads(sent.value.post_data)["model"] == "a1", "the request asks for the chosen adapter"
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=30_000)
    api = httpx.post(lora_server + "/v1/chat/completions", timeout=60, json={
        "model": "a1", "messages": [{"role": "user", "content": "Hello adapter"}], "temperature": 0, "top_p": 0.95,
        "max_tokens": 8}).json()
    assert page.locator(".msg.assistant .bubble").inner_text() == api["choices"][0]["message"]["content"]

    r = httpx.post(lora_server + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "a2"}, timeout=60)
    assert r.status_code == 200, r.text
    page.click("#model-picker")  # opening the picker reads /v1/models again
    page.wait_for_function("() => [...document.querySelectorAll('#model-picker option')].some((o) => o.value === 'a2')")
    page.keyboard.press("Escape")
    assert page.input_value("#model-picker") == "a1", "the choice survives the refresh"


def test_an_attached_image_goes_with_the_message(page, vision_server, tmp_path):
    """The Image button (shown for a model taking images) attaches a file; the message goes as an
    image_url part plus the text, and the reply is what the API answers for the same request."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (36, 48, 3)).astype(np.uint8), "RGB").save(buf, "PNG")
    (tmp_path / "picture.png").write_bytes(buf.getvalue())
    page.goto(vision_server + "/")
    page.wait_for_selector("#attach:not(.hidden)")
    page.set_input_files("#image-file", str(tmp_path / "picture.png"))
    page.wait_for_selector("#attachments .thumb")
    set_field(page, "#seed", "3")
    set_field(page, "#max_tokens", "12")
    send(page, "What is in it?")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
    shown = page.locator(".msg.assistant").last.locator(".bubble").inner_text()
    assert page.locator(".msg.user .thumb").count() == 1 and page.locator("#attachments .thumb").count() == 0
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    api = httpx.post(vision_server + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "What is in it?"}]}],
        "temperature": 0.7, "top_p": 0.95, "max_tokens": 12, "seed": 3}).json()
    assert shown == api["choices"][0]["message"]["content"]


def test_a_text_model_shows_no_image_button(page, server):
    page.goto(server + "/")
    page.wait_for_function("() => document.querySelector('#model-name').textContent === 'tiny-chat'")
    assert page.locator("#attach").is_hidden()
