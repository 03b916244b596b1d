"""A real Hypercorn server on 127.0.0.1 in a background thread, over the real engine.

`tiny_engine(checkpoint, **limits)` builds (once per process, checkpoint and set of
limits) an `Engine` over a tiny random Llama checkpoint (`api_checkpoint()`, made by
`tiny_model.make_tiny_checkpoint`; "default" gives the embedded SmolLM2), warmed up and
started, its batcher driving a `tests/support/faults.py:FaultyRunner` (`engine.runner`: inert until
a test cues a fault); engines are shared by every test module that asks for the same
limits and shut down at exit. `ServerThread(app)` serves a Quart app on a free loopback port with its own
event loop; `with ServerThread(app) as base_url:` stops it cleanly (Hypercorn's shutdown
trigger, then the thread joins). Test modules start one server per module.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

_engines: dict[tuple, Any] = {}
_checkpoint: Path | None = None
CONTEXT_TOKENS = 2048

# The shared engine: 2048-token context (the tiny model's trained length), 16-position
# blocks, 32 decode rows so 32 concurrent streams all decode at once. The persistent
# compile cache is configured by tests/conftest.py (JAX_COMPILATION_CACHE_DIR).
DEFAULT_LIMITS = dict(block_size=16, kv_blocks=512, max_seqs=32, max_queue=64, prefill_chunk=64, max_context=None)


def api_checkpoint() -> Path:
    """The tiny Llama the API tests serve, with a 2048-token trained context: long enough
    that a 2000-token generation outlasts any client action a test takes mid-stream
    (decode runs ~1 ms per step here, so 500 tokens could end before a loaded CI box
    delivers the first chunk)."""
    global _checkpoint
    if _checkpoint is None:
        from tests.support.tiny_model import make_tiny_checkpoint

        root = tempfile.mkdtemp(prefix="ferrox_api_")
        atexit.register(shutil.rmtree, root, True)
        _checkpoint = make_tiny_checkpoint(Path(root) / "tiny-chat", max_position_embeddings=CONTEXT_TOKENS)
    return _checkpoint


def tiny_engine(checkpoint: Any = None, **limits: Any) -> Any:
    """A warmed, started Engine over `checkpoint` (default: `api_checkpoint()`); one per
    distinct (checkpoint, limits)."""
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    checkpoint = checkpoint or api_checkpoint()
    merged = {**DEFAULT_LIMITS, **limits}
    key = (str(checkpoint), *sorted(merged.items()))
    if key not in _engines:
        from tests.support.faults import FaultyRunner

        # The batcher drives a fault-injection wrapper, inert until a test cues it (engine.runner).
        engine = Engine.load(EngineConfig(model=str(checkpoint), dtype="float32", **merged), wrap_runner=FaultyRunner)
        engine.warmup()
        engine.start()
        _engines[key] = engine
        atexit.register(engine.shutdown)
    return _engines[key]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Hypercorn serving `app` on 127.0.0.1:<free port> from a daemon thread."""

    def __init__(self, app: Any, port: int | None = None, hypercorn_config: Any = None) -> None:
        """`hypercorn_config`: a `hypercorn.config.Config` to serve with (e.g. from
        `api.cli.hypercorn_config`, for TLS and connection limits); its bind is replaced."""
        self.app = app
        self.port = port or free_port()
        self.hypercorn_config = hypercorn_config
        scheme = "https" if hypercorn_config is not None and hypercorn_config.certfile else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, wait_ready: bool = True, timeout_s: float = 60.0) -> str:
        started = threading.Event()

        def run() -> None:
            from hypercorn.asyncio import serve
            from hypercorn.config import Config

            config = self.hypercorn_config or Config()
            config.bind = [f"127.0.0.1:{self.port}"]
            config.accesslog = None
            config.graceful_timeout = 2.0
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._stop = asyncio.Event()
            started.set()
            try:
                self._loop.run_until_complete(serve(self.app, config, shutdown_trigger=self._stop.wait))
            except BaseException as e:  # reported by stop()
                self._error = e
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name=f"hypercorn-{self.port}", daemon=True)
        self._thread.start()
        started.wait(10)
        deadline = time.monotonic() + timeout_s
        while True:  # wait until the port answers (and, if asked, /health says ready)
            try:
                r = httpx.get(self.base_url + "/health", timeout=2.0, verify=False)
                if not wait_ready or r.status_code == 200:
                    return self.base_url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on {self.base_url} not up after {timeout_s} s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15)
            assert not self._thread.is_alive(), "server thread did not stop"
        if self._error is not None:
            raise self._error

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.02) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def parse_sse(text: str) -> list[Any]:
    """SSE body -> list of decoded data payloads ("[DONE]" kept as the string)."""
    import json

    events = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def templated_checkpoint(chat_template: str, folder: Path) -> Path:
    """A copy of `api_checkpoint()` at `folder` whose chat template is `chat_template` (the
    same weights and tokenizer)."""
    folder = shutil.copytree(api_checkpoint(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return folder


@contextlib.contextmanager
def templated_server(chat_template: str, name: str = "tiny-templated"):
    """A server over a copy of `api_checkpoint()` whose chat template is `chat_template`
    (the same weights and tokenizer); yields its base URL."""
    root = Path(tempfile.mkdtemp(prefix="ferrox_template_"))
    folder = templated_checkpoint(chat_template, root / name)
    try:
        from api.app import create_app
        from api.config import ServerConfig

        with ServerThread(create_app(tiny_engine(folder), ServerConfig())) as url:
            yield url
    finally:
        shutil.rmtree(root, ignore_errors=True)


def wait_for_serve_process(proc: Any, url: str, log_path: Path, timeout_s: float, interval_s: float = 0.1) -> None:
    """Wait until a `ferrox serve` subprocess answers /health with 200; fail with the tail
    of its log if it exits first, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"ferrox serve exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"ferrox serve not ready after {timeout_s:g} s"
        time.sleep(interval_s)
