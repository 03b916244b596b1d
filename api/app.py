"""`create_app(engine_or_loader, server_config)`: the Quart app and its shared state.

The app holds one `AppState` (in `app.extensions["ferrox"]`): the engine once loaded,
the phase `/health` reports, the server's own counters and metrics, and the in-flight
generations `/v1/cancel` and the drain can reach. Everything in it is touched only on
the server's event loop, except the engine (its batcher is thread-safe by design) and
the loader thread, which hands the engine over with `loop.call_soon_threadsafe`.

Below Quart, `api/guards.py` refuses oversized headers, caps concurrent requests and
cancels streams whose client stopped reading (the SSE orphan timeout). Request hooks, in order: CORS preflight, API key (constant-time; `/health` and
`/metrics` stay open), per-client rate limit; every error — ours, Quart's 404/405/413,
an unexpected exception — leaves in the OpenAI envelope.

Phases: `loading` (engine not warm yet; /health 503) -> `ready` (200) -> `draining`
(SIGTERM: /health and new work 503, in-flight work finishes). A dead batcher loop or a
failed load reads `unavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import threading
import time
from importlib import metadata
from typing import Any, Callable

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from api.choices import TokenText
from api.config import ServerConfig
from api.protocol import APIError, dumps, error_body, unavailable
from api.telemetry import Metrics, ServerStats

logger = logging.getLogger("ferrox.api")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # never behind the API key
OBSERVABILITY_PATHS = frozenset({"/health", "/metrics", "/admin/stats"})  # not counted as requests
DRAIN_ABORT_REASON = "the server shut down before this request finished (drain timeout); retry it"

try:
    VERSION = metadata.version("ferrox-jax")
except metadata.PackageNotFoundError:  # running from a source tree without install
    VERSION = "0.0.0"


class AppState:
    """What the handlers share; event-loop only (see the module docstring)."""

    def __init__(self, config: ServerConfig, engine: Any | None) -> None:
        self.config = config
        self.engine = engine
        self.phase = "ready" if engine is not None else "loading"
        self.load_error: str | None = None
        self.owns_engine = engine is None  # loaded here -> shut down here
        self.stats = ServerStats()
        self.metrics = Metrics(self._metrics_source)
        self.inflight: dict[str, Any] = {}  # API request id -> Generation
        self.tokens = TokenText(engine.tokenizer) if engine is not None else None
        self.load_failed = asyncio.Event()  # set (on the loop) when the loader raised
        self.guards: Any = None  # api.guards.RequestGuards, installed by create_app
        self._hits: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def _metrics_source(self) -> tuple[Any, ServerStats, int]:
        stats = self.engine.batcher.stats() if self.engine is not None else None
        recompiles = getattr(stats, "recompiles_after_warmup", None)
        if recompiles is None and self.engine is not None:
            recompiles = getattr(self.engine, "recompiles_after_warmup", 0)
        return stats, self.stats, int(recompiles or 0)

    def set_engine(self, engine: Any) -> None:
        self.engine = engine
        self.tokens = TokenText(engine.tokenizer)
        if self.phase == "loading":
            self.phase = "ready"

    def health_state(self) -> str:
        if self.phase in ("loading", "draining"):
            return self.phase
        if self.phase == "failed" or self.engine is None or self.engine.batcher.health() != "ready":
            return "unavailable"
        return "ready"

    def require_engine(self) -> Any:
        """The engine, or a 503 with Retry-After while it cannot take work."""
        state = self.health_state()
        if state == "ready":
            return self.engine
        if state == "loading":
            raise unavailable("the model is still loading; retry shortly", code="loading")
        if state == "draining":
            raise unavailable("the server is shutting down", code="draining")
        reason = self.load_error or "the engine is not running"
        raise unavailable(f"engine unavailable: {reason}", code="unavailable")

    def over_rate_limit(self, client: str) -> bool:
        """Sliding one-minute window per client address."""
        limit = self.config.rate_limit_per_minute
        if not limit:
            return False
        now = time.monotonic()
        hits = self._hits[client]
        while hits and now - hits[0] >= 60.0:
            hits.popleft()
        if len(hits) >= limit:
            return True
        hits.append(now)
        return False


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    response = Response(dumps(obj), status=status, content_type="application/json")
    for key, value in (headers or {}).items():
        response.headers[key] = value
    return response


def state_of(app: Quart) -> AppState:
    return app.extensions["ferrox"]


def create_app(engine_or_loader: Any | Callable[[], Any], server_config: ServerConfig | None = None) -> Quart:
    """Build the Quart app.

    Args:
      engine_or_loader: a started, warmed `Engine` (the caller owns it), or a
        zero-argument callable that loads, warms and starts one; it runs in a thread
        when serving begins, `/health` reading `loading` until it returns, and the app
        shuts that engine down when serving ends.
      server_config: HTTP settings (defaults: loopback, no key, 4 MiB bodies).
    Returns:
      the app, ready for Hypercorn.
    """
    from api import admin_routes, guards, openai_routes  # import here: they import this module

    config = server_config or ServerConfig()
    is_engine = hasattr(engine_or_loader, "batcher")
    app = Quart("ferrox")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    state = AppState(config, engine_or_loader if is_engine else None)
    app.extensions["ferrox"] = state
    app.register_blueprint(openai_routes.blueprint)
    app.register_blueprint(admin_routes.blueprint)
    _install_hooks(app, state)
    _install_error_handlers(app, state)
    state.guards = guards.install(app, config.max_concurrent_requests, config.sse_orphan_timeout_ms / 1000,
                                  config.max_header_bytes)

    @app.before_serving
    async def _start() -> None:
        state.load_failed = asyncio.Event()
        if not is_engine:
            _start_loader(state, engine_or_loader, asyncio.get_running_loop())

    @app.after_serving
    async def _stop() -> None:
        for generation in list(state.inflight.values()):
            generation.abort(DRAIN_ABORT_REASON)
        if state.owns_engine and state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    return app


def _start_loader(state: AppState, loader: Callable[[], Any], loop: asyncio.AbstractEventLoop) -> None:
    def run() -> None:
        try:
            engine = loader()
        except Exception as e:  # reported on /health and by the CLI, which then exits
            logger.exception("loading the model failed")
            message = f"{type(e).__name__}: {e}"

            def failed() -> None:
                state.phase, state.load_error = "failed", message
                state.load_failed.set()

            loop.call_soon_threadsafe(failed)
            return
        loop.call_soon_threadsafe(state.set_engine, engine)

    threading.Thread(target=run, name="ferrox-loader", daemon=True).start()


def _install_hooks(app: Quart, state: AppState) -> None:
    config = state.config
    api_key = config.api_key.encode("utf-8") if config.api_key else None

    @app.before_request
    async def _gate() -> Response | None:
        path = request.path
        if path not in OBSERVABILITY_PATHS:
            state.stats.on_request()
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin and origin in config.cors_origins:
            return Response("", status=204)  # CORS headers added in _after
        if api_key is not None and path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            given = token.strip().encode("utf-8") if scheme.lower() == "bearer" else b""
            if not hmac.compare_digest(given, api_key):
                raise APIError(401, "invalid or missing API key", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        if path not in OPEN_PATHS and state.over_rate_limit(request.remote_addr or "?"):
            raise APIError(429, "rate limit exceeded", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "60"})
        return None

    @app.after_request
    async def _after(response: Response) -> Response:
        if response.status_code >= 400 and request.path not in OBSERVABILITY_PATHS:
            state.stats.on_error()
        origin = request.headers.get("Origin")
        if origin and origin in config.cors_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Max-Age"] = "600"
        response.headers.add("Vary", "Origin")
        return response


def _install_error_handlers(app: Quart, state: AppState) -> None:
    @app.errorhandler(APIError)
    async def _api_error(e: APIError) -> Response:
        return json_response(e.body(), e.status, e.headers)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        status = e.code or 500
        messages = {
            404: f"unknown route {request.path}",
            405: f"method {request.method} not allowed on {request.path}",
            413: f"request body larger than the limit of {state.config.max_body_bytes} bytes",
        }
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        body = error_body(messages.get(status, e.description or e.name), "invalid_request_error",
                          None, codes.get(status))
        response = json_response(body, status)
        if status == 405 and getattr(e, "valid_methods", None):
            response.headers["Allow"] = ", ".join(e.valid_methods)
        return response

    @app.errorhandler(Exception)
    async def _unexpected(e: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(error_body(f"internal error: {type(e).__name__}", "server_error", None,
                                        "internal_error"), 500)


async def drain(app: Quart, timeout_s: float) -> None:
    """Graceful shutdown: refuse new work, let in-flight requests finish within `timeout_s`,
    then abort the rest (streams get a final SSE error event, whole requests a 503)."""
    state = state_of(app)
    state.phase = "draining"
    deadline = time.monotonic() + timeout_s
    while state.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.inflight:
        logger.warning("drain: %d request(s) still running after %.0f s; ending them with an error",
                       len(state.inflight), timeout_s)
    for generation in list(state.inflight.values()):
        generation.abort(DRAIN_ABORT_REASON)
    # Their handlers now write the error and close; a stream whose client reads nothing
    # is left to the SSE orphan timeout and Hypercorn's graceful_timeout.
    while state.inflight and time.monotonic() < deadline + 5.0:
        await asyncio.sleep(0.05)
