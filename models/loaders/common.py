"""Placement shared by every loader: check a flat name->array dict against the model.

Loaders turn a checkpoint into `{our_name: np.ndarray}` in our layout (names and shapes
in each family module's docstring; `models/registry.py` picks the family from
`cfg.architecture`). `build_model` compares that dict with the abstract parameters
(`nnx.eval_shape`), reports every missing, unexpected and mis-shaped tensor together,
then casts to the compute dtype and places the arrays.

With a quantization mode (`models/quant.py`: "int8" or "w8a8") the parameters
`quantized_channel_axis` names are placed as `QuantizedWeight`s instead: from the loader's
int8 producer for that name when it has one (GGUF Q8_0 / Q4_0 blocks, requantized per
channel without a float copy), else by quantizing the float tensor on the host, one
tensor at a time. The abstract model stays float: a quantized weight has its shape.

`map_layer_tensors` is the name mapping both loaders share: a family's weight table
(`models/family.py`) applied to one checkpoint's per-layer tensors, splitting fused
tensors, stacking per-expert ones and cutting all-experts ones (`ExpertStack`).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.decoder import CausalLM
from models.family import ExpertStack, WeightTable
from models.gguf_blocks import BlockQuantizedWeight, make_weight
from models.quant import INT8_MODES, QuantizedWeight, check_mode, quantize_host, quantized_channel_axis, reduce_axis, tied_head

HostInt8 = tuple[np.ndarray, np.ndarray]  # (int8 values, f32 scales) in our layout


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model its metadata describes."""


def param_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig, dtype, decode_attention: Any = None) -> CausalLM:
    """The model's abstract parameters (`nnx.eval_shape`: shapes and dtypes, nothing
    allocated), a new object each call: callers fill it in place.

    The trace is cached per (config, dtype) and each call merges a fresh model from it,
    so the loader's tensor tables (`expected_params`) and `build_model` trace the model
    once between them. `decode_attention` is only stored on the model, not used while it
    is built (`models/decoder.py`), so it is set on the merged copy rather than traced."""
    try:
        graphdef, state = _traced(cfg, jnp.dtype(dtype))
    except TypeError:  # a config with an unhashable field: trace it each time
        graphdef, state = _traced.__wrapped__(cfg, jnp.dtype(dtype))
    # copy=True: the Variables are new, so filling this model leaves the cached trace abstract.
    model = nnx.merge(graphdef, state, copy=True)
    model.decode_attention = decode_attention
    return model


class ShapeOnlyRngs:
    """The `rngs` of `abstract_model`'s trace, which wants shapes and dtypes, not values: every
    draw is the same key. `nnx.Rngs` counts its draws in a Variable and flax asks each new
    count for its `sharding`; inside a trace JAX refuses with a message that walks the whole
    trace so far, so the 1B's trace spent 0.16 of its 0.24 s of CPU on messages nobody read
    (docs/benchmarks.md). The models draw only through `models/layers.py:param`."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


@functools.lru_cache(maxsize=4)
def _traced(cfg: ModelConfig, dtype) -> tuple:
    from models.registry import family_for

    model_class = family_for(cfg.architecture).model
    return nnx.split(nnx.eval_shape(lambda: model_class(cfg, dtype, rngs=ShapeOnlyRngs())))


def expected_params(cfg: ModelConfig, dtype=jnp.float32) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes for this config (from `abstract_model`'s cached trace:
    each of a GGUF's tensor tables asks, and `build_model` then reuses the same trace)."""
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
    block_tensors: Mapping[str, Callable[[], tuple[np.ndarray, str]]] | None = None,
) -> CausalLM:
    """Check names and shapes, cast to `dtype` (or quantize), place on the default device.

    `tensors` values may be arrays or zero-argument callables producing them (so a loader
    can dequantize lazily, one tensor at a time, keeping peak host memory low).
    `int8_tensors`: for some names, a producer of (int8 values, f32 scales) in our layout,
    used instead of `tensors[name]` when that parameter is quantized (module docstring).
    `block_tensors`: with quantization "gguf", a producer of a GGUF tensor's raw block rows
    (`models/loaders/gguf_blocks.py`); those projections and the embedding (with a tied LM
    head, the same array) are placed as BlockQuantizedWeight and everything else as float.
    Raises CheckpointError listing all missing, unexpected and mis-shaped tensors at once.
    """
    check_mode(quantization)
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
        want = tuple(flat[path].shape)
        axis = quantized_channel_axis(name, want) if quantization in INT8_MODES else None
        blocks = (block_tensors or {}).get(name) if quantization == "gguf" else None
        if blocks is not None and quantized_channel_axis(name, want) in (1, 2):
            # a projection [in, out], or an expert stack [E, in, out] kept as u8[E, out, row bytes]
            placed = _place_blocks(name, want, blocks, bad_shapes)
        elif blocks is not None and name == "embed":
            # The embedding [V, D] kept as its V rows of blocks: lookups dequantize the gathered
            # rows only (`models/quant.py:embed_lookup`), and a tied LM head is the same array.
            placed = _place_blocks(name, want[::-1], blocks, bad_shapes)
        elif axis is not None:
            placed = _place_quantized(name, want, axis, quantization, tensors[name],
                                      (int8_tensors or {}).get(name), bad_shapes)
        else:
            placed = _place_float(name, want, dtype, tensors[name], bad_shapes)
        if placed is not None:
            values[path] = placed
            if progress:
                progress(name)
    if bad_shapes:
        raise CheckpointError("tensor shape or dtype mismatch: " + "; ".join(bad_shapes))
    for path, variable in flat.items():
        variable.set_value(values[path])
    nnx.update(model, state)
    if cfg.tie_word_embeddings:
        embed = model.embed.get_value()
        # Block rows serve as the head as they are ([D, V] logically: one row per token).
        model.tied_lm_head = nnx.Variable(embed if isinstance(embed, BlockQuantizedWeight) else tied_head(embed))
    return model


def _place_blocks(name: str, shape: tuple[int, ...], raw, problems: list[str]) -> BlockQuantizedWeight | None:
    """A projection [in, out] (or an expert stack [E, in, out]) as GGUF block rows
    (`models/gguf_blocks.py`); appends to `problems` and returns None on a mismatch."""
    blocks, fmt = raw()
    try:
        weight = make_weight(blocks, fmt, shape[-2])
    except ValueError as e:
        problems.append(f"{name}: {e}")
        return None
    if weight.shape != tuple(shape):
        problems.append(f"{name}: {fmt} blocks {weight.shape} vs model {tuple(shape)}")
        return None
    return weight


def _place_float(name: str, shape: tuple[int, ...], dtype, raw, problems: list[str]) -> jax.Array | None:
    """One float parameter in `dtype`; appends to `problems` and returns None on a mismatch."""
    arr = raw() if callable(raw) else raw
    if tuple(arr.shape) != shape:
        problems.append(f"{name}: checkpoint {tuple(arr.shape)} vs model {shape}")
        return None
    # A placed array spanning several processes cannot be read back whole, not even [:0].
    kind = arr.dtype if isinstance(arr, jax.Array) else np.asarray(arr[:0]).dtype
    if not np.issubdtype(kind, np.floating) and arr.dtype != jnp.bfloat16:
        problems.append(f"{name}: dtype {arr.dtype} is not floating point")
        return None
    return jnp.asarray(arr, dtype=dtype)


def _place_quantized(name: str, shape: tuple[int, ...], axis: int, mode: str, raw, int8_raw,
                     problems: list[str]) -> QuantizedWeight | None:
    """The QuantizedWeight for one parameter of `shape`: from the loader's int8 producer if
    it has one, else quantized from the float tensor. Appends to `problems` and returns
    None on a mismatch."""
    if int8_raw is not None:
        values, scales = int8_raw()
    else:
        arr = raw() if callable(raw) else raw
        if tuple(arr.shape) != shape:
            problems.append(f"{name}: checkpoint {tuple(arr.shape)} vs model {shape}")
            return None
        values, scales = quantize_host(np.asarray(arr, np.float32), axis)
    want_scales = tuple(n for i, n in enumerate(shape) if i != reduce_axis(len(shape), axis))
    if tuple(values.shape) != shape or tuple(scales.shape) != want_scales or values.dtype != np.int8:
        problems.append(f"{name}: int8 {values.dtype}{tuple(values.shape)} scales {tuple(scales.shape)} vs "
                        f"model int8{shape} scales {want_scales}")
        return None
    return QuantizedWeight(jnp.asarray(values), jnp.asarray(scales, jnp.float32), mode, axis)


# -- name mapping shared by the loaders ----------------------------------------------------

Lazy = Callable[[], np.ndarray]


def map_layer_tensors(layer: int, suffix: str, load: Lazy, table: WeightTable,
                      expected: Mapping[str, tuple[int, ...]], experts: dict) -> dict[str, Lazy] | None:
    """Our tensors from one checkpoint tensor of layer `layer` (`suffix`: its name after the
    layer prefix; `load`: reads it as `[out, in]` or `[n]`), per the family's table.

    Returns {our name: lazy array in our layout}, {} when the tensor is one expert's slice
    (collected into `experts` until `stack_experts`), or None when the table has no entry.
    Projection weights are transposed to `[in, out]`; a fused tensor is split by rows in
    proportion to the expected output widths of its targets (`expected`: our name -> shape).
    """
    prefix = f"layers.{layer}."
    target = table.get(suffix)
    if target is None:
        for key, name in table.items():
            m = _expert_pattern(key).match(suffix)
            if m:
                experts.setdefault(prefix + name, {})[int(m.group(1))] = load
                return {}
        return None
    if isinstance(target, str):
        return {prefix + target: _transposed(load)}
    if isinstance(target, ExpertStack):
        return {prefix + name: _expert_stack(load, target, i) for i, name in enumerate(target.names)}
    names = [prefix + t for t in target]
    missing = [n for n in names if n not in expected]
    if missing:
        raise CheckpointError(f"fused tensor {suffix} of layer {layer} splits into {', '.join(missing)}, "
                              "which this model config does not have")
    widths = [expected[n][-1] for n in names]
    return {name: _split_rows(load, sum(widths[:i]), width) for i, (name, width) in enumerate(zip(names, widths))}


def stack_experts(experts: dict, num_experts: int | None) -> dict[str, Lazy]:
    """{our name: lazy [E, in, out] stack} from the per-expert `[out, in]` slices collected."""
    out = {}
    for name, by_index in experts.items():
        if num_experts is None or sorted(by_index) != list(range(num_experts)):
            raise CheckpointError(f"{name}: checkpoint has experts {sorted(by_index)[:8]}... for "
                                  f"{num_experts} experts in the config")
        loads = [by_index[i] for i in range(num_experts)]
        out[name] = lambda loads=loads: np.stack([np.asarray(f()).T for f in loads])
    return out


def _expert_stack(load: Lazy, stack: ExpertStack, index: int) -> Lazy:
    """Our `stack.names[index]` from an all-experts tensor (`ExpertStack`): every
    len(names)-th column of its last axis from `index` on (or, with `halves`, the index-th
    of len(names) equal runs of columns), each expert transposed when the tensor is [E, out, in]."""
    def read():
        arr = np.asarray(load())
        if stack.transpose:
            arr = arr.swapaxes(-1, -2)
        step = len(stack.names)
        if stack.halves:
            width = arr.shape[-1] // step
            return np.ascontiguousarray(arr[..., index * width:(index + 1) * width])
        return np.ascontiguousarray(arr[..., index::step]) if step > 1 else arr
    return read


def _expert_pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(re.escape("{e}"), r"(\d+)") + "$")


def _transposed(load: Lazy) -> Lazy:
    def read():
        arr = load()
        return arr.T if arr.ndim == 2 else arr

    return read


def _split_rows(load: Lazy, start: int, width: int) -> Lazy:
    def read():
        arr = load()
        rows = arr[start:start + width]
        if rows.shape[0] != width:
            raise CheckpointError(f"fused tensor of {arr.shape[0]} rows is too short for rows {start}..{start + width}")
        return rows.T
    return read
