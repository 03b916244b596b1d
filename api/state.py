"""What every handler shares: `AppState` (one per app), `state_of(app)` and `json_response`.

The app holds one `AppState` in `app.extensions["ferrox"]`: the engine facade once loaded
(`ferrox_jax/engine.py`), the phase `/health` reports, the server's own counters and
metrics, and the in-flight generations `/v1/cancel` and the drain can reach. Everything
in it is touched only on the server's event loop, except the engine (whose `submit`,
`cancel`, `stats` and `health` are thread-safe) and the loader thread, which hands the
engine over with `loop.call_soon_threadsafe`.

Phases: `loading` (engine not warm yet; /health 503) -> `ready` (200) -> `draining`
(SIGTERM: /health and new work 503, in-flight work finishes). `sleeping` (POST /sleep:
/health and new work 503 `sleeping` until POST /wake_up). A dead engine loop or a
failed load reads `unavailable`; after `/admin/models/unload`, `unloaded` (503
`model_not_loaded`) until a model is loaded again.

Engines this app loaded (the start-up loader, `/admin/models/load`) are its own and are
shut down here, once no run in flight still uses them (`retire`); an engine handed to
`create_app` belongs to the caller.

A request is pinned to one engine: `require_engine()` picks the current one the first
time a request calls it and returns that same engine on every later call, and the app's
teardown hook unpins it; a pinned engine is not retired. So a model swap between a
handler's pick and its `submit` neither answers a spurious 503 (the old engine shut down
under it) nor renders logprob strings in the new model's vocabulary (`tokens_for`).

An engine that gives up (`ferrox_jax/step_faults.py`: a hung step, repeated step faults, a
dead loop) reads `unavailable` with its reason, and sets `engine_failed`, which
`ferrox serve` waits on to exit non-zero (docs/operations.md, exit codes).
"""

from __future__ import annotations

import asyncio
import collections
import time
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

from quart import Quart, Response, g, has_request_context

from api.choices import TokenText
from api.config import ServerConfig
from api.errors import unavailable
from api.protocol import dumps
from api.telemetry import Metrics, RateWindow, ServerStats

SAMPLE_EVERY_S = 1.0  # RateWindow and the resumable streams' sweep

if TYPE_CHECKING:  # the facade's module imports jax; handlers only need its types here
    from ferrox_jax.engine import BatcherStats, Engine

try:
    VERSION = metadata.version("ferrox-jax")
except metadata.PackageNotFoundError:  # running from a source tree without install
    VERSION = "0.0.0"


class InFlight(Protocol):
    """What `/v1/cancel` and the drain need of a request in flight (`api/generation.py`)."""

    engine: Engine | None  # the engine it runs on

    def cancel(self) -> None: ...

    def abort(self, reason: str) -> None: ...


class AppState:
    """What the handlers share; event-loop only (see the module docstring)."""

    def __init__(self, config: ServerConfig, engine: Engine | None) -> None:
        self.config = config
        self.engine = engine
        self.phase = "ready" if engine is not None else "loading"
        self.load_error: str | None = None
        self.owned_engines: list[Engine] = []  # loaded here -> shut down here
        self.engine_factory: Any = None  # checkpoint -> a started Engine (`/admin/models/load`)
        self.stats = ServerStats()
        self.rates = RateWindow()
        self.resumable: Any = None  # api.resumable.ResumableStreams, installed by create_app
        self.tasks: Any = None  # api.model_admin.TaskTable, installed by create_app
        self.sessions: Any = None  # api.sessions.SessionStore, installed by create_app
        self.response_cache: Any = None  # api.response_cache.ResponseCache with --response-cache, else None
        self.tracing: Any = None  # api.tracing.Tracing with --otlp-traces-endpoint, else None (no SDK imported)
        # Called with no arguments when the served engine changes (a swap, an unload): what
        # was kept for the previous model (sessions, cached responses) is dropped there.
        self.on_engine_change: list[Any] = []
        self._background: list[asyncio.Task] = []
        self.metrics = Metrics(self._metrics_source, self.model_card)
        self.inflight: dict[str, InFlight] = {}  # API request id -> its GenerationRun
        self.tokens = TokenText(engine.tokenizer) if engine is not None else None
        self.load_failed = asyncio.Event()  # set (on the loop) when the loader raised
        self.guards: Any = None  # api.guards.RequestGuards, installed by create_app
        self._hits: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.engine_pins: collections.Counter[Any] = collections.Counter()  # engine -> requests pinned to it
        self._retired_tokens: dict[Any, TokenText] = {}  # a swapped-out engine -> its TokenText, until retired
        self.fatal: tuple[str, str] | None = None  # (kind, reason) once the served engine gave up
        self.engine_failed = asyncio.Event()  # set (on the loop) then; `ferrox serve` exits non-zero
        self._loop: asyncio.AbstractEventLoop | None = None  # set by `watch_engine` when serving starts

    def _metrics_source(self) -> tuple[BatcherStats | None, ServerStats]:
        return self.engine_stats(), self.stats

    def engine_stats(self) -> BatcherStats | None:
        return self.engine.stats() if self.engine is not None else None

    def model_card(self) -> Any:
        """The engine's `ModelCard`, or None before it is loaded."""
        return self.engine.model_card if self.engine is not None else None

    def model_info(self) -> dict[str, Any] | None:
        """What `/health` and `/admin/stats` say about the served model (None before loading)."""
        card = self.model_card()
        if card is None:
            return None
        return {"id": card.id, "architecture": card.architecture, "dtype": card.dtype,
                "quantization": card.quantization, "kv_cache_dtype": card.kv_cache_dtype,
                "max_context": card.max_context, "synthetic_weights": card.synthetic_weights,
                "weights_bytes": card.weights_bytes, "kv_bytes": card.kv_bytes, "matmul": card.matmul or None}

    def set_engine(self, engine: Engine | None, owned: bool = False) -> None:
        """Serve `engine` from now on (None: nothing is loaded); the previous one is retired."""
        previous = self.engine
        if previous is not None and previous is not engine and self.tokens is not None:
            self._retired_tokens[previous] = self.tokens
        self.engine = engine
        if owned and engine is not None:
            self.owned_engines.append(engine)
        if engine is not None:
            self.tokens = TokenText(engine.tokenizer)
            self.watch_engine(engine)
            if self.phase in ("loading", "unloaded", "failed"):
                self.phase, self.load_error = "ready", None
        elif self.phase == "ready":
            self.phase = "unloaded"
        if previous is not engine:
            for hook in self.on_engine_change:
                hook()
        if previous is not None and previous is not engine:
            self.retire(previous)

    def retire(self, engine: Engine) -> None:
        """Shut an owned engine down once no run in flight uses it (they finish on it)."""
        if engine not in self.owned_engines:
            return

        async def when_idle() -> None:
            while self.engine_pins[engine] or any(getattr(run, "engine", None) is engine
                                                  for run in self.inflight.values()):
                await asyncio.sleep(0.05)
            if engine is not self.engine:
                self._retired_tokens.pop(engine, None)
            if engine is not self.engine and engine in self.owned_engines:
                self.owned_engines.remove(engine)
                await asyncio.to_thread(engine.shutdown)

        self._background.append(asyncio.get_running_loop().create_task(when_idle()))

    def shutdown_owned_engines(self) -> None:
        """At exit (any thread): stop every engine this app loaded."""
        for engine in self.owned_engines:
            engine.shutdown()
        self.owned_engines.clear()

    def start_background(self) -> None:
        """The once-a-second sampler: token rates for `/v1/stats`, expiry of resumable streams."""
        async def sample() -> None:
            while True:
                now = time.monotonic()
                self.rates.sample(now, self.engine_stats())
                if self.resumable is not None:
                    self.resumable.sweep(now)
                await asyncio.sleep(SAMPLE_EVERY_S)

        self._background.append(asyncio.get_running_loop().create_task(sample()))

    def stop_background(self) -> None:
        for task in self._background:
            task.cancel()
        self._background.clear()

    def health_state(self) -> str:
        if self.phase in ("loading", "draining", "unloaded", "sleeping", "rebuilding"):
            return self.phase
        if self.phase == "failed" or self.engine is None or self.engine.health() != "ready":
            return "unavailable"
        return "ready"

    def tokens_for(self, engine: Engine) -> TokenText:
        """Token strings in `engine`'s vocabulary (the current one's, or a swapped-out one's)."""
        if engine is self.engine and self.tokens is not None:
            return self.tokens
        tokens = self._retired_tokens.get(engine)
        if tokens is None:
            tokens = self._retired_tokens[engine] = TokenText(engine.tokenizer)
        return tokens

    def pin_engine(self, engine: Engine) -> Engine:
        """The engine this request is pinned to: `engine` on the first call, the same one
        after (outside a request, `engine` itself)."""
        if not has_request_context():
            return engine
        pinned = g.get("ferrox_engine")
        if pinned is None:
            g.ferrox_engine = pinned = engine
            self.engine_pins[engine] += 1
        return pinned

    def unpin_engine(self) -> None:
        """The request ended (the app's teardown hook); a run it submitted keeps its engine
        alive through `inflight`."""
        engine = g.pop("ferrox_engine", None)
        if engine is not None:
            self.engine_pins[engine] -= 1
            if self.engine_pins[engine] <= 0:
                del self.engine_pins[engine]

    def watch_engine(self, engine: Engine) -> None:
        """Listen for `engine` giving up (on the loop serving the app; no-op before it runs)."""
        try:
            loop = self._loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        add = getattr(engine, "add_fatal_listener", None)  # test doubles may have none
        if add is None:
            return

        def on_fatal(kind: str, reason: str) -> None:  # the engine's owner or watchdog thread
            try:
                loop.call_soon_threadsafe(self._on_fatal, engine, kind, reason)
            except RuntimeError:  # the loop is closed: the server is gone already
                pass

        add(on_fatal)

    def _on_fatal(self, engine: Engine, kind: str, reason: str) -> None:
        if engine is not self.engine:  # a swapped-out engine's end changes nothing served
            return
        self.fatal = (kind, reason)
        self.engine_failed.set()

    def fatal_reason(self) -> str | None:
        """Why the served engine gave up, or None."""
        fatal = getattr(self.engine, "fatal", None) if self.engine is not None else None
        found = fatal() if fatal is not None else None
        return found[1] if found is not None else None

    def require_engine(self) -> Engine:
        """The engine this request is pinned to (`pin_engine`), or a 503 with Retry-After
        while the server cannot take work."""
        state = self.health_state()
        if state == "ready":
            assert self.engine is not None
            return self.pin_engine(self.engine)
        if state == "loading":
            raise unavailable("the model is still loading; retry shortly", code="loading")
        if state == "draining":
            raise unavailable("the server is shutting down", code="draining")
        if state == "rebuilding":
            raise unavailable("the KV cache is being rebuilt (POST /v1/cache/rebuild); retry shortly",
                              code="cache_rebuilding")
        if state == "sleeping":
            raise unavailable("the server is asleep (POST /sleep); POST /wake_up wakes it", code="sleeping")
        if state == "unloaded":
            raise unavailable("no model is loaded; load one with POST /admin/models/load", code="model_not_loaded")
        reason = self.load_error or self.fatal_reason() or "the engine is not running"
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
