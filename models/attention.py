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
from jax.sharding import PartitionSpec as P

_MASKED = -1e30  # large negative instead of -inf: a fully masked row stays finite
ATTENTION_CHUNK_BLOCKS = 8  # blocks per attention loop iteration; table widths are multiples
# A 16-bit float KV cache on the CPU holds its words as integers (ferrox_jax/kv_cache.py:
# storage_dtype); the integer type says which float they are.
KV_WORD_FLOATS = {jnp.dtype(jnp.uint16): jnp.bfloat16, jnp.dtype(jnp.int16): jnp.float16}


def store_kv(x: jax.Array, cache: jax.Array) -> jax.Array:
    """New K or V values in the cache's storage dtype (write path); a uint16 cache holds
    bfloat16 bits, an int16 one float16 bits (`ferrox_jax/kv_cache.py:storage_dtype`)."""
    word_float = KV_WORD_FLOATS.get(jnp.dtype(cache.dtype))
    if word_float is not None:
        return jax.lax.bitcast_convert_type(x.astype(word_float), cache.dtype)
    return x.astype(cache.dtype)


def load_kv(blocks: jax.Array, dtype) -> jax.Array:
    """Gathered K or V blocks in the compute dtype (read path)."""
    word_float = KV_WORD_FLOATS.get(jnp.dtype(blocks.dtype))
    if word_float is not None:
        blocks = jax.lax.bitcast_convert_type(blocks, word_float)
    return blocks.astype(dtype)


def kv_slots(positions, valid, block_tables, block_size: int):
    """Where each new token's K/V goes: (block id, offset in the block), both i32[B, T].

    Args:
      positions: i32[B, T]; valid: bool[B, T]; block_tables: i32[B, MB].
    Padding goes to block 0, offset 0 (the null block), never into a live row's blocks.
    """
    max_blocks = block_tables.shape[1]
    block_idx = jnp.clip(positions // block_size, 0, max_blocks - 1)
    blocks = jnp.take_along_axis(block_tables, block_idx, axis=1)
    return jnp.where(valid, blocks, 0), jnp.where(valid, positions % block_size, 0)


def write_kv(k_cache, v_cache, k, v, blocks, offsets):
    """Scatter new K/V into their blocks.

    Args:
      k_cache, v_cache: [K, N, bs, hd].
      k, v: [n, K, hd] for the n new tokens (flat).
      blocks, offsets: i32[n] each token's slot (`kv_slots`).
    Returns:
      (k_cache, v_cache) with the tokens written.
    """
    k_cache = k_cache.at[:, blocks, offsets].set(store_kv(k, k_cache).transpose(1, 0, 2))
    v_cache = v_cache.at[:, blocks, offsets].set(store_kv(v, v_cache).transpose(1, 0, 2))
    return k_cache, v_cache


def paged_attention(q, k_cache, v_cache, block_tables, positions, scale: float,
                    chunk_blocks: int = ATTENTION_CHUNK_BLOCKS, *, valid=None, window: int | None = None,
                    softcap: float | None = None, sinks=None, limits=None, chunk: int | None = None):
    """Causal attention of new queries over each row's blocks (already holding the new K/V).

    Flash-decoding style: a `fori_loop` walks the block tables `chunk_blocks` blocks at a
    time with an online softmax, and stops after the chunk holding the row's furthest
    query position. The trip count is traced, so one compiled step serves every context
    length and reads only the blocks in use (no block-table-width buckets).

    With a sliding `window`, key s is visible to a query at p iff p - window < s <= p (as
    transformers' sliding mask), and each row starts its walk at the chunk holding its
    first visible key, so a long context pays only for the keys it can see; with the
    sliding group's own pool (`ferrox_jax/kv_groups.py`) the table's entries before it
    point at the null slot, their slots already handed back. With `softcap`, scores
    become softcap * tanh(score / softcap) before masking (Gemma 2's logit soft-capping).
    With `sinks` (gpt-oss), each query head's learned logit joins the softmax's denominator
    as a key with no value: the online softmax starts from it (m = sink, l = 1) instead of
    from nothing, so a head can attend "nowhere" and its weights sum to less than 1.
    With `chunk` (chunked local attention, Llama 4's `attention_chunk_size`), key s is
    visible to a query at p iff s // chunk == p // chunk and s <= p: a query sees only keys
    of its own chunk of positions. Each row starts its walk at the attention chunk holding
    the start of its first query's position chunk, as a window does; the cache itself stays
    full-length (the blocks before are kept and accounted).

    Args:
      q: [B, T, H, hd] rotated queries.
      k_cache, v_cache: [K, N, bs, hd].
      block_tables: i32[B, MB] with MB a multiple of chunk_blocks (pad with 0).
      positions: i32[B, T] query positions; key s is visible iff s <= position.
      valid: bool[B, T] real tokens; needed with a window (padding must not pull a row's
        first chunk back to 0).
      window: sliding window in keys (the query's own included), or None.
      chunk: the positions' chunk size of chunked local attention, or None.
      softcap: logit soft-cap, or None.
      sinks: f32[H] per-head sink logits, or None.
      limits: i32[B, T] the furthest key position each query sees (None: its own position).
        An image's tokens see the whole image (Gemma 3 attends bidirectionally within one),
        so their limit is the image's last position; the window still counts back from the
        query's own position.
    Returns:
      f32[B, T, H, hd].
    """
    b, t, num_heads, head_dim = q.shape
    num_kv, _, block_size, _ = k_cache.shape
    groups = num_heads // num_kv
    max_blocks = block_tables.shape[1]
    if max_blocks % chunk_blocks:
        raise ValueError(f"block table width {max_blocks} must be a multiple of chunk_blocks {chunk_blocks}")
    if window is not None and valid is None:
        raise ValueError("paged_attention with a window needs valid (which query tokens are real)")
    chunk_keys = chunk_blocks * block_size
    qg = q.reshape(b, t, num_kv, groups, head_dim)
    limits = positions if limits is None else limits
    if chunk is not None and valid is None:
        raise ValueError("paged_attention with a chunk needs valid (which query tokens are real)")
    per_row = window is not None or chunk is not None  # rows start their walks at their own chunk
    if chunk is not None:
        first_chunk, num_chunks = _local_chunks(positions, limits, valid, chunk, chunk_keys)
    elif window is None:
        first_chunk = jnp.zeros((b,), jnp.int32)
        num_chunks = jnp.max(limits) // chunk_keys + 1
    else:
        first_chunk, num_chunks = _window_chunks(positions, limits, valid, window, chunk_keys)

    def chunk_blocks_of(i):
        """i32[B, chunk_blocks] block ids of each row's i-th chunk in its walk, and the
        position of that chunk's first key per row."""
        if not per_row:  # every row starts at chunk 0: one slice for the whole batch
            blocks = jax.lax.dynamic_slice_in_dim(block_tables, i * chunk_blocks, chunk_blocks, axis=1)
            return blocks, jnp.full((b,), i * chunk_keys, jnp.int32)
        chunk = first_chunk + i  # [B]
        idx = chunk[:, None] * chunk_blocks + jnp.arange(chunk_blocks, dtype=jnp.int32)
        # Past the table's end (a row that finished its walk early) reads block 0; every
        # such key lies beyond the row's positions, so it is masked.
        blocks = jnp.take_along_axis(block_tables, jnp.minimum(idx, max_blocks - 1), axis=1)
        return blocks, chunk * chunk_keys

    def body(i, carry):
        m, l, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, hd]
        blocks, start = chunk_blocks_of(i)
        keys = load_kv(k_cache[:, blocks], q.dtype).reshape(num_kv, b, chunk_keys, head_dim)
        values = load_kv(v_cache[:, blocks], q.dtype).reshape(num_kv, b, chunk_keys, head_dim)
        s = jnp.einsum("btkgd,kbsd->bkgts", qg, keys, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        key_pos = start[:, None] + jnp.arange(chunk_keys, dtype=jnp.int32)  # [B, S]
        visible = key_pos[:, None, None, None, :] <= limits[:, None, None, :, None]
        if window is not None:
            visible &= key_pos[:, None, None, None, :] > positions[:, None, None, :, None] - window
        if chunk is not None:  # only the keys of the query's own chunk of positions
            visible &= key_pos[:, None, None, None, :] >= (positions // chunk * chunk)[:, None, None, :, None]
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if per_row:
            # A query may see nothing in its row's first chunks (its window starts later):
            # exp(_MASKED - _MASKED) = 1 there, so zero them explicitly.
            p = jnp.where(visible, p, 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jnp.einsum("bkgts,kbsd->bkgtd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        acc = acc * correction[..., None] + pv
        return m_new, l, acc

    if sinks is None:
        m0, l0 = jnp.full((b, num_kv, groups, t), _MASKED, jnp.float32), jnp.zeros((b, num_kv, groups, t), jnp.float32)
    else:  # the sink is a key every query sees, of logit sinks[h] and value 0
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv, groups, 1), (b, num_kv, groups, t))
        l0 = jnp.ones((b, num_kv, groups, t), jnp.float32)
    init = (m0, l0, jnp.zeros((b, num_kv, groups, t, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, K, G, T, hd]; padded queries see nothing
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, num_heads, head_dim)


def _window_chunks(positions, limits, valid, window: int, chunk_keys: int):
    """Per row, the chunk holding its first visible key, and the batch's trip count (the
    most chunks any row walks from there to the furthest key a query sees)."""
    real = valid.any(axis=1)
    lo = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1)
    hi = jnp.max(jnp.where(valid, limits, 0), axis=1)
    first = jnp.where(real, jnp.maximum(lo - window + 1, 0) // chunk_keys, 0).astype(jnp.int32)
    last = hi // chunk_keys
    return first, jnp.max(last - first) + 1


def _local_chunks(positions, limits, valid, chunk: int, chunk_keys: int):
    """As `_window_chunks` for chunked local attention: a row's first visible key is the
    start of its first query's chunk of positions."""
    real = valid.any(axis=1)
    lo = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1)
    hi = jnp.max(jnp.where(valid, limits, 0), axis=1)
    first = jnp.where(real, lo // chunk * chunk // chunk_keys, 0).astype(jnp.int32)
    return first, jnp.max(hi // chunk_keys - first) + 1


def dense_causal_attention(q, k, v, scale: float, window: int | None = None, softcap: float | None = None,
                           sinks=None):
    """Reference: plain causal attention over contiguous K/V. q [T, H, hd], k/v [T, K, hd];
    sinks f32[H] (a softmax column per head that is dropped after the softmax, as HF's gpt-oss)."""
    t, num_heads, head_dim = q.shape
    groups = num_heads // k.shape[1]
    k = jnp.repeat(k, groups, axis=1)
    v = jnp.repeat(v, groups, axis=1)
    scores = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = jnp.tril(jnp.ones((t, t), bool))
    if window is not None:
        mask &= ~jnp.tril(jnp.ones((t, t), bool), -window)
    scores = jnp.where(mask[None], scores, _MASKED)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (num_heads, t, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), -1)[..., :t]
    else:
        probs = jax.nn.softmax(scores, -1)
    return jnp.einsum("hts,shd->thd", probs, v.astype(jnp.float32))


# -- shared by the one-query decode kernels (models/pallas_attention.py, models/gpu_attention.py)

def check_decode_inputs(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> None:
    """A decode kernel's inputs: one query per row, K and V caches of one shape."""
    if q.shape[1] != 1:
        raise ValueError(f"decode attention takes one query per row; got T={q.shape[1]}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must match; got {k_cache.shape} and {v_cache.shape}")


def shard_over_kv_heads(kernel, mesh, kv_sharded: bool):
    """`kernel(q [B, H, hd], k_pages, v_pages [K, N, bs, hd], a, b)` run per device under
    `mesh`: heads split over "model" when the KV cache is (`kv_sharded`), else replicated;
    the two trailing per-row arrays replicated. `kernel` itself when there is no mesh."""
    if mesh is None:
        return kernel
    heads = "model" if kv_sharded else None
    return jax.shard_map(kernel, mesh=mesh,
                         in_specs=(P(None, heads, None), P(heads, None, None, None), P(heads, None, None, None), P(),
                                   P()),
                         out_specs=P(None, heads, None), check_vma=False)
