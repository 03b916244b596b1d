"""The K-quant kernel at 9 to 15 rows: the 16-bit weights path in two passes of rows.

A c8 decode step mixed with a few prompt tokens multiplies 9 to 15 activation rows by every
weight. With wide_rows 1 on AVX-512 VNNI block_matmul_k.cc runs them on
block_matmul_k_rows16.inc (16-bit activations, one int16 each, S = amax / 32767 per row and
256-wide super-block), the first 8 rows then the rest over each block of columns. Checked
against float64 x @ dequantize(w)^T within the integer paths' bound (amax / 64000 of each
super-block times sum |w|, plus float32's few ulps: tests/models/test_block_matmul_k.py's
int_bound); every row off float32's tighter bound somewhere (so the integer path ran for the
rows of both passes); each row quantized with its own scale (a 1000x row in the first pass, a
zero and a one-spike row in the second); the fused q/k/v call giving each weight's own bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cpu_kernels
from models.gguf_blocks import K_FORMATS, block_matmul, block_matmul_many, fusable, make_weight, with_kernel
from tests.models.test_block_matmul import activations, bound
from tests.models.test_block_matmul_k import int_bound, int_product, needs_vnni
from tests.support.kquant_blocks import random_k_blocks


# 9 (a second pass of one row), 12, 15 (the most rows before the prompt-chunk path); [1536, 44]
# on the calling thread, [2048, 300] shared over threads (more than one 64-column block a thread)
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows", [9, 12, 15])
@pytest.mark.parametrize("k,n", [(1536, 44), (2048, 300)])
def test_split_rows_within_their_16_bit_bound(fmt, rows, k, n):
    x, w, got = int_product(fmt, k, n, seed=31 + rows, rows=rows)
    err = np.abs(got - x.astype(np.float64) @ w.T)
    lim = int_bound(x, w)
    assert np.all(err <= lim), f"{fmt} {rows}x[{k}, {n}]: max error / bound {np.max(err / lim):.3g}"
    # every row went through the integer path (the float paths stay within float32's bound)
    assert np.all(np.any(err > bound(x, w), axis=1)), f"{fmt} {rows} rows: a row within float32's bound"


@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_split_rows_are_quantized_each_on_its_own(fmt):
    # 13 rows: row 0 (first pass) 1000x the others', rows 9 and 10 (second pass) zero and one
    # spike; a row read with another row's scale or activations would miss its bound or move
    # the zero row off zero
    k, n = 2048, 64
    x = activations(13, k, seed=51)
    x[0] *= 1000.0
    x[9] = 0.0
    x[10] = 0.0
    x[10, 700] = 3.0
    x, w, got = int_product(fmt, k, n, seed=52, x=x)
    want = x.astype(np.float64) @ w.T
    err = np.abs(got - want)
    assert np.all(err <= int_bound(x, w)), f"{fmt}: max error / bound {np.max(err / int_bound(x, w)):.3g}"
    assert np.all(got[9] == 0)
    np.testing.assert_allclose(got[10], want[10], rtol=1e-6, atol=1e-6)
    # negative control: the rows rounded to llama.cpp's 8 bits (S = amax / 127 per 256) miss
    # the bound in the second pass's rows too, so the check tells 16-bit activations from 8-bit
    amax = np.abs(x).reshape(13, -1, 256).max(axis=2, keepdims=True)
    s = np.where(amax > 0, amax / 127, 1.0)
    x8 = (np.round(x.reshape(13, -1, 256) / s) * s).reshape(13, k)
    assert np.any((np.abs(x8 @ w.T - want) > int_bound(x, w))[11:])


@needs_vnni
def test_split_rows_fused_equals_one_call_per_weight():
    # the multi-weight call quantizes x once for all its weights and runs both passes per
    # weight: the same bits as one call each, at 12 rows
    k = 2048
    specs = [("q4_k", 44), ("q6_k", 37), ("q5_k", 9)]
    weights = [with_kernel(make_weight(random_k_blocks(fmt, n, k, seed=60 + i), fmt, k), cpu_kernels.BLOCK_K_TARGET,
                           0, 0, 1) for i, (fmt, n) in enumerate(specs)]
    assert fusable(weights)
    x = jnp.asarray(activations(12, k, seed=61))
    for w, got in zip(weights, jax.jit(block_matmul_many)(x, weights)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(block_matmul)(x, w)))
