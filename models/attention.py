"""Paged attention in pure JAX: K/V writes into blocks and attention through block tables.

Cache layout per layer (described once in `ferrox_jax/kv_cache.py`):
`[K kv_heads, num_blocks, block_size, hd]`, the layout JAX's Pallas TPU paged-attention
kernel reads. A row's block table lists the blocks holding its positions in order:
position p lives in block `block_tables[row, p // block_size]` at offset
`p % block_size`. Block 0 is the null block: padded tokens write there, so padding can
never overwrite a live request's K/V, and padded table entries point there.

The cache may be stored narrower than the compute dtype (`--kv-cache-dtype bfloat16` under
float32 compute): `store_kv` casts on the write path, `load_kv` widens on the read path,
so the softmax and the weighted sum of values always run in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30
ATTENTION_CHUNK_BLOCKS = 8  # blocks per attention loop iteration; table widths are multiples  # large negative instead of -inf: a fully masked row stays finite


def store_kv(x: jax.Array, cache: jax.Array) -> jax.Array:
    """New K or V values in the cache's storage dtype (write path)."""
    return x.astype(cache.dtype)


def load_kv(blocks: jax.Array, dtype) -> jax.Array:
    """Gathered K or V blocks in the compute dtype (read path)."""
    return blocks.astype(dtype)


def write_kv(k_cache, v_cache, k, v, positions, valid, block_tables):
    """Scatter new K/V into their blocks.

    Args:
      k_cache, v_cache: [K, N, bs, hd].
      k, v: [B, T, K, hd] for the new tokens.
      positions: i32[B, T]; valid: bool[B, T]; block_tables: i32[B, MB].
    Returns:
      (k_cache, v_cache) with the valid tokens written (padding lands in block 0).
    """
    num_kv, _, block_size, head_dim = k_cache.shape
    max_blocks = block_tables.shape[1]
    block_idx = jnp.clip(positions // block_size, 0, max_blocks - 1)
    blocks = jnp.take_along_axis(block_tables, block_idx, axis=1)
    blocks = jnp.where(valid, blocks, 0).reshape(-1)
    offsets = jnp.where(valid, positions % block_size, 0).reshape(-1)
    b, t = positions.shape
    k_flat = store_kv(k, k_cache).transpose(2, 0, 1, 3).reshape(num_kv, b * t, head_dim)
    v_flat = store_kv(v, v_cache).transpose(2, 0, 1, 3).reshape(num_kv, b * t, head_dim)
    k_cache = k_cache.at[:, blocks, offsets].set(k_flat)
    v_cache = v_cache.at[:, blocks, offsets].set(v_flat)
    return k_cache, v_cache


def paged_attention(q, k_cache, v_cache, block_tables, positions, scale: float,
                    chunk_blocks: int = ATTENTION_CHUNK_BLOCKS):
    """Causal attention of new queries over each row's blocks (already holding the new K/V).

    Flash-decoding style: a `while_loop` walks the block tables `chunk_blocks` blocks at a
    time with an online softmax, and stops after the chunk holding the batch's furthest
    query position. The trip count is traced, so one compiled step serves every context
    length and reads only the blocks in use (no block-table-width buckets).

    Args:
      q: [B, T, H, hd] rotated queries.
      k_cache, v_cache: [K, N, bs, hd].
      block_tables: i32[B, MB] with MB a multiple of chunk_blocks (pad with 0).
      positions: i32[B, T] query positions; key s is visible iff s <= position.
    Returns:
      f32[B, T, H, hd].
    """
    b, t, num_heads, head_dim = q.shape
    num_kv, _, block_size, _ = k_cache.shape
    groups = num_heads // num_kv
    max_blocks = block_tables.shape[1]
    if max_blocks % chunk_blocks:
        raise ValueError(f"block table width {max_blocks} must be a multiple of chunk_blocks {chunk_blocks}")
    chunk_keys = chunk_blocks * block_size
    qg = q.reshape(b, t, num_kv, groups, head_dim)
    num_chunks = jnp.max(positions) // chunk_keys + 1

    def body(i, carry):
        m, l, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, hd]
        blocks = jax.lax.dynamic_slice_in_dim(block_tables, i * chunk_blocks, chunk_blocks, axis=1)
        keys = load_kv(k_cache[:, blocks], q.dtype).reshape(num_kv, b, chunk_keys, head_dim)
        values = load_kv(v_cache[:, blocks], q.dtype).reshape(num_kv, b, chunk_keys, head_dim)
        s = jnp.einsum("btkgd,kbsd->bkgts", qg, keys, preferred_element_type=jnp.float32) * scale
        key_pos = i * chunk_keys + jnp.arange(chunk_keys, dtype=jnp.int32)
        visible = key_pos[None, None, None, None, :] <= positions[:, None, None, :, None]
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jnp.einsum("bkgts,kbsd->bkgtd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        acc = acc * correction[..., None] + pv
        return m_new, l, acc

    init = (jnp.full((b, num_kv, groups, t), _MASKED, jnp.float32),
            jnp.zeros((b, num_kv, groups, t), jnp.float32),
            jnp.zeros((b, num_kv, groups, t, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / l[..., None]  # [B, K, G, T, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, num_heads, head_dim)


def dense_causal_attention(q, k, v, scale: float):
    """Reference: plain causal attention over contiguous K/V. q [T, H, hd], k/v [T, K, hd]."""
    t, num_heads, head_dim = q.shape
    groups = num_heads // k.shape[1]
    k = jnp.repeat(k, groups, axis=1)
    v = jnp.repeat(v, groups, axis=1)
    scores = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask[None], scores, _MASKED)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, -1), v.astype(jnp.float32))
