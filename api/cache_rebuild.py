"""`POST /v1/cache/rebuild`: resize the KV cache at run time.

Body: exactly one of `{"kv_blocks": N}` (the blocks requests can use, as `--kv-blocks`:
`/admin/stats` then shows `kv_blocks_total` N, and the cache holds N + 1 with the null block) or `{"kv_memory_gib": X}` (a memory budget, as `--kv-memory-gib`). The
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

Steps 1-4 run to their end even if the client disconnects (`api/sleep_routes.run_to_end`):
cut short, they would leave the phase `ready` over a sleeping engine.

It answers 200 with the new `/v1/cache/status` geometry once serving. Before step 1 the
new geometry is checked against what the device can give (`ferrox_jax/memory_bounds.py`:
the new cache, a second copy of the weights and the largest step, against the free memory
plus the old cache the rebuild frees) and against the int32 block ids: a value that does
not fit is a 400 naming the field and the largest value that fits (`insufficient_memory`),
and nothing is sealed, freed or allocated: the old engine serves on. A value the engine
refuses later (a check once the weights are placed) is a 400 naming the field too, and the
old engine is woken and serves on. One rebuild at a time, and not during a model load
(409); a model load or unload during a rebuild is a 409 as well (`api/model_admin.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

from quart import Blueprint, Response, current_app, request

from api.errors import APIError
from api.protocol import json_or_none
from api.sleep_routes import run_to_end
from api.state import AppState, json_response, state_of
from ferrox_jax.engine import MemoryBoundError

blueprint = Blueprint("cache_rebuild", __name__)

POLL_S = 0.05


def _overrides(body: Any) -> tuple[str, dict[str, Any]]:
    """The field the body sets and the config fields it replaces (kv_memory_gib clears kv_blocks)."""
    if not isinstance(body, dict):
        raise APIError(400, 'the body must be {"kv_blocks": N} or {"kv_memory_gib": X}', code="invalid_body")
    given = [key for key in ("kv_blocks", "kv_memory_gib") if body.get(key) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of kv_blocks or kv_memory_gib", param="kv_blocks", code="invalid_value")
    key = given[0]
    value = body[key]
    if key == "kv_blocks" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise APIError(400, f"kv_blocks must be a whole number of usable blocks >= 1; got {value!r}",
                       param=key, code="invalid_value")
    # json.loads reads NaN and Infinity too: a budget must be a finite positive number.
    if key == "kv_memory_gib" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                   or not (value > 0 and math.isfinite(value))):
        raise APIError(400, f"kv_memory_gib must be a finite number of GiB > 0; got {value!r}", param=key,
                       code="invalid_value")
    return key, {"kv_blocks": value} if key == "kv_blocks" else {"kv_blocks": None, "kv_memory_gib": float(value)}


def _check(old: Any, field: str, overrides: dict[str, Any]) -> Any:
    """The new config, once it is valid and fits beside the old engine; a 400 naming
    `field` otherwise. Runs before anything is sealed or freed."""
    try:
        old.check_rebuild(overrides)
    except MemoryBoundError as e:
        raise APIError(400, str(e), param=field, code=e.code) from None
    try:
        return dataclasses.replace(old.config, **overrides)
    except ValueError as e:  # EngineConfig validates field by field
        raise APIError(400, str(e).replace("EngineConfig.", ""), param=field, code="invalid_value") from None


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


async def _rebuild(state: AppState, old: Any, config: Any, field: str) -> Any:
    while state.inflight:
        await asyncio.sleep(POLL_S)
    await asyncio.wrap_future(old.sleep(1))
    try:
        new = await asyncio.to_thread(_build, config)
    except ValueError as e:  # MemoryBoundError among them: the builder checks again once the weights are placed
        await asyncio.wrap_future(old.wake())
        code = e.code if isinstance(e, MemoryBoundError) else "invalid_value"
        raise APIError(400, f"the engine refused the new geometry: {e}", param=field, code=code) from None
    except BaseException:
        await asyncio.wrap_future(old.wake())
        raise
    if old not in state.owned_engines:
        await asyncio.wrap_future(old.wake())
    return new


@blueprint.post("/v1/cache/rebuild")
async def rebuild() -> Response:
    state = state_of(current_app)
    field, overrides = _overrides(json_or_none(await request.get_data()))
    old = state.require_engine()
    if state.tasks is not None and state.tasks.is_loading:
        raise APIError(409, "a model is loading; rebuild the cache after it (GET /admin/tasks)",
                       code="load_in_progress")
    config = _check(old, field, overrides)
    state.phase = "rebuilding"  # from here on a model load or unload is a 409 (api/model_admin.py)
    return json_response(await run_to_end(_run(state, old, config, field)))


async def _run(state: AppState, old: Any, config: Any, field: str) -> dict[str, Any]:
    """Steps 2-4 (the handler sealed, step 1, right after its checks), to their end even if
    the client leaves (`run_to_end`)."""
    started = time.monotonic()
    try:
        new = await _rebuild(state, old, config, field)
    finally:
        state.phase = "ready"
    state.set_engine(new, owned=True)
    stats = new.stats()
    return {"status": "rebuilt", "seconds": round(time.monotonic() - started, 3),
            "block_size": stats.kv_block_size, "blocks_total": stats.kv_blocks_total,
            "bytes_per_block": new.sizing.bytes_per_block, "bytes_total": new.model_card.kv_bytes,
            "max_context": new.max_context, "recompiles_after_warmup": stats.recompiles_after_warmup}
