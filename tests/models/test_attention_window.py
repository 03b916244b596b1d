"""Paged attention with a sliding window and soft-capped logits against a dense numpy
reference, with shuffled blocks, windows crossing blocks, and rows whose block walks start
at different chunks (block_size 4 x 8 blocks per chunk = 32 keys per chunk)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import paged_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 96  # 74 blocks for the decode rows below, plus the null block
KV_HEADS, HEADS, HEAD_DIM = 2, 4, 16
TABLE_BLOCKS = 24  # 96 positions per row: three 32-key chunks
SCALE = 1 / math.sqrt(HEAD_DIM)
LENGTHS = (1, 7, 31, 33, 47, 70, 96)  # last query in the first, second and third chunk

_paged = jax.jit(paged_attention, static_argnames=("scale", "chunk_blocks", "window", "softcap"))


def dense_reference(q, k, v, window=None, softcap=None):
    """Causal (optionally windowed, soft-capped) attention in float64 numpy.
    q [T, H, hd], k/v [T, K, hd] -> [T, H, hd]."""
    t = q.shape[0]
    groups = HEADS // KV_HEADS
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * SCALE
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = (j <= i) & ((i - j < window) if window is not None else True)
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v)


@functools.cache
def filled_cache(lengths, seed=0):
    """Per row: random q/k/v for positions 0..n-1, its K/V placed through a shuffled block
    table into a cache full of large garbage. Returns ([(q, k, v)], k_cache, v_cache, tables)."""
    rng = np.random.RandomState(seed)
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))
    k_cache = rng.randn(KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM).astype(np.float32) * 100
    v_cache = rng.randn(KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM).astype(np.float32) * 100
    tables = np.zeros((len(lengths), TABLE_BLOCKS), np.int32)
    rows, used = [], 0
    for i, n in enumerate(lengths):
        need = -(-n // BLOCK_SIZE)
        tables[i, :need] = ids[used:used + need]
        used += need
        q, k, v = (rng.randn(n, h, HEAD_DIM).astype(np.float32) for h in (HEADS, KV_HEADS, KV_HEADS))
        for p in range(n):
            k_cache[:, tables[i, p // BLOCK_SIZE], p % BLOCK_SIZE] = k[p]
            v_cache[:, tables[i, p // BLOCK_SIZE], p % BLOCK_SIZE] = v[p]
        rows.append((q, k, v))
    return rows, jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(tables)


@pytest.mark.parametrize("window,softcap", [(12, None), (5, None), (40, None), (None, 2.0), (12, 2.0)])
def test_decode_rows_match_dense_reference(window, softcap):
    """One query per row at its last position; rows start their walks at different chunks."""
    rows, k_cache, v_cache, tables = filled_cache(LENGTHS)
    q = jnp.asarray(np.stack([r[0][-1] for r in rows])[:, None])
    positions = jnp.asarray([[n - 1] for n in LENGTHS], jnp.int32)
    got = np.asarray(_paged(q, k_cache, v_cache, tables, positions, scale=SCALE,
                            valid=jnp.ones((len(LENGTHS), 1), bool), window=window, softcap=softcap))
    for i, (qr, kr, vr) in enumerate(rows):
        want = dense_reference(qr, kr, vr, window, softcap)[-1]
        # f32 against f64, values ~N(0, 1): 1e-5.
        np.testing.assert_allclose(got[i, 0], want, atol=1e-5, rtol=1e-5, err_msg=f"row of length {LENGTHS[i]}")


def test_prefill_chunk_with_padding_matches_dense_reference():
    """A 20-token chunk at positions 50..69 padded to 24 (padding at position 0, as the
    runner pads): padding must not pull the walk back to chunk 0 or change real rows."""
    n, start, window = 70, 50, 12
    (row,), k_cache, v_cache, tables = filled_cache((n,), seed=3)
    q, k, v = row
    positions = jnp.concatenate([jnp.arange(start, n), jnp.zeros(4, jnp.int32)])[None]
    valid = jnp.concatenate([jnp.ones(n - start, bool), jnp.zeros(4, bool)])[None]
    qs = jnp.concatenate([jnp.asarray(q[start:]), jnp.zeros((4, HEADS, HEAD_DIM))])[None]
    got = np.asarray(_paged(qs, k_cache, v_cache, tables, positions, scale=SCALE, valid=valid, window=window))
    np.testing.assert_allclose(got[0, : n - start], dense_reference(q, k, v, window)[start:], atol=1e-5, rtol=1e-5)
    assert np.isfinite(got).all(), "padded queries stay finite"


def test_without_the_window_the_result_differs():
    """Negative control: with the window unset the paged result no longer matches the
    windowed reference."""
    rows, k_cache, v_cache, tables = filled_cache(LENGTHS)
    q = jnp.asarray(rows[-1][0][-1])[None, None]
    full = np.asarray(_paged(q, k_cache, v_cache, tables[-1:], jnp.asarray([[95]]), scale=SCALE,
                             valid=jnp.ones((1, 1), bool)))
    assert not np.allclose(full[0, 0], dense_reference(*rows[-1], window=12)[-1], atol=1e-3)


def test_window_needs_valid():
    rows, k_cache, v_cache, tables = filled_cache(LENGTHS)
    with pytest.raises(ValueError, match="needs valid"):
        paged_attention(jnp.zeros((1, 1, HEADS, HEAD_DIM)), k_cache, v_cache, tables[:1], jnp.asarray([[0]]), SCALE,
                        window=4)
