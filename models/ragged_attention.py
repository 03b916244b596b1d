"""Ragged paged attention: one attention call per layer for a whole unified step.

A step's new tokens are flat (`models/layers.py`: decode rows of one token, then prompt
chunks of several, padded to a compiled shape), and every token's K/V is already in the
paged cache (layout: `ferrox_jax/kv_cache.py`, `[K kv_heads, N num_blocks, bs, hd]`) when
attention runs. Ragged attention sees them as *spans*: a span is one row's run of new
tokens at consecutive positions, over that row's blocks,

    span s   queries  q[q_starts[s] : q_starts[s] + q_lens[s]]        (flat token indices)
             keys     positions 0 .. kv_lens[s] - 1 through block_tables[s]
             query j of the span sits at position kv_lens[s] - q_lens[s] + j

so a decode row is a span of 1, a prompt chunk (from position 0, mid-block, or after a
prefix-cache hit) a span of its valid tokens, and a speculating row's last token and its
k drafts, which the runner lays out as 1 + k one-token rows sharing a block table at
consecutive positions, one span of 1 + k (`ragged_spans` merges them: the row's keys are
then read once, not 1 + k times). Within a span attention is causal by position, with
an optional sliding window (key s visible to a query at p iff p - window < s <= p),
logit soft-cap (cap * tanh(score / cap), before masking) and attention sinks (one learned
logit per query head that joins the softmax's denominator with no value, as gpt-oss has).
Padding tokens belong to no span; their output is zero.

The kernels (`models/ragged_tpu.py`: Pallas TPU, Mosaic; `models/ragged_gpu.py`: Pallas
GPU, Triton) share this module's wrapper and the per-tile math (`attend_tile`), and differ
only in how a tile of K/V reaches them (DMA into VMEM on a TPU, a gather load on a GPU).
The wrapper lays q out KV-head-major so one program owns one KV head and its G query
heads: `[K, N * G, hd]`, row r of a q tile being token r // G, head r % G; G is padded up
(to a power of two on GPU), the token axis to a multiple of the q tile, and on GPU the
head_dim to a power of two (q with zeros, K/V by masked loads: the cache keeps the
model's head_dim). `ragged_reference` is the dense pure-JAX reference the tests compare
both with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.attention import KV_WORD_FLOATS

MASKED = -1e30  # as models/attention.py: finite, so a fully masked tile stays finite


class RaggedAttention:
    """What the ragged kernels are (the model's layers call one once per layer when its
    attention is one): `kernel(q [N, H, hd], k_cache, v_cache [K, NB, bs, hd], spans, *,
    scale, window=None, softcap=None, sinks=None) -> f32[N, H, hd]`.

    The call is the same for both kernels: lay the queries out in tiles, find each tile's
    K/V range, run the kernel (per device under shard_map) and undo the layout. A kernel
    gives its tile shape (`layout`) and its Pallas call (`_call`), and has the fields
    `mesh` and `kv_sharded`."""

    def layout(self, num_heads: int, num_kv: int, head_dim: int, block_size: int) -> "RaggedLayout":
        raise NotImplementedError

    def __call__(self, q, k_cache, v_cache, spans: "RaggedSpans", *, scale: float, window: int | None = None,
                 softcap: float | None = None, sinks=None):
        """q [N, H, hd]; k_cache, v_cache [K, NB, bs, hd]; sinks f32[H] or None -> f32[N, H, hd]."""
        n, num_heads, head_dim = q.shape
        num_kv, _, block_size, _ = k_cache.shape
        layout = self.layout(num_heads, num_kv, head_dim, block_size)
        q_tiles = layout.q_tiles(n)
        first, end, tables = tile_metadata(spans, q_tiles, layout)
        kernel = functools.partial(self._call, layout=layout, q_tiles=q_tiles, scale=scale, window=window,
                                   softcap=softcap, has_sinks=sinks is not None)
        args = [to_kernel_layout(q, num_kv, layout), k_cache, v_cache]
        if sinks is not None:
            args.append(sink_rows(sinks, num_kv, layout))
        args += [first, end, spans.q_starts, spans.q_lens, spans.kv_lens, tables.reshape(-1)]
        out = shard_ragged(kernel, self.mesh, self.kv_sharded, len(args), sinks is not None)(*args)
        return from_kernel_layout(out, n, num_heads, head_dim, layout)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedSpans:
    """One forward's spans (module docstring), S = the forward's rows (static).

    Spans are in flat-token order. Unused ones have q_lens 0: a padding row's at its own
    place, and the slots freed by merging a verification span at the end, starting at the
    end of the flat tokens; so q_starts + q_lens never decreases (the kernels find a q
    tile's spans by bisection).
    """

    q_starts: jax.Array  # i32[S] flat index of the span's first query
    q_lens: jax.Array  # i32[S] its queries (0: unused)
    kv_lens: jax.Array  # i32[S] its last query's position + 1
    block_tables: jax.Array  # i32[S, MB] the row's blocks in position order (0 = null block)


def ragged_spans(segments) -> RaggedSpans:
    """The spans of a forward's `models.layers.Segment`s (rows in flat-token order).

    Each row's valid tokens are a prefix of the row at consecutive positions (the runner
    pads at the end). One-token rows that continue the previous row (same block table,
    the next position) join its span: a speculating row's 1 + k verification tokens.
    """
    starts, q_lens, kv_lens, tables, mergeable = [], [], [], [], []
    for seg in segments:
        starts.append(seg.start + seg.tokens * jnp.arange(seg.rows, dtype=jnp.int32))
        q_len = seg.valid.sum(axis=1).astype(jnp.int32)
        last = jnp.max(jnp.where(seg.valid, seg.positions, -1), axis=1)
        q_lens.append(q_len)
        kv_lens.append(jnp.where(q_len > 0, last + 1, 0).astype(jnp.int32))
        tables.append(seg.block_tables.astype(jnp.int32))
        mergeable.append(jnp.full((seg.rows,), seg.tokens == 1))
    q_starts, q_len, kv_len = (jnp.concatenate(x) for x in (starts, q_lens, kv_lens))
    table, one_token = jnp.concatenate(tables), jnp.concatenate(mergeable)
    rows = q_starts.shape[0]
    prev = jnp.maximum(jnp.arange(rows) - 1, 0)
    continues = (one_token & one_token[prev] & (q_len == 1) & (q_len[prev] == 1)
                 & (kv_len == kv_len[prev] + 1) & (table == table[prev]).all(axis=1)
                 & (jnp.arange(rows) > 0))
    span_of_row = jnp.cumsum(~continues) - 1  # each row's span; a head row opens one
    heads = jnp.where(continues, rows, span_of_row)  # continuation rows write nowhere
    # Spans no row opens (after the last one) start at the end of the flat tokens.
    span_start = jnp.full((rows,), _flat_tokens(segments), jnp.int32).at[heads].set(q_starts, mode="drop")
    return RaggedSpans(
        q_starts=span_start,
        q_lens=jax.ops.segment_sum(q_len, span_of_row, num_segments=rows).astype(jnp.int32),
        kv_lens=jax.ops.segment_max(kv_len, span_of_row, num_segments=rows).clip(0).astype(jnp.int32),
        block_tables=jnp.zeros_like(table).at[heads].set(table, mode="drop"))


def _flat_tokens(segments) -> int:
    last = segments[-1]
    return last.start + last.rows * last.tokens


def load_tile(tile: jax.Array, dtype) -> jax.Array:
    """A K or V tile as the kernel computes with it: a CPU cache's 16-bit words bitcast to
    their float, then the compute dtype (as `models.attention.load_kv`)."""
    word_float = KV_WORD_FLOATS.get(jnp.dtype(tile.dtype))
    if word_float is not None:
        tile = jax.lax.bitcast_convert_type(tile, word_float)
    return tile.astype(dtype)


@dataclasses.dataclass(frozen=True)
class TileMasks:
    """Where one span's rows of a q tile stand (built inside a kernel, per span)."""

    row_in_span: jax.Array  # bool[rows, 1]
    row_pos: jax.Array  # i32[rows, 1] the query position of each row
    kv_len: jax.Array  # i32[] the span's last position + 1: keys from there on are not its
    first_pos: jax.Array  # i32[] position of the span's first query in this tile
    last_pos: jax.Array  # i32[] ... and of its last


def span_rows(tile_start, tile_tokens: int, group: int, q_start, q_len, kv_len) -> TileMasks:
    """Row r of a q tile starting at flat token `tile_start` is token tile_start + r // group."""
    rows = tile_tokens * group
    token = tile_start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), jnp.int32(group))
    first_query = kv_len - q_len - q_start  # position = first_query + flat token index
    return TileMasks(row_in_span=(token >= q_start) & (token < q_start + q_len), row_pos=first_query + token,
                     kv_len=kv_len, first_pos=first_query + jnp.maximum(tile_start, q_start),
                     last_pos=first_query + jnp.minimum(tile_start + tile_tokens, q_start + q_len) - 1)


def attend_tile(carry, q, k, v, key_start, masks: TileMasks, *, scale: float, window: int | None,
                softcap: float | None):
    """One online-softmax step of a q tile over one K/V tile; returns the new (m, l, acc).

    q f32|bf16[rows, hd], k/v [keys, hd] in q's dtype, key_start the first key's
    position; carry (m f32[rows, 1], l f32[rows, 1], acc f32[rows, hd]).
    """
    m, l, acc = carry
    # float32 inputs multiply as float32 (Triton would take TF32, Mosaic bf16 passes, by default)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    key_pos = key_start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    visible = (key_pos <= masks.row_pos) & masks.row_in_span
    if window is not None:
        visible &= key_pos > masks.row_pos - window
    s = jnp.where(visible, s, MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    # A row may see nothing in this tile (its window starts later, or it is outside the
    # span): exp(MASKED - MASKED) = 1 there, so zero those explicitly.
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
    correction = jnp.exp(m - m_new)
    l = l * correction + jnp.sum(p, axis=1, keepdims=True)
    # Keys past the span's end may hold anything (another row's tokens, a NaN): zero them
    # so that 0 * value cannot poison the sum.
    key_real = jax.lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0) + key_start < masks.kv_len
    v = jnp.where(key_real, v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    return m_new, l, acc * correction + pv


def initial_carry(rows: int, head_dim: int, sinks):
    """(m, l, acc) before any key: a sink is a key of logit `sinks` [rows, 1] and no value."""
    if sinks is None:
        return (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                jnp.zeros((rows, head_dim), jnp.float32))
    return sinks.astype(jnp.float32), jnp.ones((rows, 1), jnp.float32), jnp.zeros((rows, head_dim), jnp.float32)


def kv_tile_range(masks: TileMasks, window: int | None, tile_keys: int):
    """[first, stop) K/V tiles a span's rows in one q tile need: up to the tile holding its
    furthest query, from the one holding its first query's first visible key."""
    stop = jax.lax.div(masks.last_pos + tile_keys, jnp.int32(tile_keys))
    if window is None:
        return jnp.int32(0), stop
    return jax.lax.div(jnp.maximum(masks.first_pos - window + 1, 0), jnp.int32(tile_keys)), stop


@dataclasses.dataclass(frozen=True)
class RaggedLayout:
    """How the wrapper pads a forward for a kernel (static; module docstring)."""

    q_tile_tokens: int  # tokens per q tile
    group: int  # query heads per KV head, padded
    head_dim: int  # the kernel's head_dim, padded
    tile_blocks: int  # KV blocks per K/V tile

    def q_tiles(self, num_tokens: int) -> int:
        return -(-num_tokens // self.q_tile_tokens)


def to_kernel_layout(q, num_kv: int, layout: RaggedLayout):
    """q [N, H, hd] -> [K, Nq * Gp, hdp] (Nq = N padded to whole q tiles)."""
    n, num_heads, head_dim = q.shape
    group = num_heads // num_kv
    nq = layout.q_tiles(n) * layout.q_tile_tokens
    q = q.reshape(n, num_kv, group, head_dim).transpose(1, 0, 2, 3)
    q = jnp.pad(q, ((0, 0), (0, nq - n), (0, layout.group - group), (0, layout.head_dim - head_dim)))
    return q.reshape(num_kv, nq * layout.group, layout.head_dim)


def from_kernel_layout(out, n: int, num_heads: int, head_dim: int, layout: RaggedLayout):
    """The inverse of `to_kernel_layout` for the f32 output: -> f32[N, H, hd]."""
    num_kv = out.shape[0]
    out = out.reshape(num_kv, -1, layout.group, layout.head_dim)[:, :n, :num_heads // num_kv, :head_dim]
    return out.transpose(1, 0, 2, 3).reshape(n, num_heads, head_dim)


def tile_metadata(spans: RaggedSpans, num_q_tiles: int, layout: RaggedLayout):
    """Per q tile the spans it overlaps, [first, end) (i32[T] each), and the block tables
    padded to whole K/V tiles (the pad is the null block, masked by position)."""
    tile_start = jnp.arange(num_q_tiles, dtype=jnp.int32) * layout.q_tile_tokens
    ends = spans.q_starts + spans.q_lens
    first = jnp.searchsorted(ends, tile_start, side="right").astype(jnp.int32)
    end = jnp.searchsorted(spans.q_starts, tile_start + layout.q_tile_tokens, side="left").astype(jnp.int32)
    width = spans.block_tables.shape[1]
    tables = jnp.pad(spans.block_tables, ((0, 0), (0, -width % layout.tile_blocks)))
    return first, jnp.maximum(end, first), tables


def sink_rows(sinks, num_kv: int, layout: RaggedLayout):
    """f32[H] per-head sink logits -> f32[K, q_tile_tokens * Gp, 1] (the same for every tile)."""
    per_kv = sinks.astype(jnp.float32).reshape(num_kv, -1)
    per_kv = jnp.pad(per_kv, ((0, 0), (0, layout.group - per_kv.shape[1])), constant_values=MASKED)
    return jnp.tile(per_kv, (1, layout.q_tile_tokens))[..., None]


def shard_ragged(kernel, mesh: Mesh | None, kv_sharded: bool, num_inputs: int, has_sinks: bool):
    """`kernel(q, k_cache, v_cache, [sinks,] *metadata)` per device under `mesh`: q, the
    caches and the sinks (all KV-head-major) split over "model" when the cache is, the
    metadata replicated."""
    if mesh is None:
        return kernel
    heads = "model" if kv_sharded else None
    specs = (P(heads, None, None), P(heads, None, None, None), P(heads, None, None, None))
    specs += (P(heads, None, None),) * has_sinks
    specs += (P(),) * (num_inputs - len(specs))
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=P(heads, None, None), check_vma=False)


def ragged_reference(q, k_cache, v_cache, spans: RaggedSpans, *, scale: float, window: int | None = None,
                     softcap: float | None = None, sinks=None):
    """Dense pure-JAX ragged attention (tests): every token against its span's whole table.

    q [N, H, hd]; k_cache, v_cache [K, NB, bs, hd]; sinks f32[H] or None. -> f32[N, H, hd].
    """
    n, num_heads, head_dim = q.shape
    num_kv, _, block_size, _ = k_cache.shape
    token = jnp.arange(n, dtype=jnp.int32)
    in_span = (token[:, None] >= spans.q_starts) & (token[:, None] < spans.q_starts + spans.q_lens)  # [N, S]
    span = jnp.argmax(in_span, axis=1)
    real = in_span.any(axis=1)
    pos = spans.kv_lens[span] - spans.q_lens[span] + token - spans.q_starts[span]
    tables = spans.block_tables[span]  # [N, MB]

    def dense(cache):  # -> [N, MB * bs, K, hd]
        rows = load_tile(cache[:, tables], q.dtype)  # [K, N, MB, bs, hd]
        return rows.transpose(1, 2, 3, 0, 4).reshape(n, -1, num_kv, head_dim)

    keys, values = dense(k_cache), dense(v_cache)
    group = num_heads // num_kv
    qg = q.reshape(n, num_kv, group, head_dim)
    s = jnp.einsum("nkgd,nskd->nkgs", qg, keys, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
    visible = (key_pos[None] <= pos[:, None]) & real[:, None]
    if window is not None:
        visible &= key_pos[None] > pos[:, None] - window
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv, group, 1), (n, num_kv, group, 1))
        s = jnp.concatenate([s, sink], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(real[:, None, None, None], p, 0.0)[..., :keys.shape[1]]
    out = jnp.einsum("nkgs,nskd->nkgd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.reshape(n, num_heads, head_dim)
