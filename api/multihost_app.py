"""`ferrox serve` in a multi-process cluster: the leader's failure path and the followers' life.

Process 0 (the leader) serves the whole API as usual; its engine sends every step to the
followers (`ferrox_jax/multihost.py`). A failed group is one of the engine's own faults
(kind "peer", `ferrox_jax/step_faults.py`): the engine ends every in-flight request with
an error event naming the lost process, `/health` answers 503 with the reason, and
`ferrox serve` stops and exits non-zero as for any engine that gave up (`api/cli.py`), so a
supervisor restarts the whole group. `watch_group(app)` adds the backstop: `EXIT_BACKSTOP_S`
after the engine gave up, the process exits whatever is still running (a device call stuck
in a collective with a dead peer).

A follower (`serve_follower`) answers only `GET /health` on its own port (503 `loading`
until its engine is warm and connected to the leader, then 200), loads and compiles the
same engine, joins the leader's step channel (both prove the group's secret,
`--multihost-secret`, or on loopback the one the leader generated:
`ferrox_jax/step_channel_auth.py`), and runs the steps the leader sends until the leader
stops it (exit 0) or disappears or hangs (no step and no heartbeat for
`--multihost-timeout-s`: exit 3). A failed handshake (no or another secret, a slot already
taken) exits 3 too, saying why.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable

from api.config import ServerConfig

if TYPE_CHECKING:  # the facade's module imports jax; this module names its types only
    from ferrox_jax.engine import EngineConfig

log = logging.getLogger("ferrox.multihost")

EXIT_BACKSTOP_S = 30.0  # after the engine gave up, the process exits even if shutting down hangs
BACKSTOP_EXIT_CODE = 3  # api/cli.py's EXIT_ENGINE_FAULTED: the engine gave up


def is_multiprocess(config: EngineConfig) -> bool:
    return bool(config.coordinator_address) and (config.num_processes or 0) > 1


def is_follower(config: EngineConfig) -> bool:
    return is_multiprocess(config) and (config.process_id or 0) > 0


def watch_group(app: Any) -> None:
    """On the leader: once the engine gave up, exit within `EXIT_BACKSTOP_S` whatever still
    runs (the normal exit, after the error events went out, comes first)."""
    from api.app import state_of

    @app.before_serving
    async def _arm_backstop() -> None:
        state = state_of(app)

        async def backstop() -> None:
            await state.engine_failed.wait()
            timer = threading.Timer(EXIT_BACKSTOP_S, lambda: exit_now(BACKSTOP_EXIT_CODE))
            timer.daemon = True
            timer.start()

        app.extensions["ferrox_group_backstop"] = asyncio.get_running_loop().create_task(backstop())


def exit_now(code: int) -> None:
    """Leave without interpreter teardown: `jax.distributed`'s exit hook waits for peers
    that may be gone. A leader stops its followers first (no-op after a failure)."""
    from ferrox_jax.engine import Engine

    Engine.stop_followers()
    logging.shutdown()
    os._exit(code)


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    status: dict[str, Any] = {}

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        if self.path != "/health":
            self.send_error(404, "a follower serves only /health; send requests to process 0")
            return
        body = json.dumps(self.status).encode()
        self.send_response(200 if self.status.get("state") == "ready" else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # probes every few seconds: not worth a line each
        pass


def serve_follower(engine_cfg: EngineConfig, server_cfg: ServerConfig,
                   wrap_runner: Callable[[Any], Any] | None = None) -> int:
    """A follower process: health endpoint, engine, warm-up, then the leader's steps.
    `wrap_runner`: the engine builder's runner-wrapping hook, as for the leader's engine (test
    fault injection on a follower, `tests/support/fault_serve.py`); None in every product use."""
    from ferrox_jax.engine import Engine

    status = {"state": "loading", "role": "follower", "process_id": engine_cfg.process_id}
    handler = type("Handler", (_HealthHandler,), {"status": status})
    health = http.server.ThreadingHTTPServer((server_cfg.host, server_cfg.port), handler)
    threading.Thread(target=health.serve_forever, name="ferrox-follower-health", daemon=True).start()
    log.info("follower %d: health on %s:%d", engine_cfg.process_id, server_cfg.host, server_cfg.port)
    engine = Engine.load(engine_cfg, wrap_runner=wrap_runner)
    engine.warmup()
    code = engine.follow_leader(on_connected=lambda: status.update(state="ready"))
    log.info("follower %d: the leader stopped the group", engine_cfg.process_id)
    exit_now(code)
    return code
