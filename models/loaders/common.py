"""Placement shared by every loader: check a flat name->array dict against the model.

Loaders turn a checkpoint into `{our_name: np.ndarray}` in our layout (names and shapes
in the `models/llama.py` docstring). `build_model` compares that dict with the abstract
parameters (`nnx.eval_shape`), reports every missing, unexpected and mis-shaped tensor
together, then casts to the compute dtype and places the arrays.

With a quantization mode (`models/quant.py`) the abstract model holds `QuantizedWeight`s
for its matrices; each is filled from the loader's int8 producer for that name when it has
one (GGUF Q8_0 / Q4_0 blocks, requantized per channel without a float copy), else by
quantizing the float tensor on the host, one tensor at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.llama import LlamaModel, tied_head, rope_inv_freq
from models.quant import QuantizedWeight, quantize_host

HostInt8 = tuple[np.ndarray, np.ndarray]  # (int8 values, f32 scales) in our layout


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model its metadata describes."""


def param_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig, dtype, decode_attention: Any = None, quantization: str = "none") -> LlamaModel:
    return nnx.eval_shape(lambda: LlamaModel(cfg, dtype, rngs=nnx.Rngs(0), decode_attention=decode_attention,
                                             quantization=quantization))


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
    quantization: str = "none",
    int8_tensors: Mapping[str, Callable[[], HostInt8]] | None = None,
) -> LlamaModel:
    """Check names and shapes, cast to `dtype` (or quantize), place on the default device.

    `tensors` values may be arrays or zero-argument callables producing them (so a loader
    can dequantize lazily, one tensor at a time, keeping peak host memory low).
    `int8_tensors`: for some names, a producer of (int8 values, f32 scales) in our layout,
    used instead of `tensors[name]` when that parameter is quantized.
    Raises CheckpointError listing all missing, unexpected and mis-shaped tensors at once.
    """
    model = abstract_model(cfg, dtype, decode_attention, quantization)
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
        abstract = flat[path].get_value()
        if isinstance(abstract, QuantizedWeight):
            placed = _place_quantized(name, abstract, tensors[name], (int8_tensors or {}).get(name), bad_shapes)
            if placed is not None:
                values[path] = placed
                if progress:
                    progress(name)
            continue
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
        model.tied_lm_head = nnx.Variable(tied_head(model.embed.get_value()))
    return model


def _place_quantized(name: str, abstract: QuantizedWeight, raw, int8_raw, problems: list[str]) -> QuantizedWeight | None:
    """The QuantizedWeight for one parameter: from the loader's int8 producer if it has one,
    else quantized from the float tensor. Appends to `problems` and returns None on a mismatch."""
    if int8_raw is not None:
        values, scales = int8_raw()
    else:
        arr = raw() if callable(raw) else raw
        if tuple(arr.shape) != abstract.shape:
            problems.append(f"{name}: checkpoint {tuple(arr.shape)} vs model {abstract.shape}")
            return None
        values, scales = quantize_host(np.asarray(arr, np.float32), abstract.channel_axis)
    want_scales = (abstract.shape[abstract.channel_axis],)
    if tuple(values.shape) != abstract.shape or tuple(scales.shape) != want_scales or values.dtype != np.int8:
        problems.append(f"{name}: int8 {values.dtype}{tuple(values.shape)} scales {tuple(scales.shape)} vs "
                        f"model int8{abstract.shape} scales {want_scales}")
        return None
    return QuantizedWeight(jnp.asarray(values), jnp.asarray(scales, jnp.float32), abstract.mode,
                           abstract.channel_axis)
