"""Observability routes: /health, /metrics, /admin/stats, /v1/stats, /v1/requests, /openapi.json.

`/health` and `/metrics` are never behind the API key (probes and scrapers); the rest
are. `/health` also carries the engine's step faults by kind and the last one's reason
(`step_faults`, `last_step_fault`), and a dead engine's reason (503 `unavailable`);
`/metrics` counts them as `ferrox_step_faults_total{kind}`. `/health` keeps `model` the served id (the contract's field, which clients compare) and
adds `model_info` beside it: dtype, context, weights and KV bytes, and `synthetic_weights`
(true under `--load-format dummy`); `/admin/stats` carries the same object. The stats routes
read the latest `BatcherStats` snapshot the owner thread published
(nobody reads live counters) next to the server's own `ServerStats`.

`/v1/stats?window=S` (1..120 s, default 10) is the dashboard view: prefill and decode
tokens/s measured from the engine's counters over the window (`RateWindow`, sampled once
a second), active / waiting / completed requests, end-to-end latency percentiles and
mean time to first token over the `recent` ring, KV blocks and memory. `/v1/requests`
pages through that ring: records after `since` (a record's `seq`), at most `limit`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Blueprint, Response, current_app, request

from api.errors import APIError
from api.lora_routes import lora_stats
from api.state import VERSION, json_response, state_of
from api.telemetry import RECENT_SIZE, stats_dict

blueprint = Blueprint("admin", __name__)


@blueprint.get("/health")
async def health() -> Response:
    state = state_of(current_app)
    phase = state.health_state()
    body = {"state": phase, "model": state.engine.model_name if state.engine is not None else None,
            "model_info": state.model_info(), "version": VERSION,
            "uptime_seconds": round(state.stats.uptime_s(), 3)}
    stats = state.engine_stats()
    if stats is not None:  # what went wrong in the engine's steps (ferrox_jax/step_faults.py)
        body["step_faults"] = stats.step_faults_by_kind()
        body["last_step_fault"] = stats.last_step_fault
    if phase == "unavailable":
        body["reason"] = state.load_error or state.fatal_reason() or "the engine loop is not running"
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
            "model_info": state.model_info(), "pid": os.getpid(), "rss_bytes": rss_bytes()}
    body["lora_adapters"] = lora_stats(state.engine)
    if state.guards is not None:
        body["http_open_requests"] = state.guards.num_open
        body["http_refused_concurrency"] = state.guards.num_refused
        body["sse_orphaned"] = state.guards.num_orphaned
    return json_response(body)


def _int_arg(name: str, default: int, low: int, high: int) -> int:
    try:
        value = int(request.args.get(name, default))
    except ValueError:
        raise APIError(400, f"{name} must be an integer", param=name) from None
    if not low <= value <= high:
        raise APIError(400, f"{name} must be in [{low}, {high}]; got {value}", param=name)
    return value


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@blueprint.get("/v1/stats")
async def v1_stats() -> Response:
    state = state_of(current_app)
    window_s = _int_arg("window", 10, 1, 120)
    prefill, decode, covered = state.rates.rates(time.monotonic(), window_s)
    stats = stats_dict(state.engine_stats())
    done = [r for r in state.stats.recent if r.status < 400]
    ttfts = [r.ttft_ms for r in done if r.ttft_ms is not None]
    total, free = stats["kv_blocks_total"], stats["kv_blocks_free"]
    return json_response({
        "window_s": window_s, "window_covered_s": round(covered, 3),
        "prefill_tokens_per_s": round(prefill, 3), "decode_tokens_per_s": round(decode, 3),
        "requests": {"active": state.stats.generating_now, "waiting": stats["queue_depth"],
                     "completed": state.stats.completed_total, "total": state.stats.requests_total},
        "latency_ms": {"p50": percentile([r.duration_ms for r in done], 50),
                       "p95": percentile([r.duration_ms for r in done], 95), "samples": len(done)},
        "ttft_ms": {"mean": round(sum(ttfts) / len(ttfts), 3) if ttfts else None, "samples": len(ttfts)},
        "kv": {"blocks_total": total, "blocks_free": free, "blocks_used": total - free,
               "usage_fraction": (total - free) / total if total else 0.0, "blocks_peak": stats["kv_blocks_peak"],
               "block_size": stats["kv_block_size"]},
        "memory": {"rss_bytes": rss_bytes(),
                   "device": state.engine.memory_stats() if state.engine is not None else {}},
        "model": state.engine.model_name if state.engine is not None else None, "state": state.health_state(),
    })


@blueprint.get("/v1/requests")
async def v1_requests() -> Response:
    state = state_of(current_app)
    since = _int_arg("since", 0, 0, 2**62)
    limit = _int_arg("limit", 50, 1, RECENT_SIZE)
    after = [dataclasses.asdict(r) for r in state.stats.recent if r.seq > since]
    page = after[:limit]
    return json_response({"object": "list", "data": page, "has_more": len(after) > limit,
                          "next_since": page[-1]["seq"] if page else since})


def rss_bytes() -> int | None:
    """The server process's resident set size now (not the peak), for leak checks (tools/soak/soak.py)."""
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


def openapi_spec() -> dict:
    """The OpenAPI 3.1 document (api/openapi.py: every route, its body and its errors' envelope)."""
    from api.openapi import build_spec

    return build_spec(VERSION)
