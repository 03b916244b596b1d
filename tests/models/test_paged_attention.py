"""Paged attention and KV writes against a dense causal reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import dense_causal_attention, kv_slots, paged_attention, write_kv
from tests.support.engine_helpers import float32_matmuls  # noqa: F401 (autouse: f32 tolerances on any backend)

BLOCK_SIZE = 8
NUM_BLOCKS = 24
KV_HEADS, HEADS, HEAD_DIM = 2, 4, 16
MAX_LEN = 64  # 8 blocks of 8


def _random(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("length", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, MAX_LEN])
def test_paged_attention_matches_dense_with_shuffled_blocks(length):
    rng = np.random.RandomState(length)
    blocks_needed = math.ceil(length / BLOCK_SIZE)
    # Shuffled, non-contiguous block ids (never 0) so the block table really matters.
    table = rng.permutation(np.arange(1, NUM_BLOCKS))[: MAX_LEN // BLOCK_SIZE]
    q = _random((length, HEADS, HEAD_DIM), 1)
    k = _random((length, KV_HEADS, HEAD_DIM), 2)
    v = _random((length, KV_HEADS, HEAD_DIM), 3)
    # Garbage everywhere in the cache: only the table's blocks up to `length` may be read.
    k_cache = _random((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), 4) * 100
    v_cache = _random((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), 5) * 100
    positions = jnp.arange(length)[None]
    valid = jnp.ones((1, length), bool)
    tables = jnp.asarray(table[None], jnp.int32)
    blocks, offsets = kv_slots(positions, valid, tables, BLOCK_SIZE)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, blocks.reshape(-1), offsets.reshape(-1))
    scale = 1 / math.sqrt(HEAD_DIM)
    paged = paged_attention(q[None], k_cache, v_cache, tables, positions, scale)[0]
    dense = dense_causal_attention(q, k, v, scale)
    # Same f32 math in a different order: 1e-5 absolute.
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), atol=1e-5, rtol=1e-5)
    assert blocks_needed <= len(table)


def test_padded_tokens_write_only_into_the_null_block():
    k_cache = jnp.zeros((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM))
    v_cache = jnp.zeros_like(k_cache)
    k = jnp.ones((1, 4, KV_HEADS, HEAD_DIM))
    positions = jnp.asarray([[0, 1, 2, 3]])
    valid = jnp.asarray([[True, True, False, False]])
    tables = jnp.asarray([[5, 6]], jnp.int32)
    blocks, offsets = kv_slots(positions, valid, tables, BLOCK_SIZE)
    k_cache, _ = write_kv(k_cache, v_cache, k[0], k[0], blocks.reshape(-1), offsets.reshape(-1))
    written = np.asarray(k_cache.sum(axis=(0, 2, 3)))
    assert written[5] == 2 * KV_HEADS * HEAD_DIM, "the two valid tokens land in block 5"
    assert written[0] > 0, "padding lands in the null block"
    assert written[[b for b in range(NUM_BLOCKS) if b not in (0, 5)]].sum() == 0, "no other block touched"


def test_attention_without_causal_mask_would_differ():
    """Negative control: the dense reference is causal, so a non-causal result must not match."""
    q, k, v = _random((9, HEADS, HEAD_DIM), 1), _random((9, KV_HEADS, HEAD_DIM), 2), _random((9, KV_HEADS, HEAD_DIM), 3)
    dense = dense_causal_attention(q, k, v, 0.25)
    kk, vv = jnp.repeat(k, 2, 1), jnp.repeat(v, 2, 1)
    full = jnp.einsum("hts,shd->thd", jax.nn.softmax(jnp.einsum("thd,shd->hts", q, kk) * 0.25, -1), vv)
    assert not np.allclose(np.asarray(dense), np.asarray(full), atol=1e-3)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("length", [1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, MAX_LEN])
def test_sinks_match_dense_softmax_with_a_sink_column(length, window):
    """Attention sinks (gpt-oss): a per-head logit in the softmax's denominator with no value.
    Paged (online softmax started from the sink) against the dense reference, which appends
    the sink as a softmax column and drops it; the two reference forms agree with a hand
    computation, and without the sinks the output differs (the control)."""
    rng = np.random.RandomState(length)
    table = jnp.asarray(rng.permutation(np.arange(1, NUM_BLOCKS))[None, : MAX_LEN // BLOCK_SIZE], jnp.int32)
    q, k, v = _random((length, HEADS, HEAD_DIM), 1), _random((length, KV_HEADS, HEAD_DIM), 2), \
        _random((length, KV_HEADS, HEAD_DIM), 3)
    sinks = _random((HEADS,), 6) * 2
    k_cache = _random((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), 4) * 100
    v_cache = _random((KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), 5) * 100
    positions, valid = jnp.arange(length)[None], jnp.ones((1, length), bool)
    blocks, offsets = kv_slots(positions, valid, table, BLOCK_SIZE)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, blocks.reshape(-1), offsets.reshape(-1))
    scale = 1 / math.sqrt(HEAD_DIM)
    paged = paged_attention(q[None], k_cache, v_cache, table, positions, scale, valid=valid, window=window,
                            sinks=sinks)[0]
    dense = dense_causal_attention(q, k, v, scale, window=window, sinks=sinks)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), atol=1e-5, rtol=1e-5)
    # By hand for the last query: weights exp(s) / (exp(sink) + sum exp(s)) over its visible keys.
    t = length - 1
    first = 0 if window is None else max(0, t - window + 1)
    kk = np.repeat(np.asarray(k), HEADS // KV_HEADS, 1)[first:t + 1]
    vv = np.repeat(np.asarray(v), HEADS // KV_HEADS, 1)[first:t + 1]
    s = np.einsum("hd,shd->hs", np.asarray(q[t]), kk) * scale
    e = np.exp(s)
    w = e / (np.exp(np.asarray(sinks))[:, None] + e.sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(dense[t]), np.einsum("hs,shd->hd", w, vv), atol=1e-5, rtol=1e-5)
    plain = paged_attention(q[None], k_cache, v_cache, table, positions, scale, valid=valid, window=window)[0]
    assert not np.allclose(np.asarray(plain), np.asarray(paged), atol=1e-3), "sinks must change the output"
