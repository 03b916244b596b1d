"""Q4_0 / Q4_1 / Q8_0 products of 2 to 15 rows on 16-bit activations (block_matmul_rows16.inc).

With `wide_rows` at or below M on AVX-512 VNNI (5 by default: 2 to 4 rows keep the float
tile), block_matmul.cc takes 5 to 12 rows on block_matmul_rows16.inc (rows and columns in
the lanes of a vpdpwssd: 4 rows x 2 columns a 256-bit vector) and the rest on
block_matmul_i16.inc's 8-lane row groups (here with wide_rows 2, 2 to 4 rows too). Both
round the activations to int16 per 32-wide block (S = amax / 32767) and sum the same block
terms in the same order, so each is checked against the int16 reference of
tests/models/test_block_matmul.py (integer dots exact, the rest float64) within float32's few
ulps, and against float64 x @ dequantize(w)^T within the activation rounding (amax / 65534 per
block times sum |w|). The library's counter of rows16 products says which path ran. Shapes:
a 1B model's row lengths (K 2048 and 8192), columns shared over the pool (n 200: 25 8-column
panels, the last one short in the thread chunks). At 5 to 8 rows the int16 activations split
into byte halves for vpdpbusd (block_matmul_rows16_halves.inc: the same integer dots, so the
same bounds); its own counter says where that ran.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cpu_kernels
from models.gguf_blocks import BLOCK, block_matmul, block_matmul_many, dequantize_host, make_weight, with_kernel
from tests.models.test_block_matmul import FORMATS, activations, bound, random_blocks, wide_reference

needs_wide = pytest.mark.skipif(cpu_kernels.block_isa() != "AVX-512 VNNI",
                                reason="the 16-bit activation paths are in the AVX-512 VNNI build only")

ROWS16 = tuple(range(5, 13))  # Rows16PerGroup's rows; 2-4 stay on the float tile, 13-15 on block_matmul_i16.inc


def rows16_calls() -> int:
    lib = ctypes.cdll.LoadLibrary(str(cpu_kernels.LIBRARY))
    lib.ferrox_block_rows16_calls.restype = ctypes.c_int64
    return lib.ferrox_block_rows16_calls()


def rows16_halves_calls() -> int:
    lib = ctypes.cdll.LoadLibrary(str(cpu_kernels.LIBRARY))
    lib.ferrox_block_rows16_halves_calls.restype = ctypes.c_int64
    return lib.ferrox_block_rows16_halves_calls()


def int16_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|x16 - x| <= amax / 65534 per 32-wide block, times sum |w| over the block, plus float32's bound."""
    m, k = x.shape
    amax = np.abs(x.astype(np.float64)).reshape(m, k // BLOCK, BLOCK).max(axis=2)
    wsum = np.abs(w).reshape(w.shape[0], k // BLOCK, BLOCK).sum(axis=2)
    return amax / 65534 @ wsum.T * 1.0001 + bound(x, w)


def product(fmt, rows, k, n, seed, x=None):
    blocks = random_blocks(fmt, n, k, seed=seed)
    x = activations(rows, k, seed=seed + 1) if x is None else x
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0, wide_rows=2)
    before = rows16_calls()
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    return blocks, x, got, rows16_calls() - before


@needs_wide
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [2048, 8192])
@pytest.mark.parametrize("rows", [2, 4, 5, 7, 8, 9, 12, 15])
def test_rows_2_to_15_within_the_int16_bound(fmt, k, rows):
    n = 200
    blocks, x, got, calls = product(fmt, rows, k, n, seed=rows)
    w = dequantize_host(blocks, fmt)
    assert calls == (1 if rows in ROWS16 else 0), f"{rows} rows: rows16 ran {calls} times"
    err = np.abs(got - wide_reference(x, blocks, fmt))
    assert np.all(err <= bound(x, w)), f"{fmt} {rows}x[{k}, {n}] vs int16 reference: max error {err.max():.3g}"
    exact = x.astype(np.float64) @ w.T
    assert np.all(np.abs(got - exact) <= int16_bound(x, w)), f"{fmt} {rows} rows vs float64"


@needs_wide
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [5, 8, 12])
def test_rows_are_quantized_each_on_its_own(fmt, rows):
    # Row 0 1000x the others', row 1 zero, row 2 one spike (exact: a single value is
    # its block's amax, 32767 S = x), in the first group; a row read with another lane's
    # activations or scale misses its bound or moves the zero row off zero. Negative
    # control: the same product with each row's activations rounded to 8 bits per block
    # (llama.cpp's Q8_0 activations) misses the 16-bit bound, so the check tells them apart.
    k, n = 2048, 64
    x = activations(rows, k, seed=30 + rows)
    x[0] *= 1000.0
    x[1] = 0.0
    x[2] = 0.0
    x[2, 700] = 3.0
    blocks, x, got, calls = product(fmt, rows, k, n, seed=31, x=x)
    assert calls == 1
    w = dequantize_host(blocks, fmt)
    exact = x.astype(np.float64) @ w.T
    assert np.all(np.abs(got - exact) <= int16_bound(x, w)), f"{fmt}: a row off its 16-bit bound"
    assert np.all(got[1] == 0), "the zero row stays zero"
    np.testing.assert_allclose(got[2], exact[2], rtol=1e-6, atol=1e-6)
    xb = x.reshape(rows, -1, BLOCK)
    s = np.abs(xb).max(axis=2, keepdims=True) / 127
    x8 = (np.rint(xb / np.where(s > 0, s, 1)) * s).reshape(rows, k)
    assert np.any(np.abs(x8 @ w.T - exact)[3:] > int16_bound(x, w)[3:]), "8-bit activations must miss the bound"


@needs_wide
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_activation_stays_in_its_row(bad):
    # as the float path: the engine's fault check must see it; the other rows are unchanged
    k, n = 2048, 40
    blocks, x = random_blocks("q4_0", n, k), activations(6, k)
    x[1, 70] = bad
    weight = with_kernel(make_weight(blocks, "q4_0", k), cpu_kernels.BLOCK_TARGET, 0, wide_rows=2)
    got = np.asarray(block_matmul(jnp.asarray(x), weight))
    assert not np.isfinite(got[1]).any()
    rest = [0, 2, 3, 4, 5]  # 5 rows: the same path (4-row groups), each element its own row's sums
    assert np.isfinite(got[rest]).all()
    np.testing.assert_array_equal(got[rest], np.asarray(block_matmul(jnp.asarray(x[rest]), weight)))


@needs_wide
def test_fused_call_equals_one_call_per_weight():
    # q/k/v of 3 formats quantize x once and share the columns; each weight gets its own bits
    k = 2048
    specs = [("q4_0", 72), ("q8_0", 20), ("q4_1", 36)]
    weights = [with_kernel(make_weight(random_blocks(fmt, n, k, seed=40 + i), fmt, k), cpu_kernels.BLOCK_TARGET, 0,
                           wide_rows=2) for i, (fmt, n) in enumerate(specs)]
    x = jnp.asarray(activations(7, k, seed=44))
    for w, got in zip(weights, jax.jit(block_matmul_many)(x, weights)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(block_matmul)(x, w)))


@needs_wide
def test_wide_rows_0_keeps_float32():
    # --block-wide-rows 0: the float panel at 8 rows, float32 rounding only, no rows16 product
    k, n = 2048, 64
    blocks, x = random_blocks("q4_1", n, k), activations(8, k)
    w = dequantize_host(blocks, "q4_1")
    before = rows16_calls()
    got = np.asarray(block_matmul(jnp.asarray(x), with_kernel(make_weight(blocks, "q4_1", k),
                                                              cpu_kernels.BLOCK_TARGET, 0, wide_rows=0)))
    assert rows16_calls() == before
    assert np.all(np.abs(got - x.astype(np.float64) @ w.T) <= bound(x, w))


@needs_wide
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [4, 5, 8, 9, 12])
def test_5_to_8_rows_take_the_byte_halves(fmt, rows):
    # Rows16TakesHalves: two 4-row groups (5-8 rows); three groups (9-12) stay on the int16
    # pairs, 4 rows (wide_rows 2) on block_matmul_i16.inc
    k, n = 512, 44  # 44 columns: 5 whole 8-column tiles and a short one of 4
    before = rows16_halves_calls()
    blocks, x, got, _ = product(fmt, rows, k, n, seed=50 + rows)
    want = 1 if 5 <= rows <= 8 else 0
    assert rows16_halves_calls() - before == want, f"{fmt} {rows} rows: byte halves ran {rows16_halves_calls() - before}"
    err = np.abs(got - wide_reference(x, blocks, fmt))
    assert np.all(err <= bound(x, dequantize_host(blocks, fmt))), f"{fmt} {rows} rows: max error {err.max():.3g}"


@needs_wide
@pytest.mark.parametrize("fmt", FORMATS)
def test_byte_halves_at_their_edges(fmt):
    # x16 = 256 hi + lo with hi signed, lo 0-255: rows of int16 values where a wrong sign or
    # carry between the halves shows (-1 = -256 + 255, -256, 255, 256, +-32767, -32768 + 1),
    # against weights at their ends (Q4: all nibbles 15, all 0; Q8_0: all 127, all -127, whose
    # sum(w) correction is largest) and random ones; element 0 of every block holds the amax,
    # so the others round to exactly v (v / 32767 of it). 8 rows: both groups.
    k, n = 256, 24
    edges = np.array([-1, -255, -256, -257, 255, 256, 257, -32767, 32767, -128, 127, 0, 1, -2, 32512, -32513])
    rng = np.random.default_rng(60)
    x = np.zeros((8, k), np.float32)
    for r in range(8):
        values = rng.choice(edges, size=k).astype(np.float32)
        values[::BLOCK] = 32767.0 if r % 2 == 0 else -32767.0
        x[r] = values / np.float32(32767) * np.float32(0.5 + r)
    blocks = random_blocks(fmt, n, k, seed=61)
    qs = slice(4 if fmt == "q4_1" else 2, None)
    blocks = blocks.reshape(n, k // BLOCK, -1)
    blocks[:8, :, qs] = 0xFF if fmt != "q8_0" else 0x7F  # every nibble 15; Q8_0 127
    blocks[8:12, :, qs] = 0x00 if fmt != "q8_0" else 0x81  # Q8_0 -127
    blocks = blocks.reshape(n, -1)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0, wide_rows=2)
    before = rows16_halves_calls()
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    assert rows16_halves_calls() - before == 1
    err = np.abs(got - wide_reference(x, blocks, fmt))
    assert np.all(err <= bound(x, dequantize_host(blocks, fmt))), f"{fmt}: max error {err.max():.3g} at the halves' edges"
