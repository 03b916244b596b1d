"""Screenshots of the chat page and the dashboard, serving a real model (docs/web-chat.png,
docs/web-dashboard.png).

    python -m tools.docs.web_screenshots [--model default] [--load-s 40]

Starts `ferrox serve` on a free loopback port, opens the chat page in headless Chromium
(Debian's `chromium`, driven by Playwright), holds a short conversation (a plain reply and
one in JSON-schema mode), then opens the dashboard and runs a bounded load (streams that
share a system prompt, so the prefix cache has something to hit) while it draws, and
writes both pictures. Everything stays on 127.0.0.1 and the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

DOCS = Path(__file__).resolve().parents[2] / "docs"
SYSTEM = "You are a concise assistant for a team that runs inference servers. Answer in one or two sentences."
QUESTIONS = ["What is a KV cache?", "Why batch requests?", "What does prefill mean?", "Name a GPU.",
             "What is a token?", "Why stream replies?", "What is quantization?", "What is a prefix cache?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: str, port: int):
    # A small KV budget (0.125 GiB: ~180 blocks of SmolLM2) so the KV chart shows the load.
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--model", model, "--port", str(port),
                             "--kv-memory-gib", "0.125", "--log-level", "warning"], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"ferrox serve exited {proc.returncode}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "ferrox serve did not become ready"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def load(url: str, seconds: float, concurrency: int = 6) -> None:
    """Streams chat requests for `seconds` from `concurrency` threads (bounded in time and count)."""
    stop = time.monotonic() + seconds

    def worker(k: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            i = k
            while time.monotonic() < stop and i < 400:
                body = {"messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                        "max_tokens": 64 + 16 * (i % 4), "temperature": 0.7, "seed": i}
                http.post("/v1/chat/completions", json=body)
                i += concurrency

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def chat_screenshot(page, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_function("() => document.querySelectorAll('#card-list dd').length >= 5")
    page.fill("#system", "You are a helpful assistant. Keep answers short.")
    page.fill("#seed", "7")
    page.fill("#max_tokens", "96")
    for text, json_mode in (("In two sentences: why do inference servers batch requests?", False),
                            ("Give a one-word answer and your confidence: what is the capital of France?", True)):
        if json_mode:
            page.check("#json-mode")
        page.fill("#input", text)
        page.click("#send")
        page.wait_for_function("() => document.body.dataset.streaming === '0'", timeout=120_000)
    page.uncheck("#json-mode")
    page.screenshot(path=str(DOCS / "web-chat.png"))


def dashboard_screenshot(page, url: str, load_s: float) -> None:
    page.goto(url + "/dashboard")
    page.select_option("#span", "60")
    runner = threading.Thread(target=load, args=(url, load_s))
    runner.start()
    time.sleep(load_s - 3)  # while the load still runs
    page.screenshot(path=str(DOCS / "web-dashboard.png"), full_page=True)
    runner.join()


def main(argv: list[str] | None = None) -> int:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--load-s", type=float, default=40.0, help="seconds of load while the dashboard draws")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium")
    if chromium is None:
        print("no chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 1
    with serve(args.model, free_port()) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 820})
        chat_screenshot(page, url)
        page.set_viewport_size({"width": 1280, "height": 1040})
        dashboard_screenshot(page, url, args.load_s)
        browser.close()
    print(f"wrote {DOCS / 'web-chat.png'} and {DOCS / 'web-dashboard.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
