"""`POST /v1/cache/rebuild`: resize the KV cache at run time.

Body: exactly one of `{"kv_blocks": N}` (blocks, the null block included, as
`--kv-blocks`) or `{"kv_memory_gib": X}` (a memory budget, as `--kv-memory-gib`). The
rebuild:

 1. seals admission: new generation requests get 503 `cache_rebuilding` with
    `Retry-After: 1`, and `/health` says `rebuilding`;
 2. waits for the requests in flight to finish on the old cache;
 3. puts the old engine to sleep (its KV cache freed, `ferrox_jax/sleep.py`), so the two
    caches are never on the device together, and builds an engine with the new geometry
    from the same configuration otherwise (the checkpoint is read again), warming every
    step shape up before it serves, as a model swap does: afterwards nothing compiles;
 4. swaps it in (`AppState.set_engine`: sessions and cached responses of the old one are
    dropped) and serves again. An old engine the app did not load is woken instead of shut
    down (its owner decides).

It answers 200 with the new `/v1/cache/status` geometry once serving. A value the engine
refuses is a 400 naming the field (the old engine is woken and serves on); one rebuild at a
time, and not during a model load (409).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from quart import Blueprint, Response, current_app, request

from api.errors import APIError
from api.protocol import json_or_none
from api.state import AppState, json_response, state_of

blueprint = Blueprint("cache_rebuild", __name__)

POLL_S = 0.05


def _overrides(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, 'the body must be {"kv_blocks": N} or {"kv_memory_gib": X}', code="invalid_body")
    given = [key for key in ("kv_blocks", "kv_memory_gib") if body.get(key) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of kv_blocks or kv_memory_gib", param="kv_blocks", code="invalid_value")
    key = given[0]
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (key == "kv_blocks" and
                                                                          not isinstance(value, int)):
        raise APIError(400, f"{key} must be a {'whole ' if key == 'kv_blocks' else ''}number", param=key,
                       code="invalid_value")
    return {"kv_blocks": value} if key == "kv_blocks" else {"kv_blocks": None, "kv_memory_gib": float(value)}


def _build(config: Any) -> Any:
    """A loaded, warmed, started engine for `config` (a worker thread)."""
    from ferrox_jax.engine import Engine

    engine = Engine.load(config)
    try:
        engine.warmup()
        engine.start()
    except BaseException:
        engine.shutdown()
        raise
    return engine


async def _rebuild(state: AppState, old: Any, overrides: dict[str, Any]) -> Any:
    try:
        config = dataclasses.replace(old.config, **overrides)
    except ValueError as e:  # EngineConfig validates field by field
        raise APIError(400, str(e), param=next(iter(overrides)), code="invalid_value") from None
    while state.inflight:
        await asyncio.sleep(POLL_S)
    await asyncio.wrap_future(old.sleep(1))
    try:
        new = await asyncio.to_thread(_build, config)
    except ValueError as e:
        await asyncio.wrap_future(old.wake())
        raise APIError(400, f"the engine refused the new geometry: {e}", param=next(iter(overrides)),
                       code="invalid_value") from None
    except BaseException:
        await asyncio.wrap_future(old.wake())
        raise
    if old not in state.owned_engines:
        await asyncio.wrap_future(old.wake())
    return new


@blueprint.post("/v1/cache/rebuild")
async def rebuild() -> Response:
    state = state_of(current_app)
    overrides = _overrides(json_or_none(await request.get_data()))
    old = state.require_engine()
    if state.tasks is not None and state.tasks.is_loading:
        raise APIError(409, "a model is loading; rebuild the cache after it (GET /admin/tasks)",
                       code="load_in_progress")
    started = time.monotonic()
    state.phase = "rebuilding"
    try:
        new = await _rebuild(state, old, overrides)
    finally:
        state.phase = "ready"
    state.set_engine(new, owned=True)
    stats = new.stats()
    return json_response({"status": "rebuilt", "seconds": round(time.monotonic() - started, 3),
                          "block_size": stats.kv_block_size, "blocks_total": stats.kv_blocks_total,
                          "bytes_per_block": new.sizing.bytes_per_block, "bytes_total": new.model_card.kv_bytes,
                          "max_context": new.max_context,
                          "recompiles_after_warmup": stats.recompiles_after_warmup})
