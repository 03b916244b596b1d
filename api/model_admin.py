"""Model admin: the local checkpoints, loading one while the current model serves, unloading.

- `GET /admin/models`: the checkpoints under `--model-dir` (`FERROX_MODEL_DIR`): HF
  folders (with a `config.json`) and `.gguf` files, plus the embedded `default`, each
  with `loaded` telling whether it is the one serving now.
- `POST /admin/models/load {"model": id}`: 202 with a task id. The app's engine factory
  loads, warms up and starts the new engine in a thread while the current one keeps
  serving; then the app swaps (`AppState.set_engine`). Runs keep the engine they were
  submitted to (`GenerationRun.engine`), so requests in flight finish on the model they
  started on; an engine this app loaded is shut down once none is left on it. Both models
  are in memory during the swap. One load at a time (409 `load_in_progress`); a failed
  load leaves the current model serving and says why in its task. Not during a cache
  rebuild (409 `cache_rebuilding`): the rebuild swaps in an engine of the model it
  started from when it ends, which would silently replace the one a load swapped in; nor
  while asleep (409 `sleeping`): an awake engine would serve under `sleeping`, and
  `/is_sleeping` would contradict the sleep that was answered (`api/sleep_routes.py`).
- `POST /admin/models/unload`: generation answers 503 `model_not_loaded` until a load;
  409 during a cache rebuild or while asleep, for the same reasons.
- `GET /admin/tasks` (and `/admin/tasks/{id}`): loads and unloads, newest last.
- `POST /admin/tasks/{id}/cancel`: a pending or running load is cancelled: the loading
  thread cannot be interrupted, so it runs to its end in the background and the engine it
  built is shut down instead of swapped in; the current model keeps serving throughout.
  200 with the task (`status: cancelled`); a finished task is a 409 `task_finished`, an
  unknown one a 404.
- `/admin/download`: 501. Nothing is downloaded; checkpoints must be local.

Only listed checkpoints load (ids, not arbitrary paths): the admin routes sit behind
the API key, but a path from a request body still must not reach the filesystem.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response, current_app, request

from api import offload
from api.errors import APIError
from api.protocol import json_or_none
from api.state import AppState, json_response, state_of

if TYPE_CHECKING:  # the facade's module imports jax; only its type is needed here
    from ferrox_jax.engine import Engine

blueprint = Blueprint("model_admin", __name__)
logger = logging.getLogger("ferrox.api")

DEFAULT_ID = "default"
MAX_TASKS = 100


@dataclasses.dataclass
class Task:
    """One load or unload, as `/admin/tasks` shows it."""

    id: str
    kind: str  # "load" | "unload"
    model: str
    status: str = "pending"  # pending -> running -> succeeded | failed | cancelled
    error: str | None = None
    created_at: float = dataclasses.field(default_factory=time.time)
    finished_at: float | None = None


class TaskTable:
    """The last `MAX_TASKS` tasks (event-loop only)."""

    def __init__(self) -> None:
        self.tasks: collections.OrderedDict[str, Task] = collections.OrderedDict()

    def new(self, kind: str, model: str) -> Task:
        task = Task(id=f"task-{uuid.uuid4().hex[:12]}", kind=kind, model=model)
        self.tasks[task.id] = task
        while len(self.tasks) > MAX_TASKS:
            self.tasks.popitem(last=False)
        return task

    @property
    def is_loading(self) -> bool:
        return any(t.kind == "load" and t.status in ("pending", "running") for t in self.tasks.values())


def checkpoints(model_dir: str | None) -> list[dict[str, Any]]:
    """The embedded default, then every HF folder and .gguf file directly under `model_dir`."""
    from ferrox_jax.engine import Engine

    out = []
    try:
        out.append({"id": DEFAULT_ID, "path": Engine.resolve_checkpoint(DEFAULT_ID), "format": "gguf"})
    except FileNotFoundError:  # the package that ships it is not installed
        pass
    if model_dir and Path(model_dir).is_dir():
        for p in sorted(Path(model_dir).iterdir()):
            if p.is_dir() and (p / "config.json").is_file():
                out.append({"id": p.name, "path": str(p), "format": "hf"})
            elif p.is_file() and p.suffix == ".gguf":
                out.append({"id": p.stem, "path": str(p), "format": "gguf"})
    return out


def _loaded_path(state: AppState) -> str | None:
    return None if state.engine is None else str(Path(state.engine.checkpoint_path).resolve())


@blueprint.get("/admin/models")
async def list_models() -> Response:
    state = state_of(current_app)
    loaded = _loaded_path(state)
    data = [{**c, "loaded": str(Path(c["path"]).resolve()) == loaded} for c in checkpoints(state.config.model_dir)]
    current = None if state.engine is None else {"id": state.engine.model_name, "path": state.engine.checkpoint_path}
    return json_response({"object": "list", "data": data, "loaded": current, "model_dir": state.config.model_dir})


@blueprint.post("/admin/models/load")
async def load() -> Response:
    state = state_of(current_app)
    body = json_or_none(await request.get_data())
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'the body must be {"model": "<id from GET /admin/models>"}', param="model")
    found = {c["id"]: c for c in checkpoints(state.config.model_dir)}.get(name)
    if found is None:
        raise APIError(404, f"no checkpoint {name!r} under --model-dir {state.config.model_dir!r} "
                            "(GET /admin/models lists them)", param="model", code="model_not_found")
    if state.engine_factory is None:
        raise APIError(501, "this server was started without a way to load models", code="not_supported")
    if state.tasks.is_loading:
        raise APIError(409, "a model is already loading; see GET /admin/tasks", code="load_in_progress")
    _refuse_during_transition(state, "load")
    task = state.tasks.new("load", name)
    _start_load(state, task, DEFAULT_ID if name == DEFAULT_ID else found["path"], asyncio.get_running_loop())
    return json_response({"task_id": task.id, "status": task.status, "model": name}, 202,
                         {"Location": f"/admin/tasks/{task.id}"})


def _start_load(state: AppState, task: Task, path: str, loop: asyncio.AbstractEventLoop) -> None:
    def finish(engine: Engine | None, error: str | None) -> None:  # on the loop
        if task.status == "cancelled":  # POST /admin/tasks/{id}/cancel came first
            if engine is not None:
                threading.Thread(target=engine.shutdown, name=f"ferrox-discard-{task.id}", daemon=True).start()
            return
        task.finished_at = time.time()
        if error is not None:
            task.status, task.error = "failed", error
            return
        state.set_engine(engine, owned=True)
        task.status = "succeeded"

    def running() -> None:
        if task.status == "pending":
            task.status = "running"

    def run() -> None:
        loop.call_soon_threadsafe(running)
        try:
            engine = state.engine_factory(path)
        except Exception as e:  # reported in the task; the current model keeps serving
            loop.call_soon_threadsafe(finish, None, load_failure(task, e))
        else:
            offload.freeze_heap(collect=False)  # the new engine out of full collections' sight too
            loop.call_soon_threadsafe(finish, engine, None)

    threading.Thread(target=run, name=f"ferrox-load-{task.id}", daemon=True).start()


def _refuse_during_transition(state: AppState, what: str) -> None:
    """A 409 while `POST /v1/cache/rebuild` runs (`api/cache_rebuild.py`; its end swaps its
    own engine in) or while the server sleeps (`api/sleep_routes.py`). Checked and acted on
    with no await between, on the event loop, so neither can start in between."""
    if state.phase == "rebuilding":
        raise APIError(409, f"the KV cache is being rebuilt (POST /v1/cache/rebuild); {what} the model once "
                            "GET /health says ready", code="cache_rebuilding")
    if state.phase == "sleeping":
        raise APIError(409, f"the server is asleep (POST /sleep); POST /wake_up first, then {what} the model",
                       code="sleeping")


def load_failure(task: Task, e: Exception) -> str:
    """A failed load's `error`, for clients: never an exception class name. A checkpoint or
    setting the engine refuses (ValueError, OSError) is its message; anything else is a bug,
    logged with its traceback under the task id the message gives."""
    if isinstance(e, (ValueError, OSError)):
        logger.error("%s: loading %s failed: %s", task.id, task.model, e)
        return str(e)
    logger.error("%s: loading %s failed unexpectedly", task.id, task.model, exc_info=e)
    return f"loading failed unexpectedly ({e}); the server log has the traceback under {task.id}"


@blueprint.post("/admin/models/unload")
async def unload() -> Response:
    state = state_of(current_app)
    if state.engine is None:
        raise APIError(409, "no model is loaded", code="model_not_loaded")
    _refuse_during_transition(state, "unload")
    task = state.tasks.new("unload", state.engine.model_name)
    state.set_engine(None)
    task.status, task.finished_at = "succeeded", time.time()
    return json_response({"task_id": task.id, "status": task.status, "model": task.model})


@blueprint.get("/admin/tasks")
async def tasks() -> Response:
    state = state_of(current_app)
    return json_response({"object": "list", "data": [dataclasses.asdict(t) for t in state.tasks.tasks.values()]})


@blueprint.get("/admin/tasks/<task_id>")
async def task(task_id: str) -> Response:
    found = state_of(current_app).tasks.tasks.get(task_id)
    if found is None:
        raise APIError(404, f"no task {task_id!r}", code="not_found")
    return json_response(dataclasses.asdict(found))


@blueprint.post("/admin/tasks/<task_id>/cancel")
async def cancel_task(task_id: str) -> Response:
    found = state_of(current_app).tasks.tasks.get(task_id)
    if found is None:
        raise APIError(404, f"no task {task_id!r}", code="not_found")
    if found.status not in ("pending", "running"):
        raise APIError(409, f"task {task_id!r} already {found.status}; only a pending or running load can be "
                            "cancelled", code="task_finished")
    found.status, found.finished_at = "cancelled", time.time()
    return json_response(dataclasses.asdict(found))


@blueprint.route("/admin/download", methods=["GET", "POST"])
async def download() -> Response:
    raise APIError(501, "this server downloads nothing: checkpoints must be local; put them under --model-dir "
                        "(FERROX_MODEL_DIR) and load them with POST /admin/models/load", code="not_supported")
