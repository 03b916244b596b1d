"""The K-quant kernel's many-row path on 16-bit integer activations (block_matmul_k_i16.inc).

From 16 rows with wide_rows 1 on AVX-512 VNNI, Q4_K / Q5_K / Q6_K products quantize the
activations per row and 256-wide super-block to int16 (scale amax / 32767, as the 2-15-row
paths do) and multiply the weights' integers with vpdpwssd. Checked against float64
x @ dequantize(w)^T within that path's bound: each activation off by at most amax / 65534 of
its super-block, times sum |w| over the super-block, plus the float32 sums' few ulps. Negative controls: the float path's tighter bound is missed (so it
is this path that ran), and a kernel that paired a sub-block with its neighbour's scale (Q4_K /
Q5_K: the high nibbles' sub-block with the low nibbles' scale; Q6_K: a block's second 16 with
its first 16's scale) would miss the bound. Q6_K's sub-block scales are in its int16 weights
(up to 128 x 32 = 4096): at the extreme each 16-wide half's int32 dot is just below 2^31, and
one int32 sum of both halves would wrap (checked against a model of that kernel). Q4_K / Q5_K's
6-bit sub-block scales are in their int16 weights too (up to 63 x 31 = 1953): a block's dot at
the extreme is 32 x 32767 x 1953, 4.9 % below 2^31, and two blocks' dots in one int32 would wrap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cpu_kernels
from models.gguf_blocks import K_FORMATS, block_matmul, block_matmul_many, dequantize_host, fusable, make_weight, \
    with_kernel
from tests.models.test_block_matmul import activations, bound, same_bits_as_slices
from tests.support.kquant_blocks import _pack_scales, random_k_blocks

needs_vnni = pytest.mark.skipif(cpu_kernels.block_isa() != "AVX-512 VNNI",
                                reason="the 16-bit integer path needs AVX-512 VNNI")


def wide_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per output element: amax / 65534 of each 256-wide activation super-block (65000 leaves
    room for the float32 rounding of x / scale) times sum |w| over it, plus float32's bound."""
    m, k = x.shape
    amax = np.abs(x.astype(np.float64)).reshape(m, k // 256, 256).max(axis=2)
    return np.repeat(amax / 65000, 256, axis=1) @ np.abs(w).T + bound(x, w)


def product(fmt: str, blocks: np.ndarray, x: np.ndarray, wide_rows: int = 1) -> np.ndarray:
    weight = with_kernel(make_weight(blocks, fmt, x.shape[1]), cpu_kernels.BLOCK_K_TARGET, 0, 0, wide_rows)
    return np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))


def swap_neighbour_scales(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The same super-blocks with the scales of sub-blocks 2c and 2c + 1 swapped (Q4_K / Q5_K:
    the two sub-blocks that share 32 bytes of nibbles; Q6_K: the two 16-wide halves of a 32)."""
    n = blocks.shape[0]
    sb = blocks.reshape(n, -1, {"q4_k": 144, "q5_k": 176, "q6_k": 210}[fmt]).copy()
    if fmt == "q6_k":
        sc = sb[:, :, 192:208].copy()
        sb[:, :, 192:208:2], sb[:, :, 193:208:2] = sc[:, :, 1::2], sc[:, :, 0::2]
        return sb.reshape(blocks.shape)
    b = sb[:, :, 4:16].reshape(-1, 12).astype(np.int64)
    sc, mn = np.empty((len(b), 8), np.int64), np.empty((len(b), 8), np.int64)
    sc[:, :4], mn[:, :4] = b[:, 0:4] & 63, b[:, 4:8] & 63
    sc[:, 4:] = (b[:, 8:12] & 0x0F) | ((b[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)
    swapped = sc.reshape(-1, 4, 2)[:, :, ::-1].reshape(-1, 8)
    sb[:, :, 4:16] = _pack_scales(swapped, mn).reshape(n, -1, 12)
    return sb.reshape(blocks.shape)


# Past 1 MB of quantized activations a span of 16 columns is packed at once and the row groups
# run over it in passes that fit 512 KB: at k = 8192 (280 KB a group of 16 rows) passes of 2 groups, so
# 80 rows are three passes (2, 2, 1). n = 150 on two threads gives 20-column shares: a whole
# span of 16 and one of 4. Each output is still one tile's sum, so the 16-row slices (each
# under the bound: 4 columns packed at a time, all rows over them) give the same bits.
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_wide_k_passes_over_a_packed_span_give_the_same_bits(fmt):
    rows, k, n = 80, 8192, 150
    blocks, x = random_k_blocks(fmt, n, k, seed=11), activations(rows, k, seed=12)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_K_TARGET, 0, 0, 1)
    whole = same_bits_as_slices(weight, x, 16)
    w = dequantize_host(blocks, fmt)
    assert np.all(np.abs(whole - x.astype(np.float64) @ w.T) <= wide_bound(x, w))


# 16 rows: one row group; 17: a group and a remainder row (15 lanes of zeros); 32: a tile of
# two groups; 128: eight. k 768: three super-blocks; 2048 / 300 columns share the threads
# (4-column panels and a last single column at n = 37 / 301)
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows,k,n", [(16, 768, 37), (17, 768, 37), (32, 2048, 301), (128, 768, 64)])
def test_wide_k_path_within_its_16_bit_bound(fmt, rows, k, n):
    blocks, x = random_k_blocks(fmt, n, k, seed=rows), activations(rows, k, seed=rows + 1)
    w = dequantize_host(blocks, fmt)
    want = x.astype(np.float64) @ w.T
    err = np.abs(product(fmt, blocks, x) - want)
    limit = wide_bound(x, w)
    assert np.all(err <= limit), f"{fmt} {rows}x[{k}, {n}]: max error / bound {np.max(err / limit):.3g}"
    # it is the integer path that ran: the float paths stay within float32's bound
    assert np.any(err > bound(x, w)), f"{fmt}: every element within float32's bound: the float path ran"
    # wide_rows 0 keeps the float path at these rows
    assert np.all(np.abs(product(fmt, blocks, x, wide_rows=0) - want) <= bound(x, w))


@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_wide_k_bound_catches_a_sub_block_on_its_neighbours_scale(fmt):
    # negative control: the product a kernel would give with the wrong scale pairing misses
    # the bound the kernel meets
    rows, k, n = 16, 512, 24
    blocks, x = random_k_blocks(fmt, n, k, seed=5), activations(rows, k, seed=6)
    w = dequantize_host(blocks, fmt)
    wrong = x.astype(np.float64) @ dequantize_host(swap_neighbour_scales(blocks, fmt), fmt).T
    assert np.any(np.abs(wrong - x.astype(np.float64) @ w.T) > wide_bound(x, w))
    assert np.all(np.abs(product(fmt, blocks, x) - x.astype(np.float64) @ w.T) <= wide_bound(x, w))


@needs_vnni
def test_wide_k_zero_rows_and_an_outlier_stay_exact():
    k, n = 512, 16
    blocks = random_k_blocks("q4_k", n, k, seed=9)
    zero = np.zeros((16, k), np.float32)
    assert np.all(product("q4_k", blocks, zero) == 0)
    spike = zero.copy()
    spike[3, 300] = 3.0  # one value per super-block is its own amax: exact in int16
    w = dequantize_host(blocks, "q4_k")
    np.testing.assert_allclose(product("q4_k", blocks, spike), spike.astype(np.float64) @ w.T, rtol=1e-6, atol=1e-6)


@needs_vnni
def test_wide_k_carries_a_non_finite_activation_to_its_row():
    k, n = 512, 8
    blocks = random_k_blocks("q6_k", n, k, seed=10)
    x = activations(16, k, seed=11)
    x[5, 40] = np.nan
    got = product("q6_k", blocks, x)
    assert np.all(np.isnan(got[5])) and np.all(np.isfinite(np.delete(got, 5, axis=0)))


@needs_vnni
def test_wide_k_fused_call_equals_one_call_per_weight():
    # the multi-weight call quantizes x once for its weights: the same bits as one call each
    k = 1024
    x = jnp.asarray(activations(20, k, seed=7))
    specs = [("q4_k", 44), ("q6_k", 37), ("q5_k", 9)]
    weights = [with_kernel(make_weight(random_k_blocks(fmt, n, k, seed=40 + i), fmt, k), cpu_kernels.BLOCK_K_TARGET,
                           0, 0, 1) for i, (fmt, n) in enumerate(specs)]
    assert fusable(weights)
    for w, got in zip(weights, jax.jit(block_matmul_many)(x, weights)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(block_matmul)(x, w)))


def exact_at_the_edge(fmt: str, blocks: np.ndarray, rows: int = 16):
    """16 rows of +-1 (every activation its block's amax) times `blocks`: the wide path's
    product within its bound of float64's. Returns (x, w, the float64 product)."""
    w = dequantize_host(blocks, fmt)
    x = np.ones((rows, w.shape[1]), np.float32)
    x[1::2] = -1.0
    want = x.astype(np.float64) @ w.T
    got = product(fmt, blocks, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.all(np.abs(got - want) <= wide_bound(x, w))
    return x, w, want


def extreme_q6_k(n: int, k: int) -> np.ndarray:
    """u8[n, k / 256 * 210]: every weight's int16 sc (q - 32) at the extreme: scale -128 and
    q 0 (4096), the odd columns scale 127 and q 63 (127 x 31), d 2^-12."""
    sb = np.zeros((n, k // 256, 210), np.uint8)
    sb[:, :, 192:208] = np.uint8(0x80)  # int8 -128
    sb[1::2, :, 0:128], sb[1::2, :, 128:192], sb[1::2, :, 192:208] = 0xFF, 0xFF, 127
    sb[:, :, 208:210] = np.frombuffer(np.float16(2.0 ** -12).tobytes(), np.uint8)
    return sb.reshape(n, -1)


@needs_vnni
def test_wide_q6_k_halves_at_the_int32_edge_stay_exact():
    # every activation its block's amax (int16 32767), every weight at its int16 extreme: each
    # half's dot is 16 x 32767 x 4096 = 2,147,418,112, 65,535 below 2^31
    k = 512
    x, w, want = exact_at_the_edge("q6_k", extreme_q6_k(6, k))
    assert np.abs(w).max() == 4096 * 2.0 ** -12
    # negative control: a kernel that summed both halves in one int32 per block would wrap
    x16 = np.full(32, 32767, np.int64)
    wi = np.round(w[0, :32] / 2.0 ** -12).astype(np.int64)  # column 0's int16 weights, one block
    wrapped = (int(x16 @ wi) + 2 ** 31) % 2 ** 32 - 2 ** 31
    wrong = wrapped * (1.0 / 32767) * 2.0 ** -12 * (k // 32)  # row 0: amax 1 in every super-block
    assert abs(wrong - want[0, 0]) > wide_bound(x, w)[0, 0]


def extreme_q5_k(n: int, k: int) -> np.ndarray:
    """u8[n, k / 256 * 176]: every int16 weight sc q at its extreme (scale 63, q 31: 1953) with
    the largest offset (min 63), d = dmin = 2^-12; the odd columns q 0 (the offset alone)."""
    sb = np.full((n, k // 256, 176), 0xFF, np.uint8)  # scales and mins 63, every q 31
    sb[1::2, :, 16:176] = 0  # q 0: qh and qs
    sb[:, :, 0:4] = np.tile(np.frombuffer(np.float16(2.0 ** -12).tobytes(), np.uint8), 2)
    return sb.reshape(n, -1)


@needs_vnni
def test_wide_q5_k_folded_scales_at_the_int32_edge_stay_exact():
    # every activation its block's amax (int16 32767), every weight sc q = 1953: each block's
    # dot is 32 x 32767 x 1953 = 2,047,737,888, and the offset term is at its largest
    k = 512
    x, w, want = exact_at_the_edge("q5_k", extreme_q5_k(6, k))
    assert np.allclose(w[0], (63 * 31 - 63) * 2.0 ** -12) and np.allclose(w[1], -63 * 2.0 ** -12)
    # negative control: a kernel that summed two blocks' dots in one int32 would wrap
    dot = 32 * 32767 * 1953
    wrapped = (2 * dot + 2 ** 31) % 2 ** 32 - 2 ** 31
    offset = -63 * 2.0 ** -12 * 32 * 2  # the two blocks' offset term, row 0 (every x 1)
    wrong = (wrapped * (1.0 / 32767) * 2.0 ** -12 + offset) * (k // 64)
    assert abs(wrong - want[0, 0]) > wide_bound(x, w)[0, 0]
