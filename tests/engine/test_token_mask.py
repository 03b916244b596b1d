"""apply_token_bitmask against a numpy reference, and the sampler on masked logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.request import RowSampling
from ferrox_jax.host_batch import SamplingArrays
from ferrox_jax.sampling import sample_checked
from models import cpu_kernels
from ferrox_jax.token_mask import apply_token_bitmask


def reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Token t allowed iff bit t % 32 of word t // 32 is set (words read as uint32)."""
    t = np.arange(logits.shape[1])
    words = bitmask.view(np.uint32)[:, t // 32]
    allowed = (words >> (t % 32).astype(np.uint32)) & 1
    return np.where(allowed == 1, logits, -np.inf).astype(logits.dtype)


def random_case(rows: int, vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab_size)).astype(np.float32)
    # Random words, so the padding bits past V in the last word are often set: they must be ignored.
    bitmask = rng.integers(-(2**31), 2**31, (rows, -(-vocab_size // 32)), dtype=np.int64).astype(np.int32)
    return logits, bitmask


@pytest.mark.parametrize("rows, vocab_size", [(1, 49152), (3, 49152), (2, 100), (2, 31), (1, 33)])
def test_matches_numpy_reference(rows, vocab_size):
    logits, bitmask = random_case(rows, vocab_size, seed=vocab_size)
    out = np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask))
    np.testing.assert_array_equal(out, reference(logits, bitmask))  # exact: a select, no arithmetic


def test_all_ones_row_leaves_logits_bit_identical():
    logits, bitmask = random_case(2, 1000, seed=1)
    logits[0, :4] = [-0.0, np.finfo(np.float32).tiny / 2, np.finfo(np.float32).max, -np.inf]
    bitmask[0] = -1
    out = np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask))
    assert np.array_equal(out[0].view(np.uint32), logits[0].view(np.uint32)), "row 0 must be untouched bit for bit"
    np.testing.assert_array_equal(out[1], reference(logits, bitmask)[1])


def test_all_zero_row_masks_every_token():
    logits, bitmask = random_case(1, 100, seed=2)
    out = np.asarray(apply_token_bitmask(logits, np.zeros_like(bitmask)))
    assert np.isneginf(out).all()


def test_one_compilation_serves_every_mask_of_a_shape():
    traces = []

    @jax.jit
    def step(logits, bitmask):
        traces.append(1)  # runs only while tracing
        return apply_token_bitmask(logits, bitmask)

    for seed in range(3):
        logits, bitmask = random_case(4, 1000, seed)
        if seed == 2:
            bitmask[:] = -1  # all rows unconstrained
        step(logits, bitmask).block_until_ready()
    assert len(traces) == 1


def test_mismatched_shapes_and_dtypes_raise_naming_both_sides():
    logits = np.zeros((2, 100), np.float32)
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        apply_token_bitmask(logits, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, np.zeros((2, 4), np.uint32))


KERNEL = cpu_kernels.unavailable_reason() is None
# XLA's sampler, and the CPU kernel's where it is built (`ferrox_jax/sampling.py:sample_checked`).
PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not KERNEL, reason="the CPU kernels are unavailable"))]


@pytest.mark.parametrize("cpu_kernel", PATHS)
def test_sampler_only_picks_allowed_tokens_greedy_and_drawn(cpu_kernel):
    vocab_size, rows = 1000, 4
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((rows, vocab_size)).astype(np.float32) * 3
    allowed = [np.array(ids) for ids in ([7], [0, 999], [31, 32, 33, 500], list(range(100, 200)))]
    for r, favourite in enumerate([8, 1, 34, 99]):
        logits[r, favourite] = 50.0  # the unconstrained favourite is a disallowed token
        assert favourite not in allowed[r]
    bitmask = np.zeros((rows, -(-vocab_size // 32)), np.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            bitmask.view(np.uint32)[r, t // 32] |= np.uint32(1 << (t % 32))
    masked = jax.jit(apply_token_bitmask)(logits, bitmask)
    settings = [RowSampling(temperature=0.0), RowSampling(temperature=1.0, seed=11),
                RowSampling(temperature=2.5, top_p=0.9, seed=5), RowSampling(temperature=0.7, top_k=3, min_p=0.05, seed=9)]
    run = jax.jit(functools.partial(sample_checked, cpu_kernel=cpu_kernel))
    for params in settings:
        for position in range(8):
            batch = jax.device_put(SamplingArrays.build([params] * rows, [()] * rows, [0] * rows, vocab_size))
            tokens = np.asarray(run(masked, jnp.full(rows, position, jnp.int32), batch)[0])
            for r, ids in enumerate(allowed):
                assert tokens[r] in ids, f"{params}: row {r} sampled {tokens[r]}, allowed {ids[:8]}"


@pytest.mark.parametrize("cpu_kernel", PATHS)
def test_a_penalty_that_rounds_to_zero_never_brings_back_a_masked_token(cpu_kernel):
    # Found by the 200-example fuzz run: repetition_penalty 5e-324 (> 0, so valid) is 0.0 in
    # float32; the penalty times a masked -inf was NaN, argmax took it, and the grammar
    # matcher rejected the token (a 500). The mask now comes after the penalties.
    vocab_size, rows = 64, 2
    logits = np.linspace(-3, 3, vocab_size, dtype=np.float32)[None].repeat(rows, 0)
    allowed = [5, 6]
    bitmask = np.zeros((rows, 2), np.int32)
    for t in allowed:
        bitmask.view(np.uint32)[:, 0] |= np.uint32(1 << t)
    history = tuple(range(0, vocab_size, 3))  # penalised: masked tokens and allowed token 6
    run = jax.jit(functools.partial(sample_checked, cpu_kernel=cpu_kernel))
    for params in (RowSampling(temperature=0.0, repetition_penalty=5e-324),
                   RowSampling(temperature=1.0, repetition_penalty=5e-324, top_p=5e-324, seed=3)):
        batch = jax.device_put(SamplingArrays.build([params] * rows, [history] * rows, [0] * rows, vocab_size))
        tokens = np.asarray(run(jnp.asarray(logits), jnp.zeros(rows, jnp.int32), batch, jnp.asarray(bitmask))[0])
        assert set(tokens.tolist()) <= set(allowed), f"{params}: sampled {tokens}"
