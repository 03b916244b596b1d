"""K-quant super-blocks (models/gguf_kquants.py) and their kernel (block_matmul_k.cc).

The layouts are checked against the `gguf` package's dequantizers on random bytes (every
bit pattern), the products against float64 numpy, x @ dequantize(w)^T: the kernel sums in
float32, so the tolerance is a few float32 ulps of sum |x_k w_k| per output element. Both
builds run where the CPU has AVX-512 (the AVX2 one through its forced target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from models import cpu_kernels
from models.gguf_blocks import K_FORMATS, block_matmul, block_matmul_many, dequantize_blocks, dequantize_host, fusable, \
    make_weight, with_kernel
from tests.support.kquant_blocks import quantize_k, random_k_blocks
from tests.models.test_block_matmul import activations, bound, same_bits_as_slices

GGML = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_dequantize_equals_the_gguf_package(fmt):
    blocks = random_k_blocks(fmt, 6, 512)
    want = dequantize(blocks, GGML[fmt]).reshape(6, 512).astype(np.float64)
    got = dequantize_host(blocks, fmt)
    # gguf computes in float32: equal up to its one rounding of d * sc * q - dmin * m
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-9)
    jnp_got = np.asarray(dequantize_blocks(jnp.asarray(blocks), fmt))
    np.testing.assert_allclose(jnp_got, got, rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_test_quantizer_round_trips(fmt):
    # tests/support/kquant_blocks.quantize_k: what the gguf package dequantizes is close to the input
    w = np.random.default_rng(4).standard_normal((8, 512)).astype(np.float32) * 0.08
    back = dequantize(quantize_k(w, fmt), GGML[fmt]).reshape(w.shape)
    rel = np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2))
    assert rel < {"q4_k": 0.12, "q5_k": 0.06, "q6_k": 0.03}[fmt], f"{fmt}: relative rms error {rel:.3f}"


def test_rows_must_hold_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        make_weight(np.zeros((4, 144), np.uint8), "q4_k", 128)
    with pytest.raises(ValueError, match=r"uint8\[out, 288\]"):
        make_weight(np.zeros((4, 144), np.uint8), "q4_k", 512)
    assert make_weight(random_k_blocks("q6_k", 3, 768), "q6_k", 768).shape == (768, 3)


def check_product(fmt: str, rows: int, k: int, n: int, kernel: str | None, seed: int = 0) -> None:
    blocks, x = random_k_blocks(fmt, n, k, seed=seed), activations(rows, k, seed=seed + 1)
    w = dequantize_host(blocks, fmt)
    weight = make_weight(blocks, fmt, k)
    if kernel is not None:
        weight = with_kernel(weight, kernel, 0)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    err = np.abs(got - x.astype(np.float64) @ w.T)
    assert np.all(err <= bound(x, w)), f"{fmt} {rows}x[{k}, {n}] on {kernel}: max error {err.max():.3g}"


def test_xla_path_matches_float64_reference():
    for fmt in K_FORMATS:
        check_product(fmt, 3, 512, 9, None)


# 1, 4, 32 rows: one row, one whole 4-row tile, many tiles; 5: a tile and a remainder.
# n = 37: nine 4-column tiles and a single column; k = 768: three super-blocks; n * k * rows
# past 2^18 multiply-adds shares the columns over threads. On AVX-512, 16 rows and more run
# over a dequantized panel of two super-blocks: 18 rows at k = 768 (pieces 512 + 256, 4-row
# tiles and 2 single rows) and 32 at k = 1024 (512 + 512), 8-column panels of 4 x 4 tiles.
# On AVX-512, 1 to 3 rows take the row path (block_matmul_k_row512.inc): 1, 2 and 3 rows,
# weight rows two at a time and a single one, 1 x [2048, 300] shared over threads, and
# k = 2560, past the 2048-input pieces the Q4_K / Q5_K rows are read in (2048 + 512).
SHAPES = [(1, 1536, 44), (2, 512, 9), (3, 768, 37), (1, 2048, 300), (1, 2560, 37), (4, 768, 37), (5, 256, 7),
          (18, 768, 37), (32, 1024, 37)]


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_kernel_equals_float64_reference(fmt, rows, k, n):
    check_product(fmt, rows, k, n, cpu_kernels.BLOCK_K_TARGET)


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_avx2_build_equals_float64_reference(fmt):
    # where the CPU has AVX-512 the auto target runs that build; this one forces AVX2's: its
    # register tile (1 and 6 rows) and from 8 rows its panel (panel256.inc), with a last panel of
    # 256 inputs (768, 1280), columns past the last pair and the last 8 (37, 19), rows past the
    # last 4 (9, 35, 11)
    for rows, k, n in ((1, 768, 37), (6, 512, 9), (9, 768, 37), (35, 1280, 19), (11, 512, 8)):
        check_product(fmt, rows, k, n, cpu_kernels.BLOCK_K_AVX2_TARGET, seed=3)


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("target", [cpu_kernels.BLOCK_K_AVX2_TARGET, cpu_kernels.BLOCK_K_TARGET])
def test_float_panel_with_k_outer_gives_the_columns_outer_bits(fmt, target):
    # The AVX2 build, and the build this CPU runs (on an AVX-512 host panel512.inc's; the float
    # path, wide_rows 0). Past 1 MB of activations (rows x k floats) the panel runs each 512-input
    # piece of every panel in turn (k = 768: 512 + 256), in spans of columns whose sums fit 256 KB: 1,100
    # rows (3.4 MB) give spans of 56 columns, shorter than a thread's share of n = 523 on two
    # threads (68, the last 47), so a share is a span, then 12 columns (two panels, the last of
    # 4). Rows taken 300 at a time (0.9 MB) run columns outer; each output is summed in the same
    # order either way, so the bits are equal; and both are within the float64 bound.
    rows, k, n = 1100, 768, 523
    blocks, x = random_k_blocks(fmt, n, k, seed=5), activations(rows, k, seed=6)
    weight = with_kernel(make_weight(blocks, fmt, k), target, 0)
    whole = same_bits_as_slices(weight, x, 300)
    w = dequantize_host(blocks, fmt)
    assert np.all(np.abs(whole - x.astype(np.float64) @ w.T) <= bound(x, w))


@needs_kernels
def test_pack_points_k_quants_at_their_kernel():
    assert cpu_kernels.block_target("q6_k") == cpu_kernels.BLOCK_K_TARGET
    assert cpu_kernels.block_target("q4_1") == cpu_kernels.BLOCK_TARGET
    assert cpu_kernels.block_k_isa() in ("AVX-512", "AVX2")


@needs_kernels
@pytest.mark.parametrize("rows,k", [(1, 2048), (3, 768), (5, 512)])
def test_fused_call_equals_one_call_per_weight_bit_for_bit(rows, k):
    # A Q4_K_M layer's q/k/v mixes formats (Q4_K q and k, Q6_K v) and widths; gate/up is a
    # pair. 1 row at k = 2048 crosses the threshold that shares columns over threads (the row
    # path); 3 rows, the row path's last count; 5 rows, the tile path. Widths 44 / 37 / 9 leave
    # a short thread chunk at each weight's end. One call must give each weight's own call's bits.
    x = jnp.asarray(activations(rows, k, seed=7))
    specs = [("q4_k", 44), ("q6_k", 37), ("q5_k", 9)]
    weights = [with_kernel(make_weight(random_k_blocks(fmt, n, k, seed=20 + i), fmt, k), cpu_kernels.BLOCK_K_TARGET, 0)
               for i, (fmt, n) in enumerate(specs)]
    for group in (weights, weights[:2]):
        assert fusable(group)
        hlo = jax.jit(block_matmul_many).lower(x, group).as_text()
        assert cpu_kernels.BLOCK_K_MULTI_TARGET in hlo and f'"{cpu_kernels.BLOCK_K_TARGET}"' not in hlo
        for w, got in zip(group, jax.jit(block_matmul_many)(x, group)):
            want = jax.jit(block_matmul)(x, w)
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # negative control: two weights of one shape and format, other bytes; the comparison tells
    # each one's products from the other's, so it catches a fused call that wrote a weight's
    # columns into another's output or read a chunk at the wrong weight's offset
    twins = [with_kernel(make_weight(random_k_blocks("q4_k", 44, k, seed=30 + i), "q4_k", k),
                         cpu_kernels.BLOCK_K_TARGET, 0) for i in range(2)]
    a, b = (np.asarray(y) for y in jax.jit(block_matmul_many)(x, twins))
    np.testing.assert_array_equal(a, np.asarray(jax.jit(block_matmul)(x, twins[0])))
    assert not np.array_equal(b, np.asarray(jax.jit(block_matmul)(x, twins[0])))


@needs_kernels
def test_k_quants_fuse_only_with_k_quants():
    k = 256
    q4k = with_kernel(make_weight(random_k_blocks("q4_k", 8, k), "q4_k", k), cpu_kernels.BLOCK_K_TARGET, 0)
    q6k = with_kernel(make_weight(random_k_blocks("q6_k", 8, k), "q6_k", k), cpu_kernels.BLOCK_K_TARGET, 0)
    forced = with_kernel(q4k, cpu_kernels.BLOCK_K_AVX2_TARGET, 0)  # no multi target: one call each
    assert fusable([q4k, q6k]) and fusable([q4k, q6k, q4k])
    assert not fusable([q4k, forced]) and not fusable([forced, forced]) and not fusable([q4k] * 4)
    x = jnp.asarray(activations(1, k))
    for got, w in zip(block_matmul_many(x, [forced, forced]), [forced, forced]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(block_matmul(x, w)))


# ---- the integer path, 1 to 8 rows (block_matmul_k_rowint.inc, wide_rows 1, AVX-512 VNNI) -----

needs_vnni = pytest.mark.skipif(cpu_kernels.block_isa() != "AVX-512 VNNI", reason="the integer row path needs AVX-512 VNNI")


def int_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The integer row path's error bound per output element: each activation is off by at
    most amax / 64516 of its 256-wide super-block (S / 508, S = amax / 127; 64000 leaves 0.8 %
    for the float32 rounding of x / S), times sum |w| over the super-block, plus the float32
    sums' few ulps of sum |x||w|."""
    m, k = x.shape
    amax = np.abs(x.astype(np.float64)).reshape(m, k // 256, 256).max(axis=2)
    return np.repeat(amax / 64000, 256, axis=1) @ np.abs(w).T + bound(x, w)



def int_product(fmt: str, k: int, n: int, seed: int, x: np.ndarray | None = None, rows: int = 1,
                target: str | None = None):
    """x, dequantized w and the kernel's product on wide_rows 1 (`target`: the auto K-quant
    target unless given, e.g. the forced AVX2 build's)."""
    blocks = random_k_blocks(fmt, n, k, seed=seed)
    x = activations(rows, k, seed=seed + 1) if x is None else x
    w = dequantize_host(blocks, fmt)
    weight = with_kernel(make_weight(blocks, fmt, k), target or cpu_kernels.BLOCK_K_TARGET, 0, 0, 1)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    return x, w, got


def check_16_bit_controls(fmt: str, seed: int, target: str | None = None) -> None:
    """Negative control: the same product with the activations rounded to llama.cpp's 8-bit
    (S = amax / 127 per 256, no second part) misses the bound, so the check would catch a path
    that dropped q2 or rounded coarser; a zero row and a row of one outlier stay exact."""
    k, n = 2048, 64
    x, w, _ = int_product(fmt, k, n, seed=seed, target=target)
    amax = np.abs(x).reshape(1, -1, 256).max(axis=2, keepdims=True)
    s = amax / 127
    x8 = (np.round(x.reshape(1, -1, 256) / s) * s).reshape(1, k)
    assert np.any(np.abs(x8 @ w.T - x.astype(np.float64) @ w.T) > int_bound(x, w))
    zero = np.zeros((1, k), np.float32)
    assert np.all(int_product(fmt, k, n, seed=seed, x=zero, target=target)[2] == 0)
    spike = zero.copy()
    spike[0, 700] = 3.0
    x1, w1, got1 = int_product(fmt, k, n, seed=seed, x=spike, target=target)
    np.testing.assert_allclose(got1, x1.astype(np.float64) @ w1.T, rtol=1e-6, atol=1e-6)


# one super-block per row and few columns; [2048, 300] shared over threads (the row quantized
# once, before the threads start); k = 8192 (a down projection's row); odd n; k = 12288: a row
# long enough for the 16-bit weights' path (block_matmul_k_rows16.inc's kW16FromK), at one row
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("k,n", [(256, 5), (1536, 44), (2048, 300), (8192, 37), (12288, 37)])
def test_integer_row_path_within_its_16_bit_bound(fmt, k, n):
    x, w, got = int_product(fmt, k, n, seed=11)
    want = x.astype(np.float64) @ w.T
    err = np.abs(got - want)
    assert np.all(err <= int_bound(x, w)), f"{fmt} 1x[{k}, {n}]: max error / bound {np.max(err / int_bound(x, w)):.3g}"
    # it is the integer path that ran: the float paths stay within the float32 bound
    assert np.any(err > bound(x, w)), f"{fmt}: every element within float32's bound: the float path ran"


@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_integer_row_bound_tells_16_bit_from_8_bit(fmt):
    check_16_bit_controls(fmt, seed=12)


# ---- the AVX2 build's integer rows, 1 to 8 (block_matmul_k_row256.inc, wide_rows 1) -------------
# Run on any CPU with AVX2 through the forced AVX2 target (its wide_rows passed through).


def avx2_int_product(fmt: str, k: int, n: int, seed: int, x: np.ndarray | None = None, rows: int = 1):
    return int_product(fmt, k, n, seed, x=x, rows=rows, target=cpu_kernels.BLOCK_K_AVX2_TARGET)


# one super-block per row and few columns; [2048, 300] shared over threads (the rows quantized
# once, before the threads start); k = 8192 (a down projection's row); 1 to 8 rows (one group of
# 4 rows' sums, then a second); 9 (past the path: the float panel) must stay within float32's bound
@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("k,n", [(256, 5), (2048, 300), (8192, 37)])
def test_avx2_integer_rows_within_their_16_bit_bound(fmt, rows, k, n):
    x, w, got = avx2_int_product(fmt, k, n, seed=31, rows=rows)
    err = np.abs(got - x.astype(np.float64) @ w.T)
    assert np.all(err <= int_bound(x, w)), (f"{fmt} {rows}x[{k}, {n}]: max error / bound "
                                            f"{np.max(err / int_bound(x, w)):.3g}")
    assert np.any(err > bound(x, w)), f"{fmt}: every element within float32's bound: the float path ran"


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_avx2_integer_rows_end_at_eight(fmt):
    x, w, got = avx2_int_product(fmt, 1280, 44, seed=32, rows=9)
    assert np.all(np.abs(got - x.astype(np.float64) @ w.T) <= bound(x, w))


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_avx2_integer_rows_tell_16_bit_from_8_bit(fmt):
    # as the VNNI path's controls, and each of 3 rows gets its own scale (a row 1000x the others
    # keeps theirs)
    check_16_bit_controls(fmt, seed=33, target=cpu_kernels.BLOCK_K_AVX2_TARGET)
    mixed = activations(3, 2048, seed=34)
    mixed[1] *= 1000.0
    x3, w3, got3 = avx2_int_product(fmt, 2048, 64, seed=33, x=mixed)
    assert np.all(np.abs(got3 - x3.astype(np.float64) @ w3.T) <= int_bound(x3, w3))


def check_fused_equals_one_call(row_counts, seed: int) -> None:
    """The multi-weight call (Q4_K, Q6_K and Q5_K weights of one x, [2048, 44 / 37 / 9]) gives
    each weight the bits of a call of its own, at each of `row_counts` rows: it quantizes and
    lays out x once for all its weights."""
    k = 2048
    specs = [("q4_k", 44), ("q6_k", 37), ("q5_k", 9)]
    weights = [with_kernel(make_weight(random_k_blocks(fmt, n, k, seed=seed + i), fmt, k), cpu_kernels.BLOCK_K_TARGET,
                           0, 0, 1) for i, (fmt, n) in enumerate(specs)]
    assert fusable(weights)
    for rows in row_counts:
        x = jnp.asarray(activations(rows, k, seed=seed + 10))
        for w, got in zip(weights, jax.jit(block_matmul_many)(x, weights)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(block_matmul)(x, w)))


@needs_vnni
def test_integer_row_path_fused_equals_one_call_per_weight():
    # at one row and at 5 (two groups of rows)
    check_fused_equals_one_call((1, 5), seed=40)
    k = 2048
    # with wide_rows 0 the float paths run at these rows: within float32's bound
    x9 = activations(9, k, seed=8)
    blocks = random_k_blocks("q4_k", 9, k, seed=41)
    weight = with_kernel(make_weight(blocks, "q4_k", k), cpu_kernels.BLOCK_K_TARGET, 0, 0, 0)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x9), weight))
    w = dequantize_host(blocks, "q4_k")
    assert np.all(np.abs(got - x9.astype(np.float64) @ w.T) <= bound(x9, w))


# 2 and 3 rows (one group of rows' int32 sums), 4 (a whole group), 5 and 8 (a second group,
# short and whole); 9, 12, 15: two passes of rows (9: a second pass of one row; 15: the most
# rows before the prompt-chunk path, tests/models/test_block_matmul_k_split_rows.py); [1536, 44]
# on the calling thread, [2048, 300] shared over threads (more than one 64-column block a thread);
# [1280, 37]: an odd count of super-blocks (the last one's mins alone, not paired with a next
# one's) and of columns (Q4_K and Q6_K take two columns at a time, the last one alone);
# [4352, 37]: rows longer than the prefetch distance (block_matmul_k_rows16.inc's Cross tiles,
# their own instances, K >= 4096 for Q4_K), an odd count of super-blocks again
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 12, 15])
@pytest.mark.parametrize("k,n", [(1536, 44), (2048, 300), (1280, 37), (4352, 37)])
def test_integer_path_rows_within_their_16_bit_bound(fmt, rows, k, n):
    check_rows_within_their_bound(fmt, rows, k, n, seed=13 + rows)


def check_rows_within_their_bound(fmt: str, rows: int, k: int, n: int, seed: int) -> None:
    """A product of `rows` random rows within the integer paths' bound of float64's, and every
    row off float32's tighter bound somewhere (so every row went through an integer path)."""
    x, w, got = int_product(fmt, k, n, seed=seed, rows=rows)
    err = np.abs(got - x.astype(np.float64) @ w.T)
    lim = int_bound(x, w)
    assert np.all(err <= lim), f"{fmt} {rows}x[{k}, {n}]: max error / bound {np.max(err / lim):.3g}"
    assert np.all(np.any(err > bound(x, w), axis=1)), f"{fmt} {rows} rows: a row within float32's bound"



def check_rows_on_their_own(fmt, rows, big, zero, spike, seed):
    """A product of `rows` rows, row `big` 1000x the others', row `zero` zero and row `spike` one
    spike: each row's own scale (a shared or neighbouring row's would put the small rows' error
    far past their bound, or the zero row off zero). Negative control: the rows after `spike`
    rounded to llama.cpp's 8 bits (S = amax / 127 per 256) miss the bound, so the check tells
    16-bit activations from 8-bit there."""
    k, n = 2048, 64
    x = activations(rows, k, seed=seed)
    x[big] *= 1000.0
    x[zero] = 0.0
    x[spike] = 0.0
    x[spike, 700] = 3.0
    x, w, got = int_product(fmt, k, n, seed=seed + 1, x=x)
    want = x.astype(np.float64) @ w.T
    err = np.abs(got - want)
    assert np.all(err <= int_bound(x, w)), f"{fmt}: max error / bound {np.max(err / int_bound(x, w)):.3g}"
    assert np.all(got[zero] == 0)
    np.testing.assert_allclose(got[spike], want[spike], rtol=1e-6, atol=1e-6)
    amax = np.abs(x).reshape(rows, -1, 256).max(axis=2, keepdims=True)
    s = np.where(amax > 0, amax / 127, 1.0)  # the zero row stays zero
    x8 = (np.round(x.reshape(rows, -1, 256) / s) * s).reshape(rows, k)
    assert np.any((np.abs(x8 @ w.T - want) > int_bound(x, w))[spike + 1:])


# 5 rows: the second group of rows holds row 4, on the 8-bit negative control; 8 rows (the rows
# in the lanes, block_matmul_k_rows8.inc): row 7 on the control; 13 rows (two passes of rows,
# tests/models/test_block_matmul_k_split_rows.py): row 0 in the first pass, rows 9 and 10 (zero,
# one spike) in the second, the control on rows 11-12
@needs_vnni
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows,zero,spike,seed", [(5, 2, 3, 21), (8, 5, 6, 81), (13, 9, 10, 51)])
def test_integer_path_rows_are_quantized_each_on_its_own(fmt, rows, zero, spike, seed):
    check_rows_on_their_own(fmt, rows, big=0, zero=zero, spike=spike, seed=seed)
