"""`create_app(engine_or_loader, server_config)`: the Quart app, its hooks and error envelopes.

The app's shared state is one `AppState` (`api/state.py`); the routes are blueprints,
one module per wire protocol plus the observability routes, each importing only
`api/state.py` and the generation core, never this module.

Below Quart, `api/guards.py` refuses oversized headers, caps concurrent requests and
cancels streams whose client stopped reading (the SSE orphan timeout); around everything,
`api/unread_body.py` reads (or, past the body limit, closes on) a body still unread when
an early error is answered, so a pooled keep-alive connection stays usable. Request hooks, in
order: the browser rules of `api/same_origin.py` for every request, pages and probes included
(a `Host` this server does not answer to: 421; a state-changing request from another origin:
403; a body that is not declared JSON: 415), CORS preflight, API key (constant-time, as
`Authorization: Bearer` or `x-api-key`; `/health`, `/metrics` and the browser pages' static
files stay open: `api/web/`), per-client rate limit.

Every error — ours, Quart's 404/405/413, malformed JSON, the guards' refusals, an
unexpected exception — is an `APIError` rendered in the envelope of the protocol its path
belongs to (`ENVELOPES`: Anthropic's under /v1/messages, llama.cpp's on /completion; the
OpenAI envelope everywhere else). An unexpected exception is a 500 `internal_error` whose
message names no exception class, only a request id (`err-…`, also in `X-Request-Id`)
under which the log holds its traceback.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from api import (admin_routes, anthropic_routes, auth_limit, body_timeout, cache_rebuild, embeddings_routes, guards,
                 llamacpp_routes, lora_routes, model_admin, offload, openai_routes, rerank_routes, response_cache,
                 responses_routes, resumable, router_routes, sessions, sleep_routes, surface_routes, tokenizer_routes,
                 unread_body, web)
from api.config import ServerConfig
from api.errors import APIError
from api.same_origin import SameOrigin
from api.state import AppState, json_response, state_of

if TYPE_CHECKING:
    from ferrox_jax.engine import Engine

logger = logging.getLogger("ferrox.api")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # never behind the API key
# Not counted as requests: probes, scrapers and the routers' load polls (api/router_routes.py).
OBSERVABILITY_PATHS = frozenset({"/health", "/metrics", "/admin/stats"}) | router_routes.PROBE_PATHS
DRAIN_ABORT_REASON = "the server shut down before this request finished (drain timeout); retry it"

# (path, renderer): a path equal to it or below it answers errors in that protocol's envelope.
ENVELOPES: tuple[tuple[str, Callable[[APIError], tuple[int, dict]]], ...] = (
    (anthropic_routes.ROUTE, anthropic_routes.error_response),
    ("/completion", llamacpp_routes.error_response),
    ("/completions", llamacpp_routes.error_response),
    (surface_routes.SLOTS_ROUTE, llamacpp_routes.error_response),
)


def openai_error_response(e: APIError) -> tuple[int, dict]:
    return e.status, e.body()


def error_renderer(path: str) -> Callable[[APIError], tuple[int, dict]]:
    """The envelope errors on `path` are rendered in."""
    for prefix, render in ENVELOPES:
        if path == prefix or path.startswith(prefix + "/"):
            return render
    return openai_error_response


def error_response(path: str, e: APIError) -> Response:
    status, body = error_renderer(path)(e)
    return json_response(body, status, e.headers)


def create_app(engine_or_loader: Engine | Callable[[], Engine], server_config: ServerConfig | None = None,
               engine_factory: Callable[[str], Engine] | None = None) -> Quart:
    """Build the Quart app.

    Args:
      engine_or_loader: a started, warmed `Engine` (the caller owns it), or a
        zero-argument callable that loads, warms and starts one; it runs in a thread
        when serving begins, `/health` reading `loading` until it returns, and the app
        shuts that engine down when serving ends.
      server_config: HTTP settings (defaults: loopback, no key, 4 MiB bodies).
      engine_factory: loads, warms and starts an engine for a checkpoint path (or
        "default"); `/admin/models/load` needs it (without it, loading answers 501).
    Returns:
      the app, ready for Hypercorn.
    """
    config = server_config or ServerConfig()
    offload.configure(cpu_workers=config.cpu_workers, gc_freeze=config.gc_freeze)
    loader = engine_or_loader if callable(engine_or_loader) else None  # an engine is not callable
    app = Quart("ferrox")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    state = AppState(config, None if loader is not None else engine_or_loader)
    state.engine_factory = engine_factory
    state.resumable = resumable.ResumableStreams(config.resumable_max_streams, config.resumable_max_bytes,
                                                 config.resumable_ttl_s)
    state.tasks = model_admin.TaskTable()
    state.sessions = sessions.SessionStore(config.session_max, config.session_ttl_s, config.session_max_bytes,
                                           config.session_max_total_bytes)
    state.on_engine_change.append(state.sessions.clear)
    if config.response_cache:
        state.response_cache = response_cache.ResponseCache(config.response_cache_max_entries,
                                                            config.response_cache_max_bytes)
        state.on_engine_change.append(state.response_cache.clear)
        state.metrics.registry.register(response_cache.ResponseCacheCollector(state.response_cache))
    state.auth_limiter = auth_limit.FailedAuthLimiter(config.auth_failures_per_minute)
    if config.otlp_traces_endpoint is not None:  # only then is OpenTelemetry imported (api/tracing.py)
        from api.tracing import Tracing

        state.tracing = Tracing(config.otlp_traces_endpoint, config.otlp_traces_protocol)
    app.extensions["ferrox"] = state
    for module in (openai_routes, anthropic_routes, responses_routes, llamacpp_routes, embeddings_routes,
                   tokenizer_routes, resumable, admin_routes, model_admin, surface_routes, rerank_routes,
                   sleep_routes, cache_rebuild, lora_routes, router_routes):
        app.register_blueprint(module.blueprint)
    state.metrics.registry.register(router_routes.VllmGauges(state))  # vLLM's names on /metrics
    if config.web_ui:  # the chat page and the dashboard (api/web/)
        app.register_blueprint(web.blueprint)
    _install_hooks(app, state)
    _install_error_handlers(app, state)
    state.guards = guards.install(app, config.max_concurrent_requests, config.sse_orphan_timeout_ms / 1000,
                                  config.max_header_bytes, error_renderer)
    app.asgi_app = unread_body.DrainUnreadBody(app.asgi_app, config.max_body_bytes)  # covers the guards
    state.body_timeout = body_timeout.BodyReadTimeout(app.asgi_app, config.body_read_timeout_s,
                                                      renderer=error_renderer)  # outermost: after the slot is freed
    app.asgi_app = state.body_timeout

    @app.before_serving
    async def _start() -> None:
        state.load_failed = asyncio.Event()
        state.engine_failed = asyncio.Event()
        if state.engine is not None:
            state.watch_engine(state.engine)
        state.start_background()
        if loader is not None:
            _start_loader(state, loader, asyncio.get_running_loop())
        else:
            offload.freeze_heap(collect=False)  # the engine is up: keep full collections off it

    @app.after_serving
    async def _stop() -> None:
        for run in list(state.inflight.values()):
            run.abort(DRAIN_ABORT_REASON)
        state.stop_background()
        if state.tracing is not None:  # export the last requests' spans before the process ends
            await asyncio.to_thread(state.tracing.shutdown)
        if state.fatal is None:  # a dead engine's owner thread may be stuck in the device: leave it
            await asyncio.to_thread(state.shutdown_owned_engines)

    return app


def _start_loader(state: AppState, loader: Callable[[], Engine], loop: asyncio.AbstractEventLoop) -> None:
    def run() -> None:
        try:
            engine = loader()
        except Exception as e:  # reported on /health and by the CLI, which then exits 1
            # No exception class names: /health carries this to clients, and the message
            # (the file, the setting) is what a user acts on.
            if isinstance(e, (ValueError, OSError)):  # a checkpoint or setting this server cannot serve
                message = str(e)
                logger.error("loading the model failed: %s", message)
            else:
                message = f"loading the model failed unexpectedly ({e}); the server log has the traceback"
                logger.exception("loading the model failed")
        else:
            offload.freeze_heap()
            loop.call_soon_threadsafe(functools.partial(state.set_engine, engine, owned=True))
            return
        # Outside the except block, so the traceback (and the frames holding a half-built
        # model) is gone: collect it now. Left to the interpreter's final collection, its
        # device buffers would be freed after the XLA client and abort the process
        # ("terminate called after throwing an instance of ...") instead of exiting 1. A load
        # that failed after the weights (the warm-up, the default grammar) made them while
        # start-up's collector was paused and frozen (api/offload.py): unfreeze them first.
        gc.unfreeze()
        gc.collect()

        def failed() -> None:
            state.phase, state.load_error = "failed", message
            state.load_failed.set()

        loop.call_soon_threadsafe(failed)

    threading.Thread(target=run, name="ferrox-loader", daemon=True).start()


def _install_hooks(app: Quart, state: AppState) -> None:
    config = state.config
    api_key = config.api_key.encode("utf-8") if config.api_key else None
    # The pages load without the key (they ask for it; api/web/) and are not API requests.
    open_pages = web.is_page if config.web_ui else (lambda _path: False)
    browser_rules = SameOrigin(config)

    @app.before_request
    async def _gate() -> Response | None:
        path = request.path
        is_page = open_pages(path)
        if not is_page and path not in OBSERVABILITY_PATHS:
            state.stats.on_request()
        browser_rules.check(request.method, request.headers)  # Host, Origin, Content-Type: before the key
        if is_page:
            return None
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin and origin in config.cors_origins:
            return Response("", status=204)  # CORS headers added in _after
        client = request.remote_addr or "?"
        if api_key is not None and path not in OPEN_PATHS:  # the limits first, then the key
            auth_limit.check_key(state, api_key, request.headers, client)
        elif path not in OPEN_PATHS and state.over_rate_limit(client):
            raise APIError(429, "rate limit exceeded", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "60"})
        return None

    @app.teardown_request
    async def _unpin(_exc: BaseException | None) -> None:
        state.unpin_engine()

    @app.after_request
    async def _after(response: Response) -> Response:
        await response_cache.mark_response(response, getattr(g, "ferrox_cache", None))
        if response.status_code >= 400 and request.path not in OBSERVABILITY_PATHS:
            state.stats.on_error()
        origin = request.headers.get("Origin")
        if origin and origin in config.cors_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type, x-api-key"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Max-Age"] = "600"
        response.headers.add("Vary", "Origin")
        return response


def _install_error_handlers(app: Quart, state: AppState) -> None:
    @app.errorhandler(APIError)
    async def _api_error(e: APIError) -> Response:
        return error_response(request.path, e)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        status = e.code or 500
        messages = {
            404: f"unknown route {request.path}",
            405: f"method {request.method} not allowed on {request.path}",
            413: f"request body larger than the limit of {state.config.max_body_bytes} bytes",
        }
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        headers = {"Allow": ", ".join(e.valid_methods)} if status == 405 and getattr(e, "valid_methods", None) else {}
        return error_response(request.path, APIError(status, messages.get(status, e.description or e.name),
                                                     code=codes.get(status), headers=headers))

    @app.errorhandler(Exception)
    async def _unexpected(e: Exception) -> Response:
        # A bug, not the client's doing: the body names no exception (an internal detail it
        # cannot act on) but an id, which the log line with the traceback carries too.
        request_id = f"err-{uuid.uuid4().hex}"
        logger.exception("unhandled error on %s %s (request id %s)", request.method, request.path, request_id)
        return error_response(request.path, APIError(
            500, f"internal error; the server log has the details under request id {request_id}",
            type="server_error", code="internal_error", headers={"X-Request-Id": request_id}))


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
    for run in list(state.inflight.values()):
        run.abort(DRAIN_ABORT_REASON)
    # Their handlers now write the error and close; a stream whose client reads nothing
    # is left to the SSE orphan timeout and Hypercorn's graceful_timeout.
    while state.inflight and time.monotonic() < deadline + 5.0:
        await asyncio.sleep(0.05)
