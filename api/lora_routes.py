"""LoRA adapters over HTTP: runtime loading and unloading, and picking one by `model`.

- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
  `POST /v1/unload_lora_adapter {"lora_name"}`: vLLM's routes and shapes (a plain-text
  "Success: ..." line on 200), answered only with `--enable-runtime-lora` (403
  `runtime_lora_disabled` otherwise). Like every route but /health and /metrics they sit
  behind the API key. `lora_path` must lie inside `--model-dir` (relative to it, or an
  absolute path that resolves there, symlinks followed), the rule `/admin/models` keeps:
  a path from a request body never reaches the rest of the filesystem.
- Refusals by name (`code`): `invalid_lora_name` (400: checked before anything is read
  or registered, `ferrox_jax/lora_registry.py:check_adapter_name`), `invalid_lora_path`
  (400: a NUL or a path the OS cannot take), `unsupported_architecture`, `rank_too_large`,
  `missing_target_module`, `invalid_adapter` (400: malformed files and non-finite or
  absurd weights, each named), `adapter_exists` (400), `slots_full` (409),
  `adapter_not_found` (404), `lora_path_outside_model_dir` (403).
- Quarantine: a row whose logits went non-finite blames its adapter
  (`ferrox_jax/batcher.py`), which the registry then quarantines. Requests naming it are
  refused with 409 `adapter_quarantined`, and the engine ends the jobs already running
  with it with that error (its code on the event, which `api/generation.py` answers with
  the 409); the adapter lists with its `quarantined` reason until it is unloaded and loaded
  again.
- Every protocol's `model` may name a loaded adapter instead of the base model
  (`check_model` in `api/prompts.py` accepts it); `GenerationRun` then names it in its
  jobs (`Engine.resolve_adapter`) and the engine's scheduler holds the adapter's slot from
  each job's admission to its end. `/v1/models` lists each adapter with `parent` = the
  base model's id (`lora_cards`).
- Loading and unloading go through the engine facade (`Engine.load_adapter` /
  `unload_adapter`): the files are read on a worker thread, and the slot is written (or
  the name dropped) by the engine's owner thread between two steps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response, current_app, request

from api.errors import APIError
from api.protocol import json_or_none
from api.state import state_of
from ferrox_jax.engine import LoraError, check_adapter_name

if TYPE_CHECKING:
    from ferrox_jax.engine import Engine

blueprint = Blueprint("lora", __name__)

_NAME_CODES = ("adapter_exists", "slots_full", "invalid_lora_name")  # refusals about lora_name, not the files
_STATUS = {"slots_full": 409, "adapter_not_found": 404, "adapter_quarantined": 409}


def lora_names(engine: Engine | None) -> list[str]:
    """The adapters loaded on `engine` (none without LoRA slots)."""
    return [a.name for a in engine.adapters()] if engine is not None else []


def lora_error(e: LoraError, param: str | None = None) -> APIError:
    return APIError(_STATUS.get(e.code, 400), str(e), param=param, code=e.code)


def lora_cards(engine: Engine, base: dict[str, Any]) -> list[dict[str, Any]]:
    """One /v1/models card per loaded adapter, `parent` the base model (vLLM's fields), and
    `quarantined`: why its requests are refused, or null."""
    return [{**base, "id": a.name, "created": int(a.loaded_at), "root": a.path, "parent": base["id"],
             "quarantined": a.quarantined} for a in engine.adapters()]


def lora_stats(engine: Engine | None) -> list[dict[str, Any]]:
    """Per adapter, for /admin/stats: its slot, rank and folder, requests served since it
    was loaded, requests holding it now, and why it is quarantined (or null)."""
    if engine is None:
        return []
    return [{"name": a.name, "slot": a.slot, "rank": a.rank, "path": a.path, "requests": a.num_requests,
             "running": a.num_running, "quarantined": a.quarantined} for a in engine.adapters()]


def _engine_and_body(body: Any, fields: tuple[str, ...]):
    state = state_of(current_app)
    if not state.config.enable_runtime_lora:
        raise APIError(403, "loading LoRA adapters at run time is off (start the server with --enable-runtime-lora)",
                       code="runtime_lora_disabled")
    engine = state.require_engine()
    if not engine.max_loras:
        raise APIError(400, "this server has no LoRA slots (start it with --max-loras N)", code="lora_disabled")
    if not isinstance(body, dict) or not all(isinstance(body.get(f), str) and body.get(f) for f in fields):
        raise APIError(400, f"the body must be a JSON object with string fields {', '.join(fields)}",
                       param=fields[0])
    return state, engine


def resolve_lora_path(model_dir: str | None, lora_path: str) -> Path:
    """`lora_path` inside `model_dir` (relative to it or absolute), or a 403 naming the rule."""
    if not model_dir:
        raise APIError(403, "lora_path must lie inside --model-dir, and this server has none",
                       param="lora_path", code="lora_path_outside_model_dir")
    if "\x00" in lora_path:
        raise APIError(400, "lora_path contains a NUL character; give the adapter's folder or file under --model-dir",
                       param="lora_path", code="invalid_lora_path")
    root = Path(model_dir).resolve()
    try:
        path = (root / lora_path).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a name the OS cannot encode
        raise APIError(400, f"lora_path {lora_path!r} cannot be resolved ({e}); give the adapter's folder or file "
                            "under --model-dir", param="lora_path", code="invalid_lora_path") from None
    if path != root and root not in path.parents:
        raise APIError(403, f"lora_path {lora_path!r} is outside --model-dir", param="lora_path",
                       code="lora_path_outside_model_dir")
    return path


@blueprint.post("/v1/load_lora_adapter")
async def load_lora_adapter() -> Response:
    body = json_or_none(await request.get_data())
    state, engine = _engine_and_body(body, ("lora_name", "lora_path"))
    name = body["lora_name"]
    try:
        check_adapter_name(name)  # before the path: a bad name is refused whatever it points at
    except LoraError as e:
        raise lora_error(e, "lora_name") from None
    if name == engine.model_name:
        raise APIError(400, f"lora_name {name!r} is the base model's id, which would never reach the adapter; "
                            "choose another name", param="lora_name", code="invalid_lora_name")
    path = resolve_lora_path(state.config.model_dir, body["lora_path"])
    try:  # the files are read on a worker thread; the slot is written by the engine's owner thread
        await asyncio.to_thread(engine.load_adapter, name, str(path))
    except LoraError as e:
        raise lora_error(e, "lora_name" if e.code in _NAME_CODES else "lora_path") from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", 200, content_type="text/plain")


@blueprint.post("/v1/unload_lora_adapter")
async def unload_lora_adapter() -> Response:
    body = json_or_none(await request.get_data())
    _, engine = _engine_and_body(body, ("lora_name",))
    name = body["lora_name"]
    try:
        await asyncio.to_thread(engine.unload_adapter, name)  # waits for the owner thread to take it
    except LoraError as e:
        raise lora_error(e, "lora_name") from None
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200, content_type="text/plain")
