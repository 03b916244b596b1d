"""Int8 weight quantization: the quantized weight type, (de)quantization, and its matmul.

Serving modes (`--quantization`):

    none   float weights in the compute dtype (the default).
    int8   weight-only: int8 weights with symmetric per-output-channel f32 scales; the
           activations stay float and the matmul is `(x @ int8_as_float) * scales`. On
           TPU and GPU XLA fuses the convert into the dot, so the weights are read as
           int8 (a quarter of the f32 bytes). XLA CPU does not fuse it: the convert
           materialises float weights every step and the product is several times slower
           than float32 (docs/benchmarks.md has the figures). Use it there for memory only.
    w8a8   int8 weights as above, and int8 activations quantized per row (per token) at
           run time: an int8 x int8 -> int32 dot, rescaled by the row scale times the
           channel scale. The fast path on CPU: on one x86 device the engine hands these
           products to ferrox's AVX2 kernel (models/cpu_kernels.py; same integers, same
           result), elsewhere XLA's int8 dot, where a one-row product is padded to two
           rows because XLA CPU's one-row int8 path is several times slower.
    w8a8-block32
           the same int8 weights, with the activations quantized in blocks of 32 inputs
           (one f32 scale per block of a row, as llama.cpp's Q8_0 activations): each
           block's int8 x int8 -> int32 dot is rescaled by its own scale before the sum,
           so a row's outlier features no longer set the step of all its other values.
           XLA only (an int32 [blocks, rows, out] intermediate, then the scaled sum): an
           accuracy option, not a fast path; docs/benchmarks.md has its accuracy beside
           w8a8's.

Which weights (`quantized_channel_axis`): every projection matrix of every family (q/k/v/o,
the dense MLP's gate/up/down, each MoE expert's gate/up/down), the embedding and an
untied LM head. Norms, biases and the MoE router (tiny, and it decides the routing) stay
in the compute dtype. A `QuantizedWeight` replaces the float parameter, same shape:

    values   int8[in, out]      a projection (channel_axis 1: one scale per output column)
             int8[V, D]         the embedding (channel_axis 0: one scale per token row,
                                which is per output channel of the tied LM head [D, V])
             int8[E, in, out]   a MoE layer's expert stack (channel_axis 2: one scale per
                                expert and output column; `select_expert` slices one)
             int8[out, in]      a w8a8 projection packed for the x86 CPU kernel at load
                                (channel_axis 0, `kernel` names it; models/cpu_kernels.py)
    scales   f32[...]           the values' shape without the reduced (input) axis:
                                [out], [V] or [E, out]; w ~= values * scales broadcast back

Symmetric: scale = max|w| / 127 over the channel, values = round(w / scale) in
[-127, 127] (-128 unused, so negation is exact). The rounding error of one element is at
most scale / 2 = max|w| / 254 of its channel.

Why our own module and not qwix (Google's JAX quantization library): qwix's `QArray` and
`qwix.dot_general` do the same int8 x int8 -> int32 `lax.dot_general` on CPU (measured: the
same time within noise for the 30-layer chain at 1, 8 and 32 rows), and its model-level
PTQ works by intercepting the ops of a traced Flax call to swap parameters. Our weights
come from GGUF blocks (loaded straight to int8, below), are checked by name against the
abstract model, sharded by name (`ferrox_jax/sharding.py`) and multiplied in one place
(`project` in `models/layers.py`); a two-field pytree and two functions fit that without a
dependency, and the one-row padding is ours either way.

GGUF blocks (`requantize_blocks`): Q8_0 and Q4_0 store integers with one f16 scale per
32 inputs, `w = d_b * q`. Our per-output-channel int8 needs one scale per row, so each
row is requantized from its integers and block scales (scale = max_b(d_b max|q_b|) / 127,
values = round(q d_b / scale)): no float copy of the tensor is made, and a row whose
blocks share one scale and reach |q| = 127 comes back exactly. Other rows get at most
half a step of extra rounding (max|w| / 254 of the row); compare_logits measures what it
costs (docs/benchmarks.md). Q4_1 (`w = d_b q + m_b`) has a per-block offset, so it is
dequantized to float first and quantized like any float weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.gguf_blocks import BlockQuantizedWeight, dequantize_blocks

QUANTIZATION_MODES = ("none", "int8", "w8a8", "w8a8-block32", "gguf")  # gguf: models/gguf_blocks.py
INT8_MODES = ("int8", "w8a8", "w8a8-block32")  # the modes that place QuantizedWeight
ACTIVATION_BLOCK = 32  # w8a8-block32: inputs per activation scale
INT8_MAX = 127
GGUF_BLOCK = 32  # Q8_0 / Q4_0 values per block scale


@struct.dataclass
class QuantizedWeight:
    """An int8 weight with one f32 scale per channel (layout in the module docstring)."""

    values: jax.Array  # int8[in, out] (projection), int8[V, D] (embedding) or int8[E, in, out]
    scales: jax.Array  # f32: values' shape without the reduced axis (`reduce_axis`)
    mode: str = struct.field(pytree_node=False, default="w8a8")  # "int8", "w8a8" or "w8a8-block32"
    channel_axis: int = struct.field(pytree_node=False, default=1)
    # The XLA FFI target that multiplies this weight (a w8a8 projection laid out [out, in],
    # channel_axis 0, by models/cpu_kernels.py); None: XLA's dot.
    kernel: str | None = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def reduce_axis(self) -> int:
        return reduce_axis(len(self.shape), self.channel_axis)

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize


# Matrices quantized in the int8 modes: the last part of their flat name (`tied_lm_head`,
# the [D, V] copy of a tied embedding, is made from the quantized embedding: `tied_head`).
QUANTIZED_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                   "lm_head", "tied_lm_head"})
QUANTIZED_EXPERT_STACKS = frozenset({"experts_gate", "experts_up", "experts_down"})  # [E, in, out]


def quantized_channel_axis(name: str, shape: tuple[int, ...]) -> int | None:
    """The scales' axis if parameter `name` (flat: "layers.3.q_proj") is quantized in the
    int8 modes, else None: 1 for projections and the LM head [in, out], 0 for the
    embedding [V, D] (per row), 2 for an expert stack [E, in, out]."""
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 3:
        return 2 if leaf in QUANTIZED_EXPERT_STACKS else None
    if len(shape) != 2:
        return None
    if leaf == "embed":
        return 0
    return 1 if leaf in QUANTIZED_PROJECTIONS else None


def reduce_axis(ndim: int, channel_axis: int) -> int:
    """The axis a weight's scales are taken over: of its last two axes, the one that is not
    the channel axis (a leading axis, the experts', is kept)."""
    return 2 * ndim - 3 - channel_axis


def quantized_nbytes(shape: tuple[int, ...], channel_axis: int) -> int:
    """Bytes of a QuantizedWeight of `shape`: int8 values and f32 scales."""
    scales = [n for i, n in enumerate(shape) if i != reduce_axis(len(shape), channel_axis)]
    return int(np.prod(shape)) + 4 * int(np.prod(scales))


def check_mode(mode: str) -> None:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}")


def quantize_host(w: np.ndarray, channel_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy f32 [a, b] or [E, a, b] -> (int8 values, same shape; f32 scales, the shape
    without `reduce_axis`)."""
    w = np.asarray(w, np.float32)
    axis = reduce_axis(w.ndim, channel_axis)
    amax = np.abs(w).max(axis=axis)
    scales = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    values = np.rint(w / np.expand_dims(scales, axis))
    return np.clip(values, -INT8_MAX, INT8_MAX).astype(np.int8), scales


def quantize(w: jax.Array, mode: str, channel_axis: int = 1) -> QuantizedWeight:
    """jnp version of `quantize_host` (traceable: builds abstract models and test weights)."""
    axis = reduce_axis(w.ndim, channel_axis)
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axis)
    scales = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    values = jnp.clip(jnp.round(w / jnp.expand_dims(scales, axis)), -INT8_MAX, INT8_MAX)
    return QuantizedWeight(values.astype(jnp.int8), scales.astype(jnp.float32), mode, channel_axis)


def dequantize(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """values * scales broadcast back over the reduced axis, in `dtype`."""
    scales = jnp.expand_dims(qw.scales, qw.reduce_axis)
    return (qw.values.astype(jnp.float32) * scales).astype(dtype)


def select_expert(stack, expert: jax.Array):
    """Expert `expert` (a traced index) of a stacked [E, in, out] weight, float or quantized:
    its [in, out] matrix (a QuantizedWeight keeps that expert's scales)."""
    if isinstance(stack, QuantizedWeight):
        return QuantizedWeight(stack.values[expert], stack.scales[expert], stack.mode, channel_axis=1)
    if isinstance(stack, BlockQuantizedWeight):  # a GGUF stack kept as its blocks: that expert's rows
        return stack.replace(blocks=stack.blocks[expert])
    return stack[expert]


def requantize_blocks(ints: np.ndarray, block_scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF integer blocks -> per-row int8 (see the module docstring).

    Args:
      ints: integer array [rows, n] (Q8_0: int8; Q4_0: q - 8 in [-8, 7]), n a multiple of 32.
      block_scales: f32 [rows, n / 32], one per block of 32 along n.
    Returns:
      (int8 [rows, n], f32 scales [rows]) with ints * block_scale ~= values * scale.
    """
    rows, n = ints.shape
    blocks = ints.reshape(rows, n // GGUF_BLOCK, GGUF_BLOCK).astype(np.float32)
    d = block_scales.astype(np.float32)[:, :, None]
    amax = (np.abs(blocks).max(axis=2, keepdims=True) * np.abs(d)).max(axis=1)[:, 0]
    scales = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    values = np.rint(blocks * (d / scales[:, None, None]))
    return np.clip(values, -INT8_MAX, INT8_MAX).astype(np.int8).reshape(rows, n), scales


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric int8 of activations f32[M, K] -> (int8[M, K], f32[M, 1]).
    An all-zero row (padding) gets scale 1, so nothing divides by zero."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    return jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def quantize_row_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 of activations f32[M, K] in blocks of 32 inputs -> (int8[M, K / 32, 32],
    f32[M, K / 32]); an all-zero block gets scale 1. K must be a multiple of 32."""
    m, k = x.shape
    if k % ACTIVATION_BLOCK:
        raise ValueError(f"w8a8-block32 needs inputs in multiples of {ACTIVATION_BLOCK}; got {k}")
    blocks = x.reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def _block32_matmul(rows: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """f32[M, K] @ int8[K, N] with 32-wide activation scales: per block b an exact int32 dot
    xq[:, b] . w[b] (i32[B, M, N]), times that block's row scale, summed over b in f32."""
    xq, xs = quantize_row_blocks(rows)
    nb = xq.shape[1]
    w = qw.values.reshape(nb, ACTIVATION_BLOCK, -1)
    acc = jax.lax.dot_general(xq, w, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.int32)
    return jnp.einsum("bmn,mb->mn", acc.astype(jnp.float32), xs) * qw.scales


def quantized_matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """x [..., in] @ qw -> [..., out] in x's dtype, by qw.mode (module docstring): qw is a
    projection [in, out], or a w8a8 one packed [out, in] for the custom call `qw.kernel`
    names (models/cpu_kernels.py)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if qw.kernel is not None:
        rows = x.reshape(-1, k).astype(jnp.float32)
        out = jax.ShapeDtypeStruct((rows.shape[0], qw.shape[0]), jnp.float32)
        y = jax.ffi.ffi_call(qw.kernel, out)(rows, qw.values, qw.scales)
        return y.reshape(*lead, -1).astype(x.dtype)
    if qw.channel_axis != 1:
        raise ValueError(f"quantized_matmul needs an [in, out] weight (channel_axis 1); got {qw.channel_axis}")
    if qw.mode == "int8":
        return ((x @ qw.values.astype(x.dtype)) * qw.scales.astype(x.dtype)).astype(x.dtype)
    rows = x.reshape(-1, k).astype(jnp.float32)
    if qw.mode == "w8a8-block32":
        return _block32_matmul(rows, qw).reshape(*lead, -1).astype(x.dtype)
    m = rows.shape[0]
    if m == 1:  # XLA CPU's one-row int8 dot is several times slower than its two-row one
        rows = jnp.pad(rows, ((0, 1), (0, 0)))
    xq, xs = quantize_rows(rows)
    acc = jax.lax.dot_general(xq, qw.values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    out = acc.astype(jnp.float32) * xs * qw.scales
    return out[:m].reshape(*lead, -1).astype(x.dtype)


def tied_head(embed):
    """The [D, V] LM head of a tied embedding [V, D]: its transpose (a quantized embedding's
    per-row scales are the head's per-output-channel scales)."""
    if isinstance(embed, QuantizedWeight):
        return QuantizedWeight(embed.values.T, embed.scales, embed.mode, channel_axis=1)
    return embed.T


def embed_lookup(table, tokens: jax.Array, dtype) -> jax.Array:
    """Rows of the embedding for token ids i32[...] -> [..., D] in `dtype`; a quantized
    table (channel_axis 0) is dequantized for the gathered rows only, and so is a GGUF
    embedding kept as its blocks (`BlockQuantizedWeight`, one row of blocks per token): the
    file's values in float32, as a dequantized float32 table would give them, without the
    [V, D] float32 copy (at Llama 3.2 1B's width and SmolLM2's vocabulary, 384 MiB)."""
    if isinstance(table, QuantizedWeight):
        return (table.values[tokens].astype(jnp.float32) * table.scales[tokens][..., None]).astype(dtype)
    if isinstance(table, BlockQuantizedWeight):
        rows = table.blocks[tokens.reshape(-1)]
        return dequantize_blocks(rows, table.fmt).reshape(*tokens.shape, -1).astype(dtype)
    return table[tokens]
