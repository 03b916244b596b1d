"""Operator and client-tool routes over what the app already knows: slots, the KV cache's
geometry, cache counters, a drain-and-seal, and the Responses lookups.

- `GET /slots` (llama.cpp's): one entry per row the engine can run at once (`max_seqs`):
  `{"id", "id_task", "state", "is_processing", "n_ctx", "n_prompt_tokens", "n_decoded",
  "route"}`. A row of a request in flight is `pending` until its first token (waiting for
  admission or prefilling), then `generating`; the rest are `idle`. Ids are positions in
  this list (rows are not pinned to slots as llama.cpp's are). `?fail_on_no_slot=1`
  answers 503 when no slot is idle, as llama.cpp does. Errors in llama.cpp's envelope.
- `GET /v1/cache/status`: the KV cache's geometry and occupancy (block size, blocks total,
  free, cached and used, bytes per block and in all, the dtype, the context ceiling) and
  the prefix cache's state (on or off, tokens looked up and served).
- `GET /cache/stats`: the counters of both caches: the whole-response cache
  (`api/response_cache.py`, `enabled: false` when off) and the prefix cache.
- `POST /v1/admin/prepare-stop` (`{"wait": true, "timeout_s": 30}` by default): seal the
  server for a stop. New generation requests get 503 `draining` and `/health` says
  `draining` from now on (there is no unsealing: the process is meant to stop next);
  requests in flight finish. It answers 200 `{"status": "sealed", "in_flight": 0}` once
  none is left, or 202 `{"status": "draining", "in_flight": N}` when `wait` is false or
  `timeout_s` passed first; calling it again polls.
- `GET /v1/responses/{id}`: a response still in flight (`status: in_progress`); this
  server stores no finished responses (`store` is accepted and ignored), so any other id
  is a 404 `response_not_found`. `POST /v1/responses/{id}/cancel` cancels one in flight
  (as `/v1/cancel` does) and answers it with `status: cancelled`; its own stream or
  reply ends as a cancelled one; unknown or finished: 404.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response, current_app, request

from api.errors import APIError, unavailable
from api.protocol import json_or_none
from api.state import AppState, json_response, state_of

if TYPE_CHECKING:  # the facade's module imports jax; only its type is needed here
    from ferrox_jax.engine import Engine

blueprint = Blueprint("surface", __name__)

SLOTS_ROUTE = "/slots"
RESPONSES_ROUTE = "/v1/responses"
POLL_S = 0.05
MAX_PREPARE_STOP_WAIT_S = 600.0


def _state() -> AppState:
    return state_of(current_app)


def _engine_stats(state: AppState) -> tuple[Any, Any]:
    """(engine, its BatcherStats), or a 503 while nothing serves."""
    engine = state.engine
    if engine is None or state.phase in ("loading", "unloaded", "failed"):
        raise unavailable("no model is loaded", code="model_not_loaded")
    return engine, engine.stats()


# ---------------------------------------------------------------- /slots


def _busy_rows(state: AppState, engine: Engine) -> list[dict[str, Any]]:
    rows = []
    for run in list(state.inflight.values()):
        if getattr(run, "engine", None) is not engine:
            continue
        for choice in range(run.num_choices):
            job = run.jobs[choice // run.n]
            generating = run.num_output_tokens[choice] > 0 or run.first_token_at is not None
            rows.append({"id_task": run.api_id, "state": "generating" if generating else "pending",
                         "is_processing": True, "n_prompt_tokens": len(job.prompt_token_ids),
                         "n_decoded": run.num_output_tokens[choice], "route": run.route})
    return rows


@blueprint.get(SLOTS_ROUTE)
async def slots() -> Response:
    state = _state()
    engine, _stats = _engine_stats(state)
    num_slots = engine.config.max_seqs
    busy = _busy_rows(state, engine)
    idle = {"id_task": None, "state": "idle", "is_processing": False, "n_prompt_tokens": 0, "n_decoded": 0,
            "route": None}
    rows = busy + [dict(idle) for _ in range(max(0, num_slots - len(busy)))]
    if request.args.get("fail_on_no_slot") in ("1", "true") and len(busy) >= num_slots:
        raise unavailable("no slot available", code="no_slot_available")
    return json_response([{"id": i, "n_ctx": engine.max_context, **row} for i, row in enumerate(rows)])


# ---------------------------------------------------------------- caches


def _prefix_cache(engine: Engine, stats: Any) -> dict[str, Any]:
    queried, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return {"enabled": bool(engine.config.prefix_caching), "queried_tokens": queried, "hit_tokens": hits,
            "hit_rate": hits / queried if queried else 0.0, "blocks_cached": stats.kv_blocks_cached}


@blueprint.get("/v1/cache/status")
async def cache_status() -> Response:
    state = _state()
    engine, stats = _engine_stats(state)
    card = engine.model_card
    return json_response({
        "block_size": stats.kv_block_size, "blocks_total": stats.kv_blocks_total,
        "blocks_free": stats.kv_blocks_free, "blocks_used": stats.kv_blocks_total - stats.kv_blocks_free,
        "blocks_cached": stats.kv_blocks_cached, "blocks_peak": stats.kv_blocks_peak,
        "bytes_per_block": engine.sizing.bytes_per_block, "bytes_total": card.kv_bytes,
        "kv_cache_dtype": card.kv_cache_dtype, "max_context": engine.max_context,
        "prefix_cache": _prefix_cache(engine, stats)})


@blueprint.get("/cache/stats")
async def cache_stats() -> Response:
    state = _state()
    engine, stats = _engine_stats(state)
    responses = getattr(state, "response_cache", None)
    return json_response({"response_cache": responses.stats() if responses is not None else {"enabled": False},
                          "prefix_cache": _prefix_cache(engine, stats)})


# ---------------------------------------------------------------- prepare-stop


def _wait_settings(body: Any) -> tuple[bool, float]:
    body = body if body is not None else {}
    if not isinstance(body, dict):
        raise APIError(400, 'the body must be an object: {"wait": bool, "timeout_s": seconds}', code="invalid_body")
    wait, timeout_s = body.get("wait", True), body.get("timeout_s", 30.0)
    if not isinstance(wait, bool):
        raise APIError(400, "wait must be a boolean", param="wait", code="invalid_value")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not 0 <= timeout_s <= MAX_PREPARE_STOP_WAIT_S:
        raise APIError(400, f"timeout_s must be a number in [0, {MAX_PREPARE_STOP_WAIT_S:g}]", param="timeout_s",
                       code="invalid_value")
    return wait, float(timeout_s)


@blueprint.post("/v1/admin/prepare-stop")
async def prepare_stop() -> Response:
    state = _state()
    raw = await request.get_data()
    body = json_or_none(raw) if raw.strip() else None
    if raw.strip() and body is None:
        raise APIError(400, "request body is not valid JSON", code="invalid_json")
    wait, timeout_s = _wait_settings(body)
    state.phase = "draining"  # /health and every new generation: 503 draining
    deadline = time.monotonic() + (timeout_s if wait else 0.0)
    while state.inflight and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    if state.inflight:
        return json_response({"status": "draining", "in_flight": len(state.inflight)}, 202)
    return json_response({"status": "sealed", "in_flight": 0})


# ---------------------------------------------------------------- Responses lookups


def _in_flight_response(state: AppState, response_id: str) -> Any:
    run = state.inflight.get(response_id)
    if run is None or getattr(run, "route", None) != RESPONSES_ROUTE:
        raise APIError(404, f"no response {response_id!r} in flight; this server stores no finished responses "
                            "(store is not supported)", param="response_id", code="response_not_found")
    return run


def _response_object(run: Any, status: str) -> dict[str, Any]:
    model = run.engine.model_name if run.engine is not None else None
    return {"id": run.api_id, "object": "response", "created_at": int(time.time() - (time.monotonic() - run.started_at)),
            "status": status, "model": model, "output": [], "error": None, "incomplete_details": None}


@blueprint.get(RESPONSES_ROUTE + "/<response_id>")
async def get_response(response_id: str) -> Response:
    run = _in_flight_response(_state(), response_id)
    return json_response(_response_object(run, "in_progress"))


@blueprint.post(RESPONSES_ROUTE + "/<response_id>/cancel")
async def cancel_response(response_id: str) -> Response:
    run = _in_flight_response(_state(), response_id)
    run.cancel()
    return json_response(_response_object(run, "cancelled"))
