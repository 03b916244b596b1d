"""What `ferrox serve` offers a parent process that starts it: a free port, ready lines on
stdout, and an exit when the parent goes away.

- `--port 0` binds a free port before Hypercorn starts (the socket is handed to it as
  `fd://N`), so the address is known at once.
- Two lines on stdout, one JSON object each, flushed: `{"event": "listening", "url",
  "host", "port"}` as serving starts (with `--port 0` the socket already listens; `/health`
  answers `loading` until the model is warm) and
  `{"event": "ready", "url", "host", "port", "model"}` once `/health` turns ready. Nothing
  else is written to stdout (logs and progress bars go to stderr), so a parent reads lines
  until `"event": "ready"`. A load that fails prints no ready line; the process exits 1.
- `--exit-on-stdin-close`: a thread reads stdin to its end; at end of file the server
  drains and exits as on SIGTERM (a parent holding the pipe's other end takes the server
  with it when it dies, however it dies).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from typing import Any, Callable

from api.config import ServerConfig

READY_POLL_S = 0.05


def bind_free_port(config: ServerConfig, backlog: int) -> socket.socket:
    """A listening TCP socket on `config.host` and a port the kernel picks."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, 0))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def url_of(config: ServerConfig, port: int) -> str:
    scheme = "https" if config.tls_cert else "http"
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{scheme}://{host}:{port}"


def print_event(event: str, url: str, host: str, port: int, **extra: Any) -> None:
    """One JSON line on stdout, flushed at once (a parent may be waiting on it)."""
    sys.stdout.write(json.dumps({"event": event, "url": url, "host": host, "port": port, **extra}) + "\n")
    sys.stdout.flush()


async def announce_ready(state: Any, url: str, host: str, port: int) -> None:
    """Print the ready line once the app's `/health` says ready (never, if the load fails)."""
    while state.health_state() != "ready":
        if state.phase == "failed":
            return
        await asyncio.sleep(READY_POLL_S)
    print_event("ready", url, host, port, model=state.engine.model_name)


def exit_on_stdin_close(loop: asyncio.AbstractEventLoop, on_close: Callable[[], None]) -> None:
    """Call `on_close` on `loop` once stdin reaches its end (a daemon thread reads it)."""
    def watch() -> None:
        stream = sys.stdin.buffer if sys.stdin is not None else None
        while stream is not None and stream.read(65536):
            pass
        loop.call_soon_threadsafe(on_close)

    threading.Thread(target=watch, name="ferrox-stdin-watch", daemon=True).start()
