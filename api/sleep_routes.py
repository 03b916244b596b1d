"""Sleep and wake: `POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping` (vLLM's routes).

`POST /sleep` refuses new work at once (generation answers 503 `sleeping`, `/health` says
`sleeping` with 503), lets the requests in flight finish, then has the engine free its KV
cache (level 1, the default) and, at level 2, move its weights to host memory
(`ferrox_jax/sleep.py`); it answers `{"is_sleeping": true, "level"}` once that is done.
The prefix cache is emptied with the KV cache. `/health` and `/metrics` answer while
asleep without waking anything (they read the last published stats). `POST /wake_up`
reallocates the same shapes, puts the weights back and serves again (nothing recompiles);
both are idempotent. Errors use the OpenAI envelope: a bad level is a 400, no model a 503;
level 2 when the host has less memory available than the weights take is a 400
`insufficient_memory` (`ferrox_jax/memory_bounds.py`), a multi-host group's sleep a 400
`unsupported` (`ferrox_jax/sleep.py`), and the engine keeps serving.

Transitions are serialized: each `/sleep` and `/wake_up` holds one app-wide lock from its
check of the engine's state to its answer. So a wake that arrives while a sleep waits for
the requests in flight waits for that sleep to end, then wakes the engine, and a second
sleep answers the level the first one reached instead of putting the engine to sleep
twice. Every answer is read from the engine once its transition is done (what actually
happened), so it agrees with `/is_sleeping` and `/health` until the next transition. A
transition, once started, runs to its end even if its client disconnects
(`run_to_end`): cut short, it would leave the phase and the engine disagreeing. A sleep
during a model load is a 409 `load_in_progress` (the load's swap would bring an awake
engine in under `sleeping`), as is a load during sleep (`api/model_admin.py`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from quart import Blueprint, Response, current_app, request

from api.errors import APIError, unavailable
from api.state import json_response, state_of
from ferrox_jax.engine import Engine, MemoryBoundError, SleepRefused

blueprint = Blueprint("sleep", __name__)


def _engine():
    state = state_of(current_app)
    if state.engine is None or state.phase not in ("ready", "sleeping"):
        raise unavailable(f"no model is serving (state {state.health_state()})", code="model_not_loaded")
    return state, state.engine


def _lock() -> asyncio.Lock:
    """The app's one sleep / wake lock (made on the loop serving the app)."""
    extensions = current_app.extensions
    if "ferrox_sleep_lock" not in extensions:
        extensions["ferrox_sleep_lock"] = asyncio.Lock()
    return extensions["ferrox_sleep_lock"]


async def run_to_end(transition: Awaitable[Any]) -> Any:
    """Await `transition` in a task of its own that a client's disconnect does not cancel
    (Quart cancels a handler whose client goes away): a sleep, wake or cache rebuild cut
    short would leave the phase saying one thing and the engine another, and its engine
    call would be cancelled under the owner thread."""
    running: set[asyncio.Task] = current_app.extensions.setdefault("ferrox_transitions", set())
    task = asyncio.ensure_future(transition)
    running.add(task)  # a strong reference until it ends, whoever still awaits it

    def finished(done: asyncio.Task) -> None:
        running.discard(done)
        if not done.cancelled():
            done.exception()  # read: a transition whose client left has nobody else to raise it to

    task.add_done_callback(finished)
    return await asyncio.shield(task)


def _answer(engine: Engine, with_level: bool = True) -> dict[str, Any]:
    level = engine.sleep_level
    return {"is_sleeping": bool(level), "level": level} if with_level else {"is_sleeping": bool(level)}


@blueprint.post("/sleep")
async def sleep() -> Response:
    level_text = request.args.get("level", "1")
    if level_text not in ("1", "2"):
        raise APIError(400, f"level must be 1 (free the KV cache) or 2 (also move the weights to host); "
                            f"got {level_text!r}", param="level", code="invalid_value")
    return json_response(await run_to_end(_sleep(int(level_text))))


async def _sleep(level: int) -> dict[str, Any]:
    async with _lock():
        state, engine = _engine()
        if engine.sleep_level:  # asleep already: say at which level
            return _answer(engine)
        if state.tasks is not None and state.tasks.is_loading:
            raise APIError(409, "a model is loading; put the server to sleep after it (GET /admin/tasks)",
                           code="load_in_progress")
        try:
            engine.check_sleep(level)
            state.phase = "sleeping"  # refuse new work first; the engine sleeps once what runs has finished
            await asyncio.wrap_future(engine.sleep(level))
        except MemoryBoundError as e:
            state.phase = "ready"
            raise APIError(400, str(e), param="level", code=e.code) from None
        except SleepRefused as e:  # refused before anything was freed
            state.phase = "ready"
            raise APIError(400, str(e), code=e.code) from None
        except BaseException:
            state.phase = "ready"
            raise
        return _answer(engine)


@blueprint.post("/wake_up")
async def wake_up() -> Response:
    return json_response(await run_to_end(_wake_up()))


async def _wake_up() -> dict[str, Any]:
    async with _lock():  # a sleep under way ends first; then this wakes what it put to sleep
        state, engine = _engine()
        if engine.sleep_level:
            await asyncio.wrap_future(engine.wake())
        if state.phase == "sleeping" and not engine.sleep_level:
            state.phase = "ready"
        return _answer(engine, with_level=False)


@blueprint.get("/is_sleeping")
async def is_sleeping() -> Response:
    _state, engine = _engine()
    return json_response(_answer(engine))
