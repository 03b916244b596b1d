"""MXFP4 blocks (OCP microscaling; gpt-oss's experts) kept as stored: layout, dequantization,
and the repacking of transformers' layout into it.

The layout is llama.cpp's `block_mxfp4`, 17 bytes per 32 weights, which a GGUF stores
and `BlockQuantizedWeight` (`models/gguf_blocks.py`, format "mxfp4") holds as u8[out,
in / 32 * 17], one output channel per row:

    u8 e        E8M0 scale: 2^(e - 127) (ggml: its doubled table times 2^(e - 128))
    u8 qs[16]   weight j the low nibble of qs[j], weight j + 16 its high nibble

A nibble is an FP4 (E2M1) code: w = FP4[code] * 2^(e - 127), FP4 = {0, .5, 1, 1.5, 2, 3,
4, 6} and their negatives (codes 8-15), so every weight is exact in float32.

transformers packs the same values differently (`convert_moe_packed_tensors`;
`models/loaders/mxfp4.py`): `NAME_blocks` u8[..., R, G, 16] with weight 2i in the low
nibble of byte i and 2i + 1 in its high nibble, and `NAME_scales` u8[..., R, G], the same
biased exponent. `repack_hf` moves the nibbles into ggml's order and puts each group's scale
byte before its 16 code bytes; no weight is touched, so the blocks dequantize to
transformers' values exactly (tests/models/test_block_matmul_mxfp4.py).

The product is `models/kernels/block_matmul_mxfp4.cc` on x86 (float32 activations, each
block's 16 possible values made once and picked by a lane permute), XLA's
dequantize-then-dot elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_BYTES = 17  # per 32 weights
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_host(blocks: np.ndarray, dtype=np.float64) -> np.ndarray:
    """numpy u8[rows, row bytes] -> [rows, in] in `dtype` (float64 for test references)."""
    b = np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1, BLOCK_BYTES)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32]: weight j, j + 16
    scale = np.ldexp(np.ones((), dtype), b[..., 0:1].astype(np.int32) - 127)
    return (FP4_VALUES.astype(dtype)[codes] * scale).reshape(blocks.shape[0], -1)


def dequantize_blocks(blocks: jax.Array) -> jax.Array:
    """jnp version of `dequantize_host`: u8[rows, row bytes] -> f32[rows, in] (traceable)."""
    b = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES)
    qs = b[..., 1:]
    codes = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    # 2^(e - 127) built from its bits: e 0 is the subnormal 2^-127, e 255 is 2^128 (inf).
    e = b[..., 0:1].astype(jnp.int32)
    scale = jnp.where(e == 0, jnp.float32(2.0 ** -127),
                      jax.lax.bitcast_convert_type(e << 23, jnp.float32))
    return (jnp.asarray(FP4_VALUES)[codes] * scale).reshape(blocks.shape[0], -1)


def repack_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' u8[..., R, G, 16] blocks and u8[..., R, G] scales -> u8[..., R, G * 17],
    each row one output channel's blocks in ggml's layout (module docstring)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair "
                         "(blocks must be [..., groups, 16] over scales [..., groups])")
    codes = np.empty(blocks.shape[:-1] + (32,), np.uint8)  # weight 2i: low nibble of byte i
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    out = np.empty(blocks.shape[:-1] + (BLOCK_BYTES,), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)  # ggml: weight j low, j + 16 high
    return out.reshape(*blocks.shape[:-2], -1)
