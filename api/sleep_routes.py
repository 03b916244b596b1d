"""Sleep and wake: `POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping` (vLLM's routes).

`POST /sleep` refuses new work at once (generation answers 503 `sleeping`, `/health`
says `sleeping` with 503), lets the requests in flight finish, then has the engine free
its KV cache (level 1, the default) and, at level 2, move its weights to host memory
(`ferrox_jax/sleep.py`); it answers `{"is_sleeping": true, "level"}` once that is done.
The prefix cache is emptied with the KV cache. `/health` and `/metrics` answer while
asleep without waking anything (they read the last published stats). `POST /wake_up`
reallocates the same shapes, puts the weights back and serves again (nothing recompiles);
both are idempotent. Errors use the OpenAI envelope: a bad level is a 400, no model a 503.
"""

from __future__ import annotations

import asyncio

from quart import Blueprint, Response, current_app, request

from api.errors import APIError, unavailable
from api.state import json_response, state_of

blueprint = Blueprint("sleep", __name__)


def _engine():
    state = state_of(current_app)
    if state.engine is None or state.phase not in ("ready", "sleeping"):
        raise unavailable(f"no model is serving (state {state.health_state()})", code="model_not_loaded")
    return state, state.engine


@blueprint.post("/sleep")
async def sleep() -> Response:
    state, engine = _engine()
    level_text = request.args.get("level", "1")
    if level_text not in ("1", "2"):
        raise APIError(400, f"level must be 1 (free the KV cache) or 2 (also move the weights to host); "
                            f"got {level_text!r}", param="level", code="invalid_value")
    if engine.sleep_level:
        return json_response({"is_sleeping": True, "level": engine.sleep_level})
    state.phase = "sleeping"  # refuse new work first; the engine sleeps once what runs has finished
    try:
        await asyncio.wrap_future(engine.sleep(int(level_text)))
    except BaseException:
        state.phase = "ready"
        raise
    return json_response({"is_sleeping": True, "level": engine.sleep_level})


@blueprint.post("/wake_up")
async def wake_up() -> Response:
    state, engine = _engine()
    if engine.sleep_level:
        await asyncio.wrap_future(engine.wake())
    if state.phase == "sleeping":
        state.phase = "ready"
    return json_response({"is_sleeping": False})


@blueprint.get("/is_sleeping")
async def is_sleeping() -> Response:
    _state, engine = _engine()
    return json_response({"is_sleeping": bool(engine.sleep_level), "level": engine.sleep_level})
