"""Observability routes: /health, /metrics, /admin/stats, and /openapi.json.

`/health` and `/metrics` are never behind the API key (probes and scrapers); `/admin/stats`
is. `/health` names the weight quantization. Both stats routes read the latest
`BatcherStats` snapshot the owner thread published (nobody reads live counters) next to
the server's own `ServerStats`; `/admin/stats` adds the bytes the weights and the KV cache
take (`Engine.memory`, fixed once loaded).
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Blueprint, Response, current_app

from api import protocol
from api.state import VERSION, json_response, state_of
from api.telemetry import stats_dict

blueprint = Blueprint("admin", __name__)


@blueprint.get("/health")
async def health() -> Response:
    state = state_of(current_app)
    phase = state.health_state()
    engine = state.engine
    body = {"state": phase, "model": engine.model_name if engine is not None else None,
            "quantization": engine.model_card.quantization if engine is not None else None,
            "version": VERSION, "uptime_seconds": round(state.stats.uptime_s(), 3)}
    if phase == "unavailable":
        body["reason"] = state.load_error or "the engine loop is not running"
    headers = {} if phase == "ready" else {"Retry-After": "1"}
    return json_response(body, 200 if phase == "ready" else 503, headers)


@blueprint.get("/metrics")
async def metrics() -> Response:
    state = state_of(current_app)
    return Response(generate_latest(state.metrics.registry), status=200, content_type=CONTENT_TYPE_LATEST)


@blueprint.get("/admin/stats")
async def admin_stats() -> Response:
    state = state_of(current_app)
    body = {**stats_dict(state.engine_stats()), **state.stats.as_dict(), "state": state.health_state(),
            "pid": os.getpid(), "rss_bytes": rss_bytes()}
    if state.engine is not None:
        body.update(state.engine.memory())  # weights_bytes, kv_bytes
    if state.guards is not None:
        body["http_open_requests"] = state.guards.num_open
        body["http_refused_concurrency"] = state.guards.num_refused
        body["sse_orphaned"] = state.guards.num_orphaned
    return json_response(body)


def rss_bytes() -> int | None:
    """The server process's resident set size now (not the peak), for leak checks (tools/soak.py)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        try:
            import psutil
        except ImportError:
            return None
        return psutil.Process().memory_info().rss


@blueprint.get("/openapi.json")
async def openapi() -> Response:
    return json_response(openapi_spec())


_ROUTES = (
    # (method, path, summary, request model, response model)
    ("get", "/v1/models", "List the served model", None, protocol.ModelList),
    ("post", "/v1/completions", "Text completion (stream with `stream: true`)", protocol.CompletionRequest,
     protocol.CompletionResponse),
    ("post", "/v1/chat/completions", "Chat completion (stream with `stream: true`)",
     protocol.ChatCompletionRequest, protocol.ChatCompletionResponse),
    ("post", "/v1/cancel", "Cancel an in-flight request by its request_id", protocol.CancelRequest,
     protocol.CancelResponse),
    ("post", "/v1/tokenize", "Tokenize a prompt (or chat messages)", protocol.TokenizeRequest,
     protocol.TokenizeResponse),
    ("post", "/v1/detokenize", "Token ids to text", protocol.DetokenizeRequest, protocol.DetokenizeResponse),
    ("get", "/health", "Liveness/readiness: 200 only when ready", None, None),
    ("get", "/metrics", "Prometheus metrics", None, None),
    ("get", "/admin/stats", "Batcher and server counters as JSON", None, None),
)


def openapi_spec() -> dict:
    """OpenAPI 3.1 document built from the pydantic models' JSON schemas."""
    schemas: dict = {}
    paths: dict = {}
    ref = "#/components/schemas/{model}"
    for model in (protocol.ErrorResponse,):
        schemas.update(_schema(model, ref, schemas))
    for method, path, summary, req, resp in _ROUTES:
        op: dict = {"summary": summary, "responses": {}}
        if req is not None:
            _schema(req, ref, schemas)
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": ref.format(model=req.__name__)}}}}
        ok: dict = {"description": "OK"}
        if resp is not None:
            _schema(resp, ref, schemas)
            ok["content"] = {"application/json": {"schema": {"$ref": ref.format(model=resp.__name__)}}}
        op["responses"]["200"] = ok
        err = {"content": {"application/json": {"schema": {"$ref": ref.format(model="ErrorResponse")}}}}
        for status, what in (("400", "invalid request"), ("401", "invalid or missing API key"),
                             ("404", "unknown model or request"), ("503", "overloaded, loading or draining")):
            if req is not None or status in ("401", "503"):
                op["responses"][status] = {"description": what, **err}
        if path in ("/health", "/metrics"):
            op["security"] = []  # never behind the API key
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "ferrox_jax", "version": VERSION,
                 "description": "OpenAI-compatible LLM inference server on JAX"},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


def _schema(model: type, ref: str, schemas: dict) -> dict:
    schema = model.model_json_schema(ref_template=ref)
    for name, sub in schema.pop("$defs", {}).items():
        schemas[name] = sub
    schemas[model.__name__] = schema
    return schemas
