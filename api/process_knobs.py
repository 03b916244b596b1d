"""What `ferrox serve` offers a parent process that starts it: a free port, ready lines on
stdout, and an exit when the parent goes away.

- The listening socket is bound before anything else starts (the app, the model load) and
  handed to Hypercorn as `fd://N`: `--port 0` gets a free port whose address is known at
  once, and a port that cannot be had (in use, privileged, not this machine's address)
  stops start-up with one line (`listen_problem`) instead of a traceback after the model
  began loading.
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
import errno
import json
import socket
import sys
import threading
from typing import Any, Callable

from api.config import ServerConfig

READY_POLL_S = 0.05


def bind_port(config: ServerConfig, backlog: int) -> socket.socket:
    """A listening TCP socket on `config.host`:`config.port` (0: a port the kernel picks).

    Raises:
      OSError: the address cannot be had (`listen_problem` says why in one line).
    """
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as Hypercorn sets on sockets it binds
        sock.bind((config.host, config.port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen_problem(config: ServerConfig, e: OSError) -> str:
    """What to do about an address `bind_port` could not have, in one line."""
    where = f"port {config.port} on {config.host}"
    if e.errno == errno.EADDRINUSE:
        return f"{where} is in use; stop the other server or pass --port"
    if e.errno == errno.EACCES:
        return f"{where} needs privileges this user lacks; pass --port 1024 or above"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"{config.host} is not an address of this machine; pass --host"
    return f"cannot listen on {where}: {e.strerror or e}; check --host and --port"


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
