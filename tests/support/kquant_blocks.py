"""K-quant super-blocks for tests, built in numpy from ggml's definitions.

The `gguf` package dequantizes Q4_K / Q5_K / Q6_K but cannot quantize to them, so
`quantize_k` does it here, round-to-nearest from each sub-block's range (llama.cpp
searches scales iteratively; the layout, which is what a test needs, is the same, and
`tests/models/test_block_matmul_k.py` checks it against `gguf.quants.dequantize`).
`random_k_blocks` writes random bytes with realistic f16 scales instead, to cover every
bit pattern the kernels must decode.
"""

from __future__ import annotations

import numpy as np

from models.gguf_kquants import SUPER, SUPER_BYTES


def _f16(v: np.ndarray) -> np.ndarray:
    """[n] float -> u8[n, 2], the f16 bytes."""
    return np.asarray(v, np.float16).reshape(-1, 1).view(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] values 0..15 -> qs u8[n, 128]: bytes 32c + l hold sub-block 2c low, 2c + 1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(len(q), 128)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [n, 8] -> u8[n, 12] (get_scale_min_k4's inverse)."""
    out = np.empty((len(sc), 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _quantize_q45(x: np.ndarray, bits: int) -> np.ndarray:
    """[n, 256] -> Q4_K (bits 4) or Q5_K (bits 5) super-blocks u8[n, B]."""
    n, top = len(x), (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale, mins = (sub.max(axis=2) - lo) / top, -lo
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (mins.max(axis=1) / 63).astype(np.float16)
    safe = lambda v: np.where(v == 0, 1, v).astype(np.float64)  # noqa: E731
    sc = np.clip(np.rint(scale / safe(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    a = d.astype(np.float64)[:, None] * sc
    b = dmin.astype(np.float64)[:, None] * m
    q = np.clip(np.rint((sub + b[..., None]) / safe(a)[..., None]), 0, top).astype(np.uint8)
    parts = [_f16(d), _f16(dmin), _pack_scales(sc, m)]
    if bits == 5:
        qh = np.zeros((n, 32), np.uint8)
        for s in range(8):
            qh |= ((q[:, s] >> 4) & 1) << s
        parts.append(qh)
    parts.append(_pack_nibbles(q & 0x0F))
    return np.concatenate(parts, axis=1)


def _quantize_q6(x: np.ndarray) -> np.ndarray:
    """[n, 256] -> Q6_K super-blocks u8[n, 210]."""
    n = len(x)
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d).astype(np.float64)[:, None]), -128, 127).astype(np.int8)
    a = d.astype(np.float64)[:, None] * sc
    q = np.clip(np.rint(sub / np.where(a == 0, 1, a)[..., None]), -32, 31).astype(np.int64) + 32
    q = q.reshape(n, 2, 4, 32)  # weight 128 h + 32 k + l
    ql = np.zeros((n, 2, 64), np.uint8)
    qh = np.zeros((n, 2, 32), np.uint8)
    for k in range(4):
        ql[:, :, 32 * (k % 2):32 * (k % 2) + 32] |= ((q[:, :, k] & 0x0F) << (4 * (k // 2))).astype(np.uint8)
        qh |= (((q[:, :, k] >> 4) & 3) << (2 * k)).astype(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16(d)], axis=1)


def quantize_k(w: np.ndarray, fmt: str) -> np.ndarray:
    """f32 [rows, in] (in a multiple of 256) -> u8[rows, in / 256 * B] in `fmt` (q4_k, q5_k, q6_k)."""
    rows, k = w.shape
    if k % SUPER:
        raise ValueError(f"K-quant rows hold a multiple of {SUPER} values; got {k}")
    x = np.asarray(w, np.float64).reshape(-1, SUPER)
    out = _quantize_q6(x) if fmt == "q6_k" else _quantize_q45(x, 4 if fmt == "q4_k" else 5)
    return out.reshape(rows, -1)


def random_k_blocks(fmt: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """u8[rows, k / 256 * B]: random quants and packed scales, f16 d (and dmin) of
    magnitudes that give weights ~0.05, as a real projection has."""
    rng = np.random.default_rng(seed)
    n = rows * k // SUPER
    out = rng.integers(0, 256, size=(n, SUPER_BYTES[fmt]), dtype=np.uint8)
    sign = rng.choice([-1, 1], size=n)
    if fmt == "q6_k":
        out[:, 208:210] = _f16(rng.uniform(2e-5, 2e-4, n) * sign)
    else:
        out[:, 0:2] = _f16(rng.uniform(1e-4, 1e-3, n) * sign)
        out[:, 2:4] = _f16(rng.uniform(1e-4, 1e-3, n))
    return out.reshape(rows, -1)
