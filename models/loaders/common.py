"""Placement shared by every loader: check a flat name->array dict against the model.

Loaders turn a checkpoint into `{our_name: np.ndarray}` in our layout (names and shapes
in the `models/llama.py` docstring). `build_model` compares that dict with the abstract
parameters (`nnx.eval_shape`), reports every missing, unexpected and mis-shaped tensor
together, then casts to the compute dtype and places the arrays.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.llama import LlamaModel, rope_inv_freq


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model its metadata describes."""


def param_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig, dtype, decode_attention: Any = None) -> LlamaModel:
    return nnx.eval_shape(lambda: LlamaModel(cfg, dtype, rngs=nnx.Rngs(0), decode_attention=decode_attention))


def expected_params(cfg: ModelConfig, dtype=jnp.float32) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for this config."""
    state = nnx.state(abstract_model(cfg, dtype), nnx.Param)
    return {param_name(path): tuple(v.shape) for path, v in nnx.to_flat_state(state)}


def build_model(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray] | Mapping[str, Callable[[], np.ndarray]],
    dtype=jnp.float32,
    progress: Callable[[str], None] | None = None,
    *,
    decode_attention: Any = None,
) -> LlamaModel:
    """Check names and shapes, cast to `dtype`, place on the default device.

    `tensors` values may be arrays or zero-argument callables producing them (so a loader
    can dequantize lazily, one tensor at a time, keeping peak host memory low).
    Raises CheckpointError listing all missing, unexpected and mis-shaped tensors at once.
    """
    model = abstract_model(cfg, dtype, decode_attention)
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    expected = {param_name(p): p for p in flat}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model config; " + "; ".join(problems))
    values = {}
    bad_shapes = []
    for name, path in expected.items():
        raw = tensors[name]
        arr = raw() if callable(raw) else raw
        want = tuple(flat[path].shape)
        if tuple(arr.shape) != want:
            bad_shapes.append(f"{name}: checkpoint {tuple(arr.shape)} vs model {want}")
            continue
        if not np.issubdtype(np.asarray(arr[:0]).dtype, np.floating) and arr.dtype != jnp.bfloat16:
            bad_shapes.append(f"{name}: dtype {arr.dtype} is not floating point")
            continue
        values[path] = jnp.asarray(arr, dtype=dtype)
        if progress:
            progress(name)
    if bad_shapes:
        raise CheckpointError("tensor shape or dtype mismatch: " + "; ".join(bad_shapes))
    for path, variable in flat.items():
        variable.set_value(values[path])
    nnx.update(model, state)
    # The rope table is a constant derived from the config, not a checkpoint tensor.
    model.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)))
    if cfg.tie_word_embeddings:
        model.tied_lm_head = nnx.Variable(jnp.transpose(model.embed[...]))
    return model
