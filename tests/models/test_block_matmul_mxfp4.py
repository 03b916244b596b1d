"""MXFP4 blocks (models/gguf_mxfp4.py) and their kernel (models/kernels/block_matmul_mxfp4.cc).

The layout is checked against the `gguf` package's dequantizer (llama.cpp's block_mxfp4)
on random bytes, the repacking of transformers' `*_blocks` / `*_scales` against
transformers' own `convert_moe_packed_tensors`, and the products against float64 numpy,
x @ dequantize(w)^T: every MXFP4 weight is exact in float32 and the kernel's FMAs round
only the sums, so the tolerance is a few float32 ulps of sum |x_k w_k|. Both builds run
where the CPU has AVX-512 (the AVX2 one through its forced target). Controls: the same
products against blocks with their nibbles swapped or their scales one exponent off miss
that tolerance, and a repacking that keeps transformers' nibble order misses its values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from models import cpu_kernels, gguf_mxfp4
from models.gguf_blocks import block_matmul, dequantize_blocks, dequantize_host, make_weight, with_kernel
from tests.models.test_block_matmul import activations, bound

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def random_mxfp4(n: int, k: int, seed: int = 0, scales=(112, 132)) -> np.ndarray:
    """u8[n, k / 32 * 17]: random codes (every nibble), scale bytes in [scales) (2^-15 .. 2^4)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    b[..., 0] = rng.integers(*scales, (n, k // 32))
    return b.reshape(n, -1)


def swap_nibbles(blocks: np.ndarray) -> np.ndarray:
    b = blocks.copy().reshape(blocks.shape[0], -1, 17)
    b[..., 1:] = (b[..., 1:] >> 4) | (b[..., 1:] << 4)
    return b.reshape(blocks.shape)


def scale_up(blocks: np.ndarray) -> np.ndarray:
    b = blocks.copy().reshape(blocks.shape[0], -1, 17)
    b[..., 0] += 1
    return b.reshape(blocks.shape)


def test_dequantize_equals_the_gguf_package():
    blocks = random_mxfp4(6, 512, scales=(0, 250))  # subnormal (0, 1) and large scales too
    want = dequantize(blocks, Q.MXFP4).reshape(6, 512)
    np.testing.assert_array_equal(dequantize_host(blocks, "mxfp4"), want)
    normal = random_mxfp4(6, 512, seed=1, scales=(2, 250))  # XLA may flush subnormals
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(jnp.asarray(normal), "mxfp4")),
                                  dequantize_host(normal, "mxfp4", np.float32))
    assert np.abs(dequantize_host(swap_nibbles(blocks), "mxfp4") - want).max() > 0.1


def test_hf_blocks_repack_to_transformers_values():
    """transformers' packing (weight 2i low nibble of byte i) repacked into ggml's (weight j
    low nibble of byte j, j + 16 its high one): the values of `convert_moe_packed_tensors`
    exactly; keeping the bytes as they are (transformers' order) does not."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(2)
    hf_blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)  # [E, R, G, 16]
    hf_scales = rng.integers(118, 134, (3, 10, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(hf_blocks), torch.from_numpy(hf_scales),
                                      dtype=torch.float32).numpy()  # [E, G * 32, R]
    ours = gguf_mxfp4.repack_hf(hf_blocks, hf_scales)
    assert ours.shape == (3, 10, 4 * 17) and ours.dtype == np.uint8
    got = np.stack([dequantize_host(e, "mxfp4", np.float32) for e in ours]).swapaxes(-1, -2)
    np.testing.assert_array_equal(got, want)
    as_is = np.concatenate([hf_scales[..., None], hf_blocks], axis=-1).reshape(3, 10, -1)
    wrong = np.stack([dequantize_host(e, "mxfp4", np.float32) for e in as_is]).swapaxes(-1, -2)
    assert np.abs(wrong - want).max() > 0.1
    with pytest.raises(ValueError, match="do not pair"):
        gguf_mxfp4.repack_hf(hf_blocks, hf_scales[..., :3])


def test_rows_must_hold_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        make_weight(np.zeros((4, 17), np.uint8), "mxfp4", 48)
    with pytest.raises(ValueError, match=r"uint8\[out, 34\]"):
        make_weight(np.zeros((4, 17), np.uint8), "mxfp4", 64)
    assert make_weight(random_mxfp4(3, 96), "mxfp4", 96).shape == (96, 3)


def product(blocks: np.ndarray, x: np.ndarray, kernel: str | None) -> np.ndarray:
    weight = make_weight(blocks, "mxfp4", x.shape[1])
    if kernel is not None:
        weight = with_kernel(weight, kernel, 0)
    return np.asarray(jax.jit(block_matmul)(jnp.asarray(x), weight))


def check_product(rows: int, k: int, n: int, kernel: str | None, seed: int = 0) -> None:
    blocks, x = random_mxfp4(n, k, seed=seed), activations(rows, k, seed=seed + 1)
    w = dequantize_host(blocks, "mxfp4")
    err = np.abs(product(blocks, x, kernel) - x.astype(np.float64) @ w.T)
    assert np.all(err <= bound(x, w)), f"mxfp4 {rows}x[{k}, {n}] on {kernel}: max error {err.max():.3g}"


def test_xla_path_matches_float64_reference():
    check_product(3, 256, 9, None)


# 1 row (a decode step), 4 and 8 (one group of the AVX2 / AVX-512 build), 9 and 13 (a group
# and a remainder), 32 (several groups); n = 37 columns (chunks of 4 and a single column);
# 8 x [1024, 37] passes 2^18 multiply-adds, so its columns are shared over threads.
SHAPES = [(1, 256, 37), (4, 64, 37), (8, 1024, 37), (9, 96, 37), (13, 256, 5), (32, 128, 37)]


@needs_kernels
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_kernel_matches_float64_reference(rows, k, n):
    check_product(rows, k, n, cpu_kernels.BLOCK_MXFP4_TARGET, seed=rows)


@needs_kernels
@pytest.mark.parametrize("rows,k,n", SHAPES[:4])
def test_avx2_build_matches_float64_reference(rows, k, n):
    check_product(rows, k, n, cpu_kernels.BLOCK_MXFP4_AVX2_TARGET, seed=rows + 50)


@needs_kernels
def test_kernel_rows_do_not_change_a_row():
    """Each output element is computed whole, in one order, whatever the rows beside it:
    row 0 of a 9-row product is the one-row product bit for bit (an expert tile pads one
    token to 8+ rows: its value must not depend on the padding)."""
    blocks, x = random_mxfp4(37, 512, seed=7), activations(9, 512, seed=8)
    many = product(blocks, x, cpu_kernels.BLOCK_MXFP4_TARGET)
    one = product(blocks, x[:1], cpu_kernels.BLOCK_MXFP4_TARGET)
    np.testing.assert_array_equal(many[:1], one)


@needs_kernels
@pytest.mark.parametrize("mutate", [swap_nibbles, scale_up], ids=["nibbles swapped", "scale one exponent up"])
@pytest.mark.parametrize("kernel", ["BLOCK_MXFP4_TARGET", "BLOCK_MXFP4_AVX2_TARGET"])
def test_a_wrong_layout_misses_the_tolerance(mutate, kernel):
    """Negative control: a kernel reading the nibbles the other way round or the scale one
    exponent off would compute the reference of the mutated blocks; that misses the
    tolerance the kernel meets, at nearly every output element."""
    blocks, x = random_mxfp4(37, 256, seed=3), activations(4, 256, seed=4)
    w, wrong = dequantize_host(blocks, "mxfp4"), dequantize_host(mutate(blocks), "mxfp4")
    got = product(blocks, x, getattr(cpu_kernels, kernel))
    assert np.all(np.abs(got - x.astype(np.float64) @ w.T) <= bound(x, w))
    missed = np.abs(got - x.astype(np.float64) @ wrong.T) > bound(x, w)
    assert missed.mean() > 0.9, f"{mutate.__name__}: only {missed.mean():.0%} of the outputs miss"
