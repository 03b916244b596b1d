"""The K-quant kernel at 7 and 8 rows: the rows in the lanes of a vector (block_matmul_k_rows8.inc).

A c8 decode step multiplies 7 or 8 activation rows by every weight. With wide_rows 1 on AVX-512
VNNI block_matmul_k.cc quantizes them as the 16-bit weights path does (one int16 each, S = amax
/ 32767 per row and 256-wide super-block) and lays them out two lanes a row, the weights
broadcast. Checked against float64 x @ dequantize(w)^T within the integer paths' bound
(tests/models/test_block_matmul_k.py's int_bound), every row off float32's tighter bound (so
the integer path ran for every row), each row on its own scale, the fused call giving each
weight's own bits, and the integer sums at their edge. Q5_K and Q6_K take int16 weights: a
lane takes 16 products a block, so the path converts every 2 blocks (Q5_K, sc q <= 1953) or 1
(Q6_K, 4096); at the extreme those sums are within 5 % of 2^31, and one int32 sum over twice
as many blocks would wrap (a model of that kernel misses the bound). Q4_K takes its quants as
bytes against each int16 activation split as 256 hi + lo (block_matmul_k_rows8_bytes.inc): at
+-32767 the split's signed high byte is -128 or 127, and a split that lost its sign would miss
the bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cpu_kernels
from models.gguf_blocks import K_FORMATS, block_matmul, dequantize_host, make_weight, with_kernel
from tests.models.test_block_matmul import bound
from tests.models.test_block_matmul_k import check_fused_equals_one_call, check_rows_within_their_bound, int_bound, \
    int_product, needs_vnni
from tests.models.test_block_matmul_k_i16 import extreme_q5_k, extreme_q6_k, wide_bound


# [1536, 44] on the calling thread (5 tiles of 8 columns and one of 4); [2048, 300] shared over
# threads; [1280, 37] an odd count of super-blocks and of columns (tiles of 8, 4 and 1);
# [4352, 61]: rows past the prefetch distance (its wrap to the next tile's columns), tiles of
# 8, 4 and 1; [12288, 45] rows near an 8B down projection's length (its float32 bound wider)
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows", [7, 8])
@pytest.mark.parametrize("k,n", [(1536, 44), (2048, 300), (1280, 37), (4352, 61), (12288, 45)])
def test_lanes_rows_within_their_16_bit_bound(fmt, rows, k, n):
    check_rows_within_their_bound(fmt, rows, k, n, seed=70 + rows)


# each row on its own scale at 8 rows: in test_block_matmul_k.py's
# test_integer_path_rows_are_quantized_each_on_its_own


@needs_vnni
def test_lanes_fused_call_equals_one_call_per_weight():
    # at 7 and 8 rows
    check_fused_equals_one_call((7, 8), seed=90)


# a prompt chunk's product with 7 or 8 rows past whole 16-row groups (135: a 128-token chunk
# beside 7 decode rows) runs the groups on the prompt path and the last rows on the lanes: each
# part within its own bound, and each the same bits as a product of its rows alone (23 and 40
# rows: a group and 7, two groups and 8; on a 16-lane group of the prompt path, whose scales are
# per 32, the last rows would not give the lanes' bits)
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows,k,n", [(23, 768, 37), (40, 2048, 301), (135, 512, 44)])
def test_prompt_rows_past_whole_groups_take_the_lanes(fmt, rows, k, n):
    x, w, got = int_product(fmt, k, n, seed=100, rows=rows)
    err = np.abs(got - x.astype(np.float64) @ w.T)
    head = rows // 16 * 16
    assert np.all(err[:head] <= wide_bound(x, w)[:head])
    assert np.all(err[head:] <= int_bound(x[head:], w))
    assert np.all(np.any(err > bound(x, w), axis=1))
    np.testing.assert_array_equal(got[head:], int_product(fmt, k, n, seed=100, x=x[head:])[2])
    np.testing.assert_array_equal(got[:head], int_product(fmt, k, n, seed=100, x=x[:head])[2])


def extreme_q4_k(n: int, k: int) -> np.ndarray:
    """u8[n, k / 256 * 144]: every quant at its extreme (scale 63, q 15) with the largest offset
    (min 63), d = dmin = 2^-12; the odd columns q 0 (the offset alone)."""
    sb = np.full((n, k // 256, 144), 0xFF, np.uint8)  # scales and mins 63, every q 15
    sb[1::2, :, 16:144] = 0
    sb[:, :, 0:4] = np.tile(np.frombuffer(np.float16(2.0 ** -12).tobytes(), np.uint8), 2)
    return sb.reshape(n, -1)


def extreme_product(fmt: str, packed: np.ndarray, k: int):
    """8 rows of +-1 (every activation its super-block's amax, int16 +-32767) times `packed`:
    the lanes path within its bound of float64's. Returns (x, w)."""
    w = dequantize_host(packed, fmt)
    x = np.ones((8, k), np.float32)
    x[1::2] = -1.0
    weight = with_kernel(make_weight(packed, fmt, k), cpu_kernels.BLOCK_K_TARGET, 0, 0, 1)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    want = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.all(np.abs(got - want) <= int_bound(x, w))
    return x, w


# per format: the extreme blocks, the largest |sc q|, the blocks between the path's conversions
EDGES = {"q5_k": (extreme_q5_k, 1953, 2), "q6_k": (extreme_q6_k, 4096, 1)}


@needs_vnni
@pytest.mark.parametrize("fmt", sorted(EDGES))
def test_lanes_int32_sums_at_their_edge_stay_exact(fmt):
    # every weight at its int16 extreme: a lane's sum between conversions is 16 x blocks x
    # 32767 x |sc q|
    make, extreme, blocks = EDGES[fmt]
    k = 512
    x, w = extreme_product(fmt, make(6, k), k)
    lane = 16 * blocks * 32767 * extreme
    assert 0.95 * 2 ** 31 < lane < 2 ** 31
    # negative control: one int32 sum over twice the blocks wraps, and the output it gives
    # (row 0, column 0: both lanes of the row wrapped alike) misses the bound
    wrapped = (2 * lane + 2 ** 31) % 2 ** 32 - 2 ** 31
    error = 2 * (2 * lane - wrapped) * 2.0 ** -12 / 32767 * (k // (32 * 2 * blocks))
    assert error > int_bound(x, w)[0, 0]


@needs_vnni
def test_lanes_q4_k_byte_split_at_the_extremes_stays_exact():
    # the odd rows' activations are -32767: high byte -128, low byte 1
    k = 512
    x, w = extreme_product("q4_k", extreme_q4_k(6, k), k)
    # negative control: a split whose high byte lost its sign (256 x 128 + 1 = 32769 for each
    # -32767) puts row 1 off by 65536 x S per input, far past the bound
    error = np.abs(65536 / 32767 * x[1].astype(np.float64) @ w[0])
    assert error > int_bound(x, w)[1, 0]
