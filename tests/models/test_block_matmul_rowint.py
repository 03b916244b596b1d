"""One activation row times Q4_0 / Q4_1 / Q8_0 blocks on integer dot products (M == 1 with
wide_rows > 0): block_matmul_rowint.inc on AVX-512 VNNI, block_matmul_rowint256.inc on AVX2
(this file runs on an AVX-512 host under FERROX_CPU_ISA=avx2 too: tests/models/test_cpu_isa.py).

The kernel splits each 32-wide activation block into two int8 parts, x ~= S (q1 + q2 / B)
with S = amax / 127 (VNNI: B 256, q1 = floor(t + 1/2 + 1/512); AVX2: B 254, q1 = round(t)),
so every activation is off by at most amax / 65024 (AVX2: 64516) of its block. Two
references, both float64: the same quantization done in numpy (float32 arithmetic, as the
kernel does it) with exact integer block dots, which the kernel must meet within float32's
accumulation bound; and the exact product x @ dequantize(w)^T, which it must meet within the
activation-rounding bound sum_b amax_b / 64500 sum_j |w_j| (plus float32's). Negative controls:
the same numpy kernel with the neighbour block's weight scale, or without its q2 part (8-bit
activations, llama.cpp's Q8_0), misses that bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cpu_kernels
from models.gguf_blocks import BLOCK, block_matmul, dequantize_host, make_weight, with_kernel
from tests.models.test_block_matmul import FORMATS, activations, block_dots_reference, bound, random_blocks

needs_rowint = pytest.mark.skipif(cpu_kernels.block_isa() not in ("AVX-512 VNNI", "AVX2"),
                                  reason="the one-row integer path needs AVX2 or AVX-512 VNNI")
AVX2 = cpu_kernels.block_isa() == "AVX2"

# K 2048 and 8192 (the 1B model's rows) threaded; 576 (the default model's: 16 + 2 blocks, a
# partial chunk / group) and 96 (3 blocks, a partial chunk alone) on one thread.
SHAPES = [(2048, 300), (8192, 37), (576, 46), (96, 5)]


def split_activations(x: np.ndarray):
    """The kernel's activation parts for one row [K]: (B q1 + q2 [K / 32, 32] int64, the
    float32 scale S / B [K / 32], q1 [K / 32, 32]), B = 256 (VNNI) or 254 (AVX2)."""
    xb = x.reshape(-1, BLOCK).astype(np.float32)
    amax = np.abs(xb).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    t = xb * inv[:, None]
    base = 254 if AVX2 else 256
    if AVX2:
        q1 = np.rint(t)
        q2 = np.rint((t - q1) * np.float32(254))
        assert np.abs(q2).max() <= 127
    else:
        q1 = np.floor(t + np.float32(0.5 + 1 / 512))
        q2 = np.clip(np.rint((t - q1) * np.float32(256)), -128, 127)
    assert np.abs(q1).max() <= 127
    scale = amax / np.float32(127) / np.float32(base)
    return base * q1.astype(np.int64) + q2.astype(np.int64), scale, q1.astype(np.int64)


def rowint_reference(x: np.ndarray, blocks: np.ndarray, fmt: str, neighbour_scale: bool = False,
                     drop_q2: bool = False) -> np.ndarray:
    """The one-row integer path in numpy: exact block dots of the kernel's activation parts,
    then d (S / B) dot + m X_b in float64. `neighbour_scale`: each block takes the next
    block's d (and m); `drop_q2`: activations rounded to 8 bits (q1 alone)."""
    values, scale, q1 = split_activations(x[0])
    if drop_q2:
        values = (254 if AVX2 else 256) * q1
    sums = x[0].reshape(-1, BLOCK).astype(np.float64).sum(axis=1)
    if neighbour_scale:
        n, size = blocks.shape[0], blocks.shape[1] // (x.shape[1] // BLOCK)
        b = blocks.reshape(n, -1, size).copy()
        head = 4 if fmt == "q4_1" else 2
        b[:, :, :head] = np.roll(b[:, :, :head], -1, axis=1)
        blocks = b.reshape(n, -1)
    return block_dots_reference(values[None], scale[None], sums[None], blocks, fmt)


def rounding_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum_b amax_b / 64500 sum_j |w_j|: the activations' rounding (amax / 65024 a value, with
    room for the float32 product x * (127 / amax)), plus float32's accumulation bound."""
    amax = np.abs(x[0].reshape(-1, BLOCK)).max(axis=1).astype(np.float64)
    per_block = np.abs(w).reshape(w.shape[0], -1, BLOCK).sum(axis=2)
    return (per_block @ amax / 64500)[None] + bound(x, w)


def one_row(fmt: str, k: int, n: int, seed: int = 0):
    blocks, x = random_blocks(fmt, n, k, seed=seed), activations(1, k, seed=seed + 1)
    x[0, BLOCK:2 * BLOCK] = 0.0  # an all-zero block (scale 0) contributes nothing
    return blocks, x, dequantize_host(blocks, fmt)


def product(blocks: np.ndarray, x: np.ndarray, fmt: str, wide_rows: int = 1) -> np.ndarray:
    weight = with_kernel(make_weight(blocks, fmt, x.shape[1]), cpu_kernels.BLOCK_TARGET, 0, wide_rows=wide_rows)
    return np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight)).astype(np.float64)


@needs_rowint
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_one_row_integer_path_within_the_activation_rounding(fmt, k, n):
    blocks, x, w = one_row(fmt, k, n)
    got = product(blocks, x, fmt)
    # the same quantization's exact dots: float32's accumulation error only
    tight = np.abs(got - rowint_reference(x, blocks, fmt))
    assert np.all(tight <= bound(x, w)), f"{fmt} [{k}, {n}]: {tight.max():.3g} off the 16-bit reference"
    # the exact product: within the activations' rounding
    err = np.abs(got - x.astype(np.float64) @ w.T)
    assert np.all(err <= rounding_bound(x, w)), f"{fmt} [{k}, {n}]: {err.max():.3g} past amax / 64500"
    # and this path ran, not the float tile (wide_rows 0), which is 10x further from it
    tile_off = np.abs(product(blocks, x, fmt, wide_rows=0) - rowint_reference(x, blocks, fmt)).max()
    assert tight.max() < tile_off / 10, f"{fmt} [{k}, {n}]: as close to the float tile as to the 16-bit reference"


@needs_rowint
@pytest.mark.parametrize("fmt", FORMATS)
def test_negative_controls_miss_the_rounding_bound(fmt):
    # the bound is tight enough to catch a kernel that applies a neighbour block's scale, or
    # rounds the activations to 8 bits (q1 alone, llama.cpp's Q8_0 activations)
    blocks, x, w = one_row(fmt, 2048, 300)
    exact = x.astype(np.float64) @ w.T
    limit = rounding_bound(x, w)
    assert np.all(np.abs(rowint_reference(x, blocks, fmt) - exact) <= limit), "the reference itself"
    assert np.any(np.abs(rowint_reference(x, blocks, fmt, neighbour_scale=True) - exact) > limit)
    assert np.any(np.abs(rowint_reference(x, blocks, fmt, drop_q2=True) - exact) > limit)


@needs_rowint
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row_does_not_depend_on_the_column_sharing(fmt):
    # [2048, 300] shares its columns over the pool; its first 37 columns alone run on one
    # thread (below the kernel's parallel size): one thread computes each element whole
    blocks, x, _ = one_row(fmt, 2048, 300, seed=3)
    np.testing.assert_array_equal(product(blocks, x, fmt)[:, :37], product(blocks[:37], x, fmt))


@needs_rowint
def test_wide_rows_zero_keeps_float32_activations_at_one_row():
    blocks, x, w = one_row("q4_0", 2048, 64)
    exact = x.astype(np.float64) @ w.T
    assert np.all(np.abs(product(blocks, x, "q4_0", wide_rows=0) - exact) <= bound(x, w)), "float tile"
    assert np.any(np.abs(product(blocks, x, "q4_0", wide_rows=5) - exact) > bound(x, w)), "integer path"
    np.testing.assert_array_equal(product(blocks, x, "q4_0", wide_rows=5), product(blocks, x, "q4_0", wide_rows=1))


@needs_rowint
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_one_row_carries_a_non_finite_activation(fmt, bad):
    # as the float path does: the engine's fault check must see it
    blocks, x, _ = one_row(fmt, 576, 12)
    x[0, 40] = bad
    assert not np.isfinite(product(blocks, x, fmt)).any()
