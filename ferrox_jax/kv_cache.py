"""The paged KV cache: THE layout, described once here and referred to elsewhere.

Per layer, K and V are each one array

    k[layer]: dtype[K kv_heads, N num_blocks, bs block_size, hd head_dim]

a block holding `block_size` consecutive token positions of one row for every KV
head. The layout is the one JAX's Pallas TPU paged-attention kernel reads
(`[num_kv_heads, total_num_pages, page_size, head_dim]`), and its first axis is the one
tensor parallelism shards. A row's *block table* lists its block ids in position
order; position p sits in `block_table[p // bs]` at offset `p % bs`.

A latent-attention family (DeepSeek-V3, `models/mla.py`) uses the same layout with its own
geometry (`ModelConfig.kv_cache_dims`): K is ONE head of width kv_lora_rank +
qk_rope_head_dim (the normed latent, then the rotated shared RoPE key) and V is a
zero-width array `[1, N, bs, 0]`, so every verb on the cache (block copies, sleep, the
shardings) stays as it is, and the byte accounting (`model_bytes_per_block`: the block
budget, `/admin/stats`, the memory bounds) counts the latent's real size.

The arrays follow the model's `kv_layout()` (models/config.py): one K/V pair per layer
with the config's kv heads and head size, unless a family's layers differ in head size
(each pair then has its own) or some layers read an earlier layer's pair instead of
keeping their own (Gemma 4's shared-KV layers: no array is allocated or written for them,
and the bytes per block count only the arrays that exist).

KV groups (`ferrox_jax/kv_groups.py`): a model whose sliding-window layers keep a pool of
their own has those layers' arrays sized to that pool (`window_blocks`, its null slot 0
included) instead of `num_blocks`; they are indexed by slot, not by block id, through the
window tables the step carries. `windowed` (one flag per array, static) says which. When
every array is windowed (every layer slides) no array holds `num_blocks`: the block ids
are logical, and `KVCache.num_blocks` is the pool's size.

Block 0 is the null block: padded tokens write into it and padded block-table entries
point at it, so padding never touches a live request's K/V. The block budget never
hands it out; `num_blocks` counts it, so `num_blocks - 1` blocks are usable.

The cache is created on device by a jitted zeros constructor (no host copy), and is the
only argument the step functions donate.

Storage dtype (`storage_dtype`): the cache's dtype, except a 16-bit float cache on the
CPU backend, which holds the same 16 bits as integers: bfloat16 as uint16, float16 as
int16 (the integer type says which words they are, to `load_kv` and to the CPU attention
kernel). XLA CPU computes bfloat16 scatters in float32 over the whole operand (its float
normalization), so writing one token's K/V copied and converted every layer's whole array
each step: a 32-row decode step of the default model went from 0.15 s to 0.6 s. An integer
scatter is done in place; the attention bitcasts the words back to their float type on
write and on the gathered blocks only (`models/attention.py:store_kv` / `load_kv`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import KV_WORD_FLOATS

NULL_BLOCK = 0
# a CPU 16-bit float cache's storage dtype, by its float (the inverse of KV_WORD_FLOATS)
_WORDS_OF = {jnp.dtype(f): words for words, f in KV_WORD_FLOATS.items()}


def storage_dtype(dtype):
    """The dtype the cache arrays hold for a KV cache of `dtype` (module docstring)."""
    if jax.default_backend() == "cpu":
        return _WORDS_OF.get(jnp.dtype(dtype), dtype)
    return dtype


@struct.dataclass
class KVCache:
    """Per-layer K and V block arrays (layout above), and beside them the recurrent layers'
    per-row state slots of a model that has some (`ferrox_jax/state_pool.py`; None otherwise:
    they ride in the cache so every verb that carries the cache carries them too)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    states: Any = None

    @property
    def num_blocks(self) -> int:
        """Blocks of the full-attention arrays (the largest: a sliding pool holds fewer; the
        pool's slots when every array holds it)."""
        return max(a.shape[1] for a in self.k)

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)


def kv_cache_shape(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks, block_size, head_dim)


def create_kv_cache(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
                    head_dim: int, dtype, sharding=None, v_head_dim: int | None = None) -> KVCache:
    """Allocate the zeroed cache directly on device (optionally with a sharding per array),
    in the storage dtype for `dtype`. `v_head_dim`: the V arrays' width when it is not
    head_dim (0 for a latent cache)."""
    v_dim = head_dim if v_head_dim is None else v_head_dim
    return create_layout_kv_cache(((num_kv_heads, head_dim, v_dim),) * num_layers, num_blocks, block_size, dtype,
                                  sharding)


def create_layout_kv_cache(layout, num_blocks: int, block_size: int, dtype, sharding=None,
                           array_blocks=None) -> KVCache:
    """The zeroed cache of a `kv_layout()`: one K and one V array per (kv heads, K width, V width),
    one compiled constructor per distinct shape. `array_blocks`: each array's blocks when
    they differ (a sliding-window pool's arrays); None: `num_blocks` each."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved); got {num_blocks}")
    array_blocks = tuple(array_blocks) if array_blocks is not None else (num_blocks,) * len(layout)

    @functools.partial(jax.jit, static_argnums=(0,), out_shardings=sharding)
    def zeros(shape):
        return jnp.zeros(shape, storage_dtype(dtype))

    k = tuple(zeros(kv_cache_shape(heads, n, block_size, k_dim)) for (heads, k_dim, _), n in zip(layout, array_blocks))
    v = tuple(zeros(kv_cache_shape(heads, n, block_size, v_dim)) for (heads, _, v_dim), n in zip(layout, array_blocks))
    return KVCache(k=k, v=v)


def create_model_kv_cache(cfg, num_blocks: int, block_size: int, dtype, sharding=None,
                          windowed: tuple[bool, ...] = (), window_blocks: int = 0) -> KVCache:
    """The cache of a model config, in its geometry (`ModelConfig.kv_layout`); the arrays
    `windowed` flags hold `window_blocks` blocks (the sliding group's pool)."""
    layout = cfg.kv_layout()
    blocks = [window_blocks if windowed and windowed[i] else num_blocks for i in range(len(layout))]
    return create_layout_kv_cache(layout, num_blocks, block_size, dtype, sharding, blocks)


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype,
                    v_head_dim: int | None = None) -> int:
    """K+V bytes one block takes across all layers (`v_head_dim` as in create_kv_cache)."""
    v_dim = head_dim if v_head_dim is None else v_head_dim
    return num_layers * num_kv_heads * block_size * (head_dim + v_dim) * jnp.dtype(dtype).itemsize


def model_bytes_per_block(cfg, block_size: int, dtype) -> int:
    """K+V bytes one block of a model config's cache takes across all its arrays."""
    return layout_bytes_per_block(cfg.kv_layout(), block_size, dtype)


def layout_bytes_per_block(layout, block_size: int, dtype) -> int:
    """K+V bytes one block takes across every array of a `kv_layout()`."""
    return sum(heads * block_size * (k_dim + v_dim) for heads, k_dim, v_dim in layout) * jnp.dtype(dtype).itemsize


@functools.partial(jax.jit, donate_argnames=("kv_cache",), static_argnames=("windowed",))
def copy_blocks(kv_cache: KVCache, src: jax.Array, dst: jax.Array, window_src: jax.Array | None = None,
                window_dst: jax.Array | None = None, state_src: jax.Array | None = None,
                state_dst: jax.Array | None = None, windowed: tuple[bool, ...] = ()) -> KVCache:
    """Copy whole blocks src[i] -> dst[i] in every layer (i32[P] each; pad with 0 -> 0); the
    arrays `windowed` flags copy slots window_src[i] -> window_dst[i] instead; a model with
    recurrent layers copies state slots state_src[i] -> state_dst[i] too (`copy_state_slots`)."""
    def pairs(i):
        return (window_src, window_dst) if windowed and windowed[i] else (src, dst)

    states = kv_cache.states
    if states is not None and state_src is not None:
        states = copy_state_slots(states, state_src, state_dst)
    return kv_cache.replace(
        k=tuple(a.at[:, pairs(i)[1]].set(a[:, pairs(i)[0]]) for i, a in enumerate(kv_cache.k)),
        v=tuple(a.at[:, pairs(i)[1]].set(a[:, pairs(i)[0]]) for i, a in enumerate(kv_cache.v)),
        states=states,
    )


def copy_state_slots(states, src: jax.Array, dst: jax.Array):
    """Recurrent state slots src[i] -> dst[i] (conv and recurrent arrays of every layer, every
    entry of the slot and, with speculation, its position: `models/deltanet.py`,
    "Speculation"), one pair after another: a pair may read a slot an earlier pair wrote (a
    snapshot saved, then restored; a hit restored, then forked), so they are not one scatter.
    Pad with 0 -> 0 at the end: the padding is not copied (a slot is every DeltaNet layer's
    state, 50 MiB at Qwen3.5's default size, and a step's copies are padded to a fixed batch:
    docs/benchmarks.md, "Recurrent-state snapshot copies")."""
    slots, entries = states.num_slots, states.entries  # entry j of slot s is row s + j * slots

    def rows(a, s, d):
        for j in range(entries):
            a = a.at[d + j * slots].set(a[s + j * slots])
        return a

    def one(i, st):
        s, d = src[i], dst[i]
        positions = None if st.positions is None else st.positions.at[d].set(st.positions[s])
        return st.replace(conv=tuple(rows(a, s, d) for a in st.conv),
                          recurrent=tuple(rows(a, s, d) for a in st.recurrent), positions=positions)

    # The padding trails the pairs, and no real pair copies a slot onto itself: the loop
    # stops at the first 0 -> 0 (a traced bound, so no new shape; a `cond` per pair instead
    # would copy the whole pool on XLA CPU).
    count = jnp.argmin(jnp.append(src != dst, False))
    return jax.lax.fori_loop(0, count, one, states)


@jax.jit
def gather_blocks(kv_cache: KVCache, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Whole blocks `ids` (i32[B]) of every layer, for the host tier (`ferrox_jax/kv_offload.py`):
    (k, v), each [layers, kv_heads, B, block_size, head_dim]."""
    return jnp.stack([a[:, ids] for a in kv_cache.k]), jnp.stack([a[:, ids] for a in kv_cache.v])


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def scatter_blocks(kv_cache: KVCache, ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Writes whole blocks back (the inverse of `gather_blocks`; pad `ids` with the null block 0)."""
    return kv_cache.replace(k=tuple(a.at[:, ids].set(k[i]) for i, a in enumerate(kv_cache.k)),
                            v=tuple(a.at[:, ids].set(v[i]) for i, a in enumerate(kv_cache.v)))


def _state_rows(states, ids: jax.Array) -> jax.Array:
    """Pool rows of slots `ids`, entry by entry: i32[B, E] (entry j of slot s is row s + j * S)."""
    return ids[:, None] + jnp.arange(states.entries, dtype=ids.dtype)[None, :] * states.num_slots


@jax.jit
def gather_states(kv_cache: KVCache, ids: jax.Array):
    """Whole state slots `ids` (i32[B]), for the host tier's snapshots (`ferrox_jax/kv_offload.py`):
    (conv, recurrent, positions): per DeltaNet layer f32[B, E, ...], and i32[B] (zeros with E = 1)."""
    states = kv_cache.states
    rows = _state_rows(states, ids)
    positions = jnp.zeros(ids.shape, jnp.int32) if states.positions is None else states.positions[ids]
    return tuple(a[rows] for a in states.conv), tuple(a[rows] for a in states.recurrent), positions


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def scatter_states(kv_cache: KVCache, ids: jax.Array, conv, recurrent, positions: jax.Array) -> KVCache:
    """Writes whole state slots back (the inverse of `gather_states`; pad `ids` with the null slot 0)."""
    states = kv_cache.states
    rows = _state_rows(states, ids)
    return kv_cache.replace(states=states.replace(
        conv=tuple(a.at[rows].set(c) for a, c in zip(states.conv, conv)),
        recurrent=tuple(a.at[rows].set(r) for a, r in zip(states.recurrent, recurrent)),
        positions=None if states.positions is None else states.positions.at[ids].set(positions)))
