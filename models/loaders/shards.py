"""Walking a safetensors checkpoint's shards: which files hold the weights, lazy loaders for the
tensors a reader wants, and the checked read of a vision tower's tensors. Shared by the text
loader (`models/loaders/safetensors.py`) and the side readers (the vision towers, an MTP
layer), so each does not walk the shards its own way. Imports no model family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from safetensors import safe_open

from models.config import CheckpointFileError, read_json_file


def shard_files(folder: Path) -> list[Path]:
    """The folder's weight files: those its index names, else `model.safetensors`, else every
    `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_file(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointFileError(f"{index} has no weight_map object; copy the checkpoint again")
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def _lazy(shard: Path, hf_name: str) -> Callable[[], np.ndarray]:
    def load():
        with safe_open(str(shard), framework="numpy") as f:
            return f.get_tensor(hf_name)

    return load


def shard_tensors(folder: Path, rename: Callable[[str], str | None]) -> dict[str, Callable[[], np.ndarray]]:
    """{rename(hf_name): () -> numpy array} over every shard of `folder`, for the tensors whose
    `rename` is not None: the one shard walk the side readers (vision towers, an MTP layer) share."""
    loads: dict[str, Callable[[], np.ndarray]] = {}
    for shard in shard_files(Path(folder)):
        with safe_open(str(shard), framework="numpy") as f:
            for hf_name in f.keys():
                name = rename(hf_name)
                if name is not None:
                    loads[name] = _lazy(shard, hf_name)
    return loads


def read_tower(folder: Path, wanted: dict[str, str], shapes: dict[str, tuple], convert: Callable,
               prefixes: tuple[str, ...] = ("",)) -> dict[str, np.ndarray]:
    """{ours: float32 array in our layout} of a vision tower's tensors: `wanted` maps our names
    to HF names (found under any of `prefixes`), `convert(ours, raw)` lays one out as ours.
    Raises CheckpointFileError naming the first tensor missing or of another shape than `shapes`."""
    by_hf = {prefix + hf: ours for ours, hf in wanted.items() for prefix in prefixes}
    found = shard_tensors(folder, by_hf.get)
    out = {}
    for ours, hf in wanted.items():
        if ours not in found:
            raise CheckpointFileError(f"the checkpoint has no vision tensor {prefixes[0]}{hf}")
        raw = np.asarray(found[ours](), np.float32)
        value = convert(ours, raw)
        if value.shape != tuple(shapes[ours]):
            raise CheckpointFileError(f"vision tensor {hf} has shape {raw.shape}; the config implies {shapes[ours]}")
        out[ours] = value
    return out
