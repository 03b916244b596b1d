"""GGUF block weights (models/gguf_blocks.py) and the block kernel (block_matmul.cc).

References are float64 numpy: the float path against x @ dequantize(w)^T, the integer
(int8) and 16-bit (int16) paths against the same 32-wide activation quantization done in
numpy, their integer block dots exact and combined in float64, the AMX-BF16 path (CPUs with AMX) against the same
float64 product within its split-bf16 bound. The kernel sums in float32, so the tolerance is a
few float32 ulps of sum |x_k w_k| over the K = 1536 (or 96) products of an element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cpu_kernels
from models.gguf_blocks import BLOCK, BLOCK_FORMATS, K_FORMATS, block_matmul, block_matmul_many, dequantize_blocks, \
    dequantize_host, fusable, make_weight, with_kernel

FORMATS = tuple(f for f in BLOCK_FORMATS if f not in (*K_FORMATS, "mxfp4"))  # K-quants, MXFP4: their own test files
F32_EPS = float(np.finfo(np.float32).eps)

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def random_blocks(fmt: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """u8[rows, k / 32 * B]: random quants, f16 scales ~1e-2 and offsets (Q4_1) ~ -0.1,
    the magnitudes of a real Q4_1 projection."""
    rng = np.random.default_rng(seed)
    nb = k // BLOCK
    size = BLOCK_FORMATS[fmt].block_bytes
    out = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    d = (rng.uniform(0.002, 0.02, size=(rows, nb)) * rng.choice([-1, 1], size=(rows, nb))).astype(np.float16)
    out[..., 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    if fmt == "q4_1":
        m = rng.uniform(-0.15, 0.0, size=(rows, nb)).astype(np.float16)
        out[..., 2:4] = m.view(np.uint8).reshape(rows, nb, 2)
    if fmt == "q8_0":  # quantize_row_q8_0 writes values in [-127, 127]
        q = out[..., 2:].view(np.int8)
        q[q == -128] = -127
    return out.reshape(rows, nb * size)


def activations(m: int, k: int, seed: int = 1) -> np.ndarray:
    """f32[m, k] with a few outlier features, as a real model's hidden states have."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.integers(0, k, size=4)] *= 20.0
    return x


def same_bits_as_slices(weight, x: np.ndarray, step: int) -> np.ndarray:
    """The kernel's product of all of x's rows, checked bit for bit against the same rows
    taken `step` at a time (a path switched on by the row count against the one below it)."""
    run = jax.jit(block_matmul)
    whole = np.asarray(run(jnp.asarray(x), weight))
    sliced = np.concatenate([np.asarray(run(jnp.asarray(x[r:r + step]), weight)) for r in range(0, len(x), step)])
    np.testing.assert_array_equal(whole, sliced)
    return whole


def quantize_blocks_ref(x: np.ndarray):
    """numpy version of the kernel's activation quantization: (int values, f32 scales)."""
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)
    amax = np.abs(xb).max(axis=2)
    scales = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    values = np.rint(xb / scales[..., None]).astype(np.int64)
    return values, scales


def block_dots_reference(values: np.ndarray, scales: np.ndarray, sums: np.ndarray, blocks: np.ndarray,
                         fmt: str) -> np.ndarray:
    """out[m, n] = sum_b d_w s_x (q . xq)_b + m_w sums_b for activations already rounded to
    integer `values` [m, K / 32, 32] with `scales` and offset `sums` [m, K / 32]: the integer
    block dots exact, the rest float64."""
    n, nb = blocks.shape[0], values.shape[1]
    b = blocks.reshape(n, nb, -1)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if fmt == "q8_0":
        q, off = b[..., 2:].view(np.int8).astype(np.int64), np.zeros_like(d)
    else:
        qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
        off = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if fmt == "q4_1" else -8.0 * d
    dots = np.einsum("mbj,nbj->mnb", values, q)  # exact int64
    return (np.einsum("mnb,nb,mb->mn", dots.astype(np.float64), d, scales.astype(np.float64))
            + np.einsum("nb,mb->mn", off, sums))


def integer_reference(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The int8 path's product: sum_b d_w d_x (q . xq)_b + m_w d_x sum(xq_b)."""
    values, scales = quantize_blocks_ref(x)
    return block_dots_reference(values, scales, scales.astype(np.float64) * values.sum(axis=2), blocks, fmt)


def wide_reference(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The 16-bit path's product: activations rounded to int16 per 32-wide block as the
    kernel rounds them (float32 scale amax / 32767, values rint(x * (32767 / amax))), then
    d_w s_x (q . xq)_b + m_w sum(x_b), the block's own float sum."""
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    values = np.rint(xb * inv[..., None]).astype(np.int64)
    scales = amax / np.float32(32767)
    return block_dots_reference(values, scales, xb.astype(np.float64).sum(axis=2), blocks, fmt)


def bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A few float32 ulps of sum |x||w| per output element (the accumulation's error)."""
    return 8 * F32_EPS * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-6


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_blocks_jnp_equals_numpy(fmt):
    blocks = random_blocks(fmt, 8, 64)
    got = np.asarray(dequantize_blocks(jnp.asarray(blocks), fmt))
    np.testing.assert_array_equal(got, dequantize_host(blocks, fmt, np.float32))


def test_q4_0_dequantizes_nibbles_in_ggml_order():
    # one block: d = 1, qs[j] = j | (15 - j) << 4 -> values 0..15 then 15..0, minus 8
    qs = np.array([j | (15 - j) << 4 for j in range(16)], np.uint8)
    block = np.concatenate([np.float16(1.0).reshape(1).view(np.uint8), qs])[None]
    want = np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8.0
    np.testing.assert_array_equal(dequantize_host(block, "q4_0")[0], want)


def test_xla_path_matches_float64_reference():
    blocks, x = random_blocks("q4_1", 24, 96), activations(3, 96)
    w = dequantize_host(blocks, "q4_1")
    got = np.asarray(block_matmul(jnp.asarray(x), make_weight(blocks, "q4_1", 96)))
    assert np.all(np.abs(got - x.astype(np.float64) @ w.T) <= bound(x, w)), "XLA dequantize + dot"


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 6, 9, 18])
def test_float_path_equals_float64_reference(fmt, rows):
    # 1, 3, 6, 9, 18 rows: one row, a partial row tile, whole tiles and a remainder. AVX2:
    # 2-row tiles below 4 rows, and from 4 rows 4-row groups over a dequantized panel, k =
    # 1536 in three 512-long pieces. AVX-512: 4-row tiles in registers, and from 5 rows (Q8_0:
    # 16) 4 x 4 tiles over an 8-column panel, k in pieces of 576, 576 and 384, each tile's
    # four column sums reduced together.
    k, n = 1536, 46  # n: 11 column tiles of 4 over the thread chunks and 2 single columns
    blocks, x = random_blocks(fmt, n, k), activations(rows, k)
    w = dequantize_host(blocks, fmt)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    err = np.abs(got - x.astype(np.float64) @ w.T)
    assert np.all(err <= bound(x, w)), f"{fmt} float path: max error {err.max():.3g}"


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,k,n", [(1, 2048, 300), (2, 8192, 37), (3, 2048, 150)])
def test_float_path_few_rows_shared_over_threads(fmt, rows, k, n):
    # A decode step's products: 1 to 3 rows at a 1B model's row lengths (2048; 8192, the down
    # projection), past 2^18 multiply-adds, so the columns are shared over the pool in chunks
    # of 4-column tiles (n = 300, 150, 37: a short last chunk and single columns).
    blocks, x = random_blocks(fmt, n, k, seed=5), activations(rows, k, seed=6)
    w = dequantize_host(blocks, fmt)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    err = np.abs(got - x.astype(np.float64) @ w.T)
    assert np.all(err <= bound(x, w)), f"{fmt} {rows}x[{k}, {n}]: max error {err.max():.3g}"


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_float_panel_with_k_outer_gives_the_columns_outer_bits(fmt):
    # Past 1 MB of activations (rows x k floats) the float panel (AVX-512: 576-input pieces of 8
    # columns; AVX2, this file's run under the cap: 512 of 6) runs each piece of every panel of a
    # span of columns in turn, spans whose sums fit 256 KB: 1,100 rows (6.8 MB at k = 1536) give
    # spans of 56 / 54 columns, shorter than a thread's share of n = 523 on two threads (68, the
    # last 47), so a share is a span and then a short one. Rows taken 150 at a time (0.9 MB) run
    # columns outer; each output is summed in the same order either way, so the bits are equal;
    # and both are within the float64 bound.
    rows, k, n = 1100, 1536, 523
    blocks, x = random_blocks(fmt, n, k, seed=7), activations(rows, k, seed=8)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0)
    whole = same_bits_as_slices(weight, x, 150)
    w = dequantize_host(blocks, fmt)
    err = np.abs(whole - x.astype(np.float64) @ w.T)
    assert np.all(err <= bound(x, w)), f"{fmt} k-outer panel: max error {err.max():.3g}"


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_integer_path_equals_integer_reference(fmt, rows):
    # 70 rows: past one 64-row panel; 5: a 4-row tile and a remainder; n = 7: a 4 tile + 3 singles
    k, n = 576, 7
    blocks, x = random_blocks(fmt, n, k, seed=2), activations(rows, k, seed=3)
    x[0, :BLOCK] = 0.0  # an all-zero block (scale 1) must contribute nothing
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 1)
    got = np.asarray(block_matmul(jnp.asarray(x), weight))
    want = integer_reference(x, blocks, fmt)
    w = dequantize_host(blocks, fmt)
    err = np.abs(got - want)
    assert np.all(err <= bound(x, w)), f"{fmt} integer path: max error {err.max():.3g}"


@needs_kernels
def test_integer_path_is_chosen_by_row_count():
    # From int_rows rows on the activations are quantized: the result moves off the float
    # product by the activation rounding (much more than float32 rounding), below it it does not.
    k, n = 576, 16
    blocks, x = random_blocks("q4_1", n, k), activations(8, k)
    w = dequantize_host(blocks, "q4_1")
    exact = x.astype(np.float64) @ w.T
    weight = with_kernel(make_weight(blocks, "q4_1", k), cpu_kernels.BLOCK_TARGET, 8)
    at = np.asarray(block_matmul(jnp.asarray(x), weight))
    below = np.asarray(block_matmul(jnp.asarray(x[:7]), weight))
    assert np.all(np.abs(below - exact[:7]) <= bound(x[:7], w)), "7 rows < int_rows: float path"
    assert np.abs(at - exact).max() > 10 * bound(x, w).max(), "8 rows: integer path (activations rounded)"
    np.testing.assert_allclose(at, integer_reference(x, blocks, "q4_1"), rtol=1e-4, atol=1e-3)


needs_wide = pytest.mark.skipif(cpu_kernels.block_isa() != "AVX-512 VNNI",
                                reason="the 16-bit activation path is in the AVX-512 VNNI build only")


@needs_wide
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [5, 10, 17, 40])
def test_wide_path_equals_int16_reference(fmt, rows):
    # Below 16 rows, groups of 8 lanes: 5, one partly filled group; 10, a 2-group tile of
    # which one partial. From 16, groups of 16: 17, a full group and one row; 40, a 2-group
    # tile and a partial group alone. n = 46: 8- and 4-column panels and 2 single columns.
    k, n = 1536, 46
    blocks, x = random_blocks(fmt, n, k, seed=4), activations(rows, k, seed=6)
    x[1, BLOCK:2 * BLOCK] = 0.0  # an all-zero block (scale 0) must contribute nothing
    w = dequantize_host(blocks, fmt)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0, wide_rows=1)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    err = np.abs(got - wide_reference(x, blocks, fmt))
    assert np.all(err <= bound(x, w)), f"{fmt} 16-bit path: max error {err.max():.3g}"


# Past 1 MB of quantized activations a span of 16 columns is packed at once and the row groups
# run over it in passes that fit 512 KB: at k = 8192 (288 KB a group of 16 rows) passes of 2
# groups, so 80 rows are three passes (2, 2, 1). n = 150 on two threads gives 20-column shares
# (a whole span of 16 and one of 4) and a last share of 10 (two 4-column tiles and 2 single
# columns). Each output is still one tile's sum, so 16-row slices (each under the switch: 4
# columns packed at a time, all rows over them) give the same bits.
@needs_wide
@pytest.mark.parametrize("fmt", FORMATS)
def test_wide_passes_over_a_packed_span_give_the_same_bits(fmt):
    rows, k, n = 80, 8192, 150
    blocks, x = random_blocks(fmt, n, k, seed=11), activations(rows, k, seed=12)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0, wide_rows=1)
    whole = same_bits_as_slices(weight, x, 16)
    err = np.abs(whole - wide_reference(x, blocks, fmt))
    assert np.all(err <= bound(x, dequantize_host(blocks, fmt))), f"{fmt} spans: max error {err.max():.3g}"


@needs_wide
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_wide_path_carries_a_non_finite_activation_to_its_row(fmt, bad):
    # As the float path does: the engine's fault check must see a NaN / inf hidden state,
    # not a finite value rounded out of it. Other rows stay finite and exact.
    k, n = 576, 12
    blocks, x = random_blocks(fmt, n, k), activations(9, k)
    x[3, 40] = bad
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0, wide_rows=1)
    got = np.asarray(block_matmul(jnp.asarray(x), weight))
    assert not np.isfinite(got[3]).any(), "row 3 holds a non-finite activation"
    rest = np.delete(np.arange(9), 3)
    assert np.isfinite(got[rest]).all()
    np.testing.assert_array_equal(got[rest], np.asarray(block_matmul(jnp.asarray(x[rest]), weight)))


@needs_wide
def test_wide_path_is_chosen_by_row_count_and_rounds_activations_finely():
    # Below wide_rows the float path: float32 rounding only. From wide_rows: off the float
    # product by the int16 activation rounding (well above float32's), yet ~250x closer than
    # the int8 path's (amax / 65534 against amax / 254 a value).
    k, n = 576, 16
    blocks, x = random_blocks("q4_1", n, k), activations(12, k)
    w = dequantize_host(blocks, "q4_1")
    exact = x.astype(np.float64) @ w.T
    weight = with_kernel(make_weight(blocks, "q4_1", k), cpu_kernels.BLOCK_TARGET, 0, wide_rows=12)
    at = np.asarray(block_matmul(jnp.asarray(x), weight))
    below = np.asarray(block_matmul(jnp.asarray(x[:11]), weight))
    assert np.all(np.abs(below - exact[:11]) <= bound(x[:11], w)), "11 rows < wide_rows: float path"
    wide_err = np.abs(at - exact).max()
    float_err = np.abs(np.asarray(block_matmul(jnp.asarray(x), with_kernel(weight, weight.kernel, 0))) - exact).max()
    int8_err = np.abs(integer_reference(x, blocks, "q4_1") - exact).max()
    assert wide_err > 10 * float_err, f"12 rows: 16-bit path ({wide_err:.3g}), not float32's rounding ({float_err:.3g})"
    assert wide_err < int8_err / 50, f"int16 blocks ({wide_err:.3g}) far finer than int8 blocks ({int8_err:.3g})"
    int8_first = with_kernel(make_weight(blocks, "q4_1", k), cpu_kernels.BLOCK_TARGET, 12, wide_rows=12)
    np.testing.assert_allclose(np.asarray(block_matmul(jnp.asarray(x), int8_first)),
                               integer_reference(x, blocks, "q4_1"), rtol=1e-4, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("int_rows, wide_rows", [(0, 0), (4, 0), (0, 4)])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_fused_call_equals_one_call_per_weight_bit_for_bit(rows, int_rows, wide_rows):
    # q/k/v-like weights of three formats and widths (46: 4-column tiles and 2 singles, so a
    # weight's last thread chunk is short), then gate/up-like pairs; float path, integer path
    # and 16-bit path (rows >= 4; AVX2 builds run the float path for it). One call must give
    # each weight's own call's bits.
    k = 576
    x = jnp.asarray(activations(rows, k, seed=7))
    specs = [("q4_1", 64), ("q8_0", 46), ("q4_0", 24)]
    weights = [with_kernel(make_weight(random_blocks(fmt, n, k, seed=10 + i), fmt, k), cpu_kernels.BLOCK_TARGET,
                           int_rows, wide_rows=wide_rows) for i, (fmt, n) in enumerate(specs)]
    for group in (weights, weights[:2]):
        assert fusable(group)
        fused = jax.jit(block_matmul_many)(x, group)
        hlo = jax.jit(block_matmul_many).lower(x, group).as_text()
        assert cpu_kernels.BLOCK_MULTI_TARGET in hlo and f'"{cpu_kernels.BLOCK_TARGET}"' not in hlo
        for w, got in zip(group, fused):
            want = jax.jit(block_matmul)(x, w)
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_only_weights_on_one_kernel_with_the_same_settings_fuse():
    k = 64
    plain = make_weight(random_blocks("q4_1", 8, k), "q4_1", k)  # no kernel: XLA dequantizes
    on_kernel = with_kernel(plain, "ferrox_block_matmul", 0)
    assert not fusable([plain, plain])
    assert fusable([on_kernel, on_kernel]) and not fusable([on_kernel])
    assert not fusable([on_kernel, with_kernel(plain, "ferrox_block_matmul", 8)])  # other int_rows
    assert not fusable([on_kernel, with_kernel(plain, "ferrox_block_matmul", 0, wide_rows=8)])  # other wide_rows
    assert not fusable([on_kernel, with_kernel(plain, "ferrox_block_matmul_k", 0)])
    wider = with_kernel(make_weight(random_blocks("q4_1", 8, 2 * k), "q4_1", 2 * k), "ferrox_block_matmul", 0)
    assert not fusable([on_kernel, wider])
    assert not fusable([on_kernel] * 4)
    # not fusable: one plain product each, the XLA path's values
    x = jnp.asarray(activations(2, k))
    for got, w in zip(block_matmul_many(x, [plain, plain]), [plain, plain]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(block_matmul(x, w)))


needs_amx = pytest.mark.skipif(not cpu_kernels.block_amx(), reason="no AMX-BF16 on this CPU / OS")
SPLIT_BF16_EPS = 2.0 ** -14  # hi + lo keep ~16 bits of each operand; w_lo x_lo is dropped


@needs_amx
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [16, 40, 70])
def test_amx_path_within_split_bf16_bound_of_float64(fmt, rows):
    # 16: one activation tile; 40: a pair of tiles + a partial one; 70: past 4 tiles. n = 48: 3 panels
    k, n = 576, 48
    blocks, x = random_blocks(fmt, n, k, seed=4), activations(rows, k, seed=5)
    w = dequantize_host(blocks, fmt)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0, amx_rows=16)
    got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))
    err = np.abs(got - x.astype(np.float64) @ w.T)
    limit = SPLIT_BF16_EPS * (np.abs(x).astype(np.float64) @ np.abs(w).T) + bound(x, w)
    assert np.all(err <= limit), f"{fmt} AMX path: max error {err.max():.3g}, max relative {(err / limit).max():.3g}"


@needs_amx
@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_pieces_of_k_give_the_whole_k_bits(fmt):
    # Past 1.5 MB of packed activations (2 KB a 16-row tile and block) K goes in pieces whose rows
    # fit 512 KB, outer to spans of panels whose C tiles fit 256 KB: 600 rows at k = 8192 (38
    # tiles, 19 MB) give pieces of 6 blocks (the last of 4) and spans of 6 panels, shorter than
    # a thread's share of n = 1024 on two threads (8 panels: a span and one of 2). Slices of 32
    # rows (two tiles, 1 MB; the last of 24) run over all of K at once. C tiles go through memory
    # as float32 between pieces, so the bits are equal; and within the split-bf16 bound.
    rows, k, n = 600, 8192, 1024
    blocks, x = random_blocks(fmt, n, k, seed=9), activations(rows, k, seed=10)
    weight = with_kernel(make_weight(blocks, fmt, k), cpu_kernels.BLOCK_TARGET, 0, amx_rows=16)
    whole = same_bits_as_slices(weight, x, 32)
    w = dequantize_host(blocks, fmt)
    err = np.abs(whole - x.astype(np.float64) @ w.T)
    limit = SPLIT_BF16_EPS * (np.abs(x).astype(np.float64) @ np.abs(w).T) + bound(x, w)
    assert np.all(err <= limit), f"{fmt} AMX pieces: max relative error {(err / limit).max():.3g}"


@needs_amx
def test_amx_path_is_chosen_by_row_count():
    # x_0 = 1 + 2^-9 + 2^-20 needs 21 bits: the float path keeps it, the split keeps
    # hi + lo = 1 + 2^-9 (the 2^-20 is below lo's 8 bits). A Q8_0 weight d = 1, q = 1 picks x_0.
    k, n = 64, 16
    block = np.zeros((n, k // BLOCK, 34), np.uint8)
    block[..., 0:2] = np.float16(1.0).reshape(1).view(np.uint8)
    block[:, 0, 2] = 1
    weight = with_kernel(make_weight(block.reshape(n, -1), "q8_0", k), cpu_kernels.BLOCK_TARGET, 0, amx_rows=16)
    x = np.zeros((16, k), np.float32)
    x[:, 0] = np.float32(1 + 2.0 ** -9 + 2.0 ** -20)
    np.testing.assert_array_equal(np.asarray(block_matmul(jnp.asarray(x), weight)), np.float32(1 + 2.0 ** -9))
    np.testing.assert_array_equal(np.asarray(block_matmul(jnp.asarray(x[:15]), weight)), x[:15, :1].repeat(n, 1))


@needs_kernels
def test_kernel_reports_an_isa():
    assert cpu_kernels.block_isa() in ("AVX-512 VNNI", "AVX2")
