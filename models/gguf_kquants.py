"""GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K) kept as shipped: layout and dequantization.

llama.cpp's Q4_K_M / Q5_K_M / Q6_K files, the most common GGUFs, store most projections in
these formats; `--quantization gguf` serves them as their bytes, as it does Q4_0 / Q4_1 /
Q8_0 (`models/gguf_blocks.py`, whose `BlockQuantizedWeight` holds them too: `fmt` names
the format, and a row's inputs are in / 256 super-blocks of B bytes instead of in / 32
blocks). The layouts are ggml's `block_q4_K` / `block_q5_K` / `block_q6_K`, checked
against the `gguf` package's dequantizers (tests/models/test_block_matmul_k.py):

    Q4_K  B = 144  f16 d, f16 dmin, u8 scales[12], u8 qs[128]
    Q5_K  B = 176  f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
    Q6_K  B = 210  u8 ql[128], u8 qh[64], s8 scales[16], f16 d

Q4_K / Q5_K: eight 32-wide sub-blocks s, each with a 6-bit scale sc_s and min m_s packed
into `scales` (bytes 0-3: low 6 bits of sc 0-3, top 2 bits the high bits of sc 4-7; bytes
4-7 the same for the mins; bytes 8-11: low nibble sc 4-7, high nibble m 4-7);
w = d sc_s q - dmin m_s, q the nibble (Q5_K: plus 16 times bit s of qh[l]); qs bytes
32c .. 32c + 31 hold sub-block 2c in their low nibbles and 2c + 1 in their high ones.
Q6_K: sixteen 16-wide sub-blocks with int8 scales, w = d sc q for q in [-32, 31]: per
128-weight half, weight 32k + l is ql[l] (k 0, 2) or ql[32 + l] (k 1, 3), low nibble for
k < 2, high otherwise, plus bits 2k, 2k + 1 of qh[l] as bits 4-5, minus 32.

The product is the kernel of `models/kernels/block_matmul_k.cc` (float32 activations,
super-blocks dequantized in registers) on x86, and XLA's dequantize-then-dot elsewhere.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

SUPER = 256  # values per K-quant super-block
SUPER_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


def _scales_mins(sc, xp):
    """The 8 sub-blocks' 6-bit scales and mins from the 12 packed bytes [..., 12] (uint8)."""
    lo, mid, hi = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = xp.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = xp.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def _dequantize(b, fmt: str, xp, half: Callable, signed: Callable, dtype):
    """[rows, supers, B] uint8 -> [rows, supers * 256] in `dtype` (numpy or jnp via `xp`)."""
    rows, supers = b.shape[0], b.shape[1]
    if fmt == "q6_k":
        ql = b[..., 0:128].reshape(rows, supers, 2, 64)
        qh = b[..., 128:192].reshape(rows, supers, 2, 32)
        low = xp.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        high = xp.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
        q = (low | (high << 4)).astype(dtype) - 32  # [rows, supers, 2, 4, 32]: weight 128 n + 32 k + l
        scale = half(b[..., 208:210]) * signed(b[..., 192:208]).astype(dtype)  # [rows, supers, 16]
        return (scale[..., None] * q.reshape(rows, supers, 16, 16)).reshape(rows, -1)
    d, dmin = half(b[..., 0:2]), half(b[..., 2:4])  # [rows, supers, 1]
    scales, mins = _scales_mins(b[..., 4:16], xp)
    qs = b[..., 16:144] if fmt == "q4_k" else b[..., 48:176]
    qs = qs.reshape(rows, supers, 4, 1, 32)
    q = xp.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, supers, 8, 32).astype(dtype)
    if fmt == "q5_k":
        qh = b[..., 16:48][..., None, :]  # bit s of qh[l]: value l of sub-block s
        bits = xp.concatenate([(qh >> s) & 1 for s in range(8)], axis=-2)
        q = q + 16 * bits.astype(dtype)
    w = (d * scales.astype(dtype))[..., None] * q - (dmin * mins.astype(dtype))[..., None]
    return w.reshape(rows, -1)


def dequantize_host(blocks: np.ndarray, fmt: str, dtype=np.float64) -> np.ndarray:
    """numpy u8[rows, row bytes] -> [rows, in] in `dtype` (float64 for test references)."""
    b = np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1, SUPER_BYTES[fmt])
    return _dequantize(b, fmt, np, lambda x: x.copy().view(np.float16).astype(dtype),
                       lambda x: x.copy().view(np.int8), dtype)


def dequantize_blocks(blocks: jax.Array, fmt: str) -> jax.Array:
    """jnp version of `dequantize_host`: u8[rows, row bytes] -> f32[rows, in] (traceable)."""
    b = blocks.reshape(blocks.shape[0], -1, SUPER_BYTES[fmt])

    def half(x):  # [..., 2] bytes -> f32[..., 1]
        return jax.lax.bitcast_convert_type(x, jnp.float16).astype(jnp.float32)[..., None]

    return _dequantize(b, fmt, jnp, half, lambda x: jax.lax.bitcast_convert_type(x, jnp.int8), jnp.float32)
