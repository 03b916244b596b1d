"""What every handler shares: `AppState` (one per app), `state_of(app)` and `json_response`.

The app holds one `AppState` in `app.extensions["ferrox"]`: the engine facade once loaded
(`ferrox_jax/engine.py`), the phase `/health` reports, the server's own counters and
metrics, and the in-flight generations `/v1/cancel` and the drain can reach. Everything
in it is touched only on the server's event loop, except the engine (whose `submit`,
`cancel`, `stats` and `health` are thread-safe) and the loader thread, which hands the
engine over with `loop.call_soon_threadsafe`.

Phases: `loading` (engine not warm yet; /health 503) -> `ready` (200) -> `draining`
(SIGTERM: /health and new work 503, in-flight work finishes). A dead engine loop or a
failed load reads `unavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

from quart import Quart, Response

from api.choices import TokenText
from api.config import ServerConfig
from api.errors import unavailable
from api.protocol import dumps
from api.telemetry import Metrics, ServerStats
from ferrox_jax.stats import BatcherStats

if TYPE_CHECKING:  # the facade's module imports jax; handlers only need its type here
    from ferrox_jax.engine import Engine

try:
    VERSION = metadata.version("ferrox-jax")
except metadata.PackageNotFoundError:  # running from a source tree without install
    VERSION = "0.0.0"


class InFlight(Protocol):
    """What `/v1/cancel` and the drain need of a request in flight (`api/generation.py`)."""

    def cancel(self) -> None: ...

    def abort(self, reason: str) -> None: ...


class AppState:
    """What the handlers share; event-loop only (see the module docstring)."""

    def __init__(self, config: ServerConfig, engine: Engine | None) -> None:
        self.config = config
        self.engine = engine
        self.phase = "ready" if engine is not None else "loading"
        self.load_error: str | None = None
        self.owns_engine = engine is None  # loaded here -> shut down here
        self.stats = ServerStats()
        self.metrics = Metrics(self._metrics_source, self.model_card)
        self.inflight: dict[str, InFlight] = {}  # API request id -> its GenerationRun
        self.tokens = TokenText(engine.tokenizer) if engine is not None else None
        self.load_failed = asyncio.Event()  # set (on the loop) when the loader raised
        self.guards: Any = None  # api.guards.RequestGuards, installed by create_app
        self._hits: dict[str, collections.deque] = collections.defaultdict(collections.deque)

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
                "max_context": card.max_context, "synthetic_weights": card.synthetic_weights,
                "weights_bytes": card.weights_bytes, "kv_bytes": card.kv_bytes}

    def set_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens = TokenText(engine.tokenizer)
        if self.phase == "loading":
            self.phase = "ready"

    def health_state(self) -> str:
        if self.phase in ("loading", "draining"):
            return self.phase
        if self.phase == "failed" or self.engine is None or self.engine.health() != "ready":
            return "unavailable"
        return "ready"

    def require_engine(self) -> Engine:
        """The engine, or a 503 with Retry-After while it cannot take work."""
        state = self.health_state()
        if state == "ready":
            assert self.engine is not None
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
