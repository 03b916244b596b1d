"""Ragged paged attention as a Pallas TPU (Mosaic) kernel over our paged cache.

The contract, the span layout and the per-tile math are `models/ragged_attention.py`'s;
this module is how a tile of K/V reaches a TPU core. JAX ships a ragged paged-attention
kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), and this one follows
its structure (a grid over q tiles of the flat token axis, the spans a tile overlaps
walked inside it, the K/V blocks of a span fetched by DMA from HBM), but JAX's does not
fit as it is: it reads one combined `[pages, page_size, 2 * K, hd]` cache (K and V heads
interleaved) where ours keeps K and V apart in `[K, N, bs, hd]` (so the pure-JAX path,
the CPU kernel and the decode kernels read the same arrays), it knows no attention
sinks, and it does not lower off a TPU (its integer floor divisions ask the TPU for its
generation at lowering time, which `jax.export` from a CPU machine cannot answer).

    grid       (K kv heads, q tiles)                         one program: one KV head, one q tile
    q tile     [tq * G, hd]  VMEM block of q in the layout of `ragged_attention.to_kernel_layout`
    K/V        HBM (`pl.ANY`); per span, `tile_blocks` blocks a step are copied by DMA into
               a two-slot VMEM buffer [2, tile_blocks, bs, hd]: the next step's blocks are
               in flight while the current ones are used (double buffering)
    metadata   scalar prefetch (SMEM): per q tile its spans [first, end), per span
               q_start / q_len / kv_len, and the block tables (flattened)
    output     f32 [tq * G, hd] per program, zero where no span has the token

head_dim: the cache keeps the model's head_dim; tiles whose last dimension is not a
multiple of the 128 lanes are padded by Mosaic in VMEM (the blocks of K/V and q are the
full last dimension, which Mosaic accepts for any size). The tile's rows (tq * G) are a
multiple of 8 (a sublane tile), and the block size a multiple of 8 (16 for a 16-bit
cache) so that `tile_blocks` blocks fold into one [keys, hd] tile.

What is verified without a TPU: the kernel in Pallas's TPU interpret mode against the
dense reference (tests/models/test_ragged_attention.py), and its lowering to Mosaic through
`jax.export(platforms=("tpu",))` inside every compiled step (tools/device/export_steps.py). Mosaic's
own compile (layouts, VMEM and SMEM limits) runs only on a TPU: not yet run.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh

from models.ragged_attention import (RaggedAttention, RaggedLayout, attend_tile, initial_carry, kv_tile_range,
                                     load_tile, span_rows)

TPU_Q_TILE_TOKENS = 16  # tokens per q tile (x G query heads = the tile's rows)
TPU_KEYS_PER_TILE = 128  # keys per K/V step: fewer blocks than this per DMA are not worth a step
SUBLANES = 8  # rows of one f32 VMEM tile; a 16-bit one packs 16


def tpu_layout(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               q_tile_tokens: int = TPU_Q_TILE_TOKENS, keys_per_tile: int = TPU_KEYS_PER_TILE) -> RaggedLayout:
    """The TPU kernel's padding: G as it is, head_dim as it is (Mosaic pads lanes), and
    enough blocks per K/V step for `keys_per_tile` keys."""
    return RaggedLayout(q_tile_tokens=q_tile_tokens, group=num_heads // num_kv_heads, head_dim=head_dim,
                        tile_blocks=max(1, keys_per_tile // block_size))


def tpu_problems(block_size: int, kv_dtype, q_tile_tokens: int = TPU_Q_TILE_TOKENS) -> list[str]:
    """Unmet Mosaic tiling constraints of the kernel (empty when it can lower)."""
    problems = []
    tile_rows = SUBLANES * max(1, 4 // jnp.dtype(kv_dtype).itemsize)  # 8 (32-bit), 16 (16-bit), 32 (8-bit)
    if block_size % tile_rows:
        problems.append(f"block_size {block_size} is not a multiple of {tile_rows} "
                        f"(the rows of a {jnp.dtype(kv_dtype).name} VMEM tile)")
    if q_tile_tokens % SUBLANES:
        problems.append(f"q tile of {q_tile_tokens} tokens is not a multiple of {SUBLANES}")
    return problems


@dataclasses.dataclass(frozen=True)
class TpuRaggedAttention(RaggedAttention):
    """Ragged paged attention via the Pallas TPU kernel. Hashable: a static field of the model.

    Fields:
      q_tile_tokens: tokens per q tile.
      keys_per_tile: keys per K/V step (rounded down to whole blocks, at least one).
      mesh: run under shard_map on this mesh (None: single device).
      kv_sharded: KV heads split over the mesh's "model" axis (False: replicated).
      interpret: run in Pallas interpret mode (any backend; slow; tests): True for the
        discharge interpreter, or a `pltpu.InterpretParams` for the TPU simulator (DMAs,
        semaphores and VMEM simulated; out-of-bounds reads raise, unwritten VMEM is NaN).
    """

    q_tile_tokens: int = TPU_Q_TILE_TOKENS
    keys_per_tile: int = TPU_KEYS_PER_TILE
    mesh: Mesh | None = None
    kv_sharded: bool = False
    interpret: bool | pltpu.InterpretParams = False

    def layout(self, num_heads: int, num_kv: int, head_dim: int, block_size: int) -> RaggedLayout:
        return tpu_layout(num_heads, num_kv, head_dim, block_size, self.q_tile_tokens, self.keys_per_tile)

    def _call(self, q, k_cache, v_cache, *rest, layout: RaggedLayout, q_tiles: int, scale, window, softcap,
              has_sinks: bool):
        sinks, meta = (rest[0], rest[1:]) if has_sinks else (None, rest)
        num_kv, _, block_size, head_dim = k_cache.shape
        rows = layout.q_tile_tokens * layout.group
        width = meta[-1].shape[0] // meta[2].shape[0]  # the padded table width
        q_spec = pl.BlockSpec((None, rows, q.shape[-1]), lambda h, i, *_: (h, i, 0))
        in_specs = [q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
        inputs = [q, k_cache, v_cache]
        if has_sinks:
            in_specs.append(pl.BlockSpec((None, rows, 1), lambda h, i, *_: (h, 0, 0)))
            inputs.append(sinks)
        body = functools.partial(_kernel, layout=layout, table_width=width, scale=scale, window=window,
                                 softcap=softcap, has_sinks=has_sinks)
        buffer = pltpu.VMEM((2, layout.tile_blocks, block_size, head_dim), k_cache.dtype)
        call = pl.pallas_call(
            body,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(meta), grid=(num_kv, q_tiles), in_specs=in_specs,
                out_specs=pl.BlockSpec((None, rows, q.shape[-1]), lambda h, i, *_: (h, i, 0)),
                scratch_shapes=[buffer, buffer, pltpu.SemaphoreType.DMA((2, 2))]),
            out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            interpret=self.interpret,
            name="ferrox_ragged_paged_attention")
        return call(*meta, *inputs)


def _kernel(first_ref, end_ref, q_starts_ref, q_lens_ref, kv_lens_ref, tables_ref,  # scalar prefetch
            q_ref, k_hbm, v_hbm, *refs, layout: RaggedLayout, table_width: int, scale, window, softcap,
            has_sinks: bool):
    sinks_ref, (o_ref, k_buf, v_buf, sems) = (refs[0], refs[1:]) if has_sinks else (None, refs)
    head, tile = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    _, tile_blocks, block_size, _ = k_buf.shape
    tile_keys = tile_blocks * block_size
    tile_start = tile * layout.q_tile_tokens
    q = q_ref[...]
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    def copy(span, kv_tile, slot, block, which):
        """The DMA of one block of a span's kv_tile-th K/V step (which: 0 = K, 1 = V)."""
        block_id = tables_ref[span * table_width + kv_tile * tile_blocks + block]
        src, dst = (k_hbm, k_buf) if which == 0 else (v_hbm, v_buf)
        return pltpu.make_async_copy(src.at[head, block_id], dst.at[slot, block], sems.at[which, slot])

    def each_copy(span, kv_tile, slot, act):
        """`act` on every DMA of one step: a rolled loop (scalar work), not 2 x tile_blocks
        unrolled descriptors."""
        def body(block, _):
            for which in (0, 1):
                act(copy(span, kv_tile, slot, block, which))
            return 0

        jax.lax.fori_loop(0, tile_blocks, body, 0)

    def attend_span(span, _):
        masks = span_rows(tile_start, layout.q_tile_tokens, layout.group, q_starts_ref[span], q_lens_ref[span],
                          kv_lens_ref[span])
        lo, stop = kv_tile_range(masks, window, tile_keys)

        @pl.when(stop > lo)
        def _():
            each_copy(span, lo, 0, lambda c: c.start())

            def step(kv_tile, carry):
                slot = jax.lax.rem(kv_tile - lo, 2)

                @pl.when(kv_tile + 1 < stop)
                def _():
                    each_copy(span, kv_tile + 1, 1 - slot, lambda c: c.start())

                each_copy(span, kv_tile, slot, lambda c: c.wait())
                k = load_tile(k_buf[slot].reshape(tile_keys, head_dim), q.dtype)
                v = load_tile(v_buf[slot].reshape(tile_keys, head_dim), q.dtype)
                return attend_tile(carry, q, k, v, kv_tile * tile_keys, masks, scale=scale, window=window,
                                   softcap=softcap)

            init = initial_carry(rows, head_dim, sinks_ref[...] if has_sinks else None)
            _, l, acc = jax.lax.fori_loop(lo, stop, step, init)
            o_ref[...] = jnp.where(masks.row_in_span, acc / jnp.where(l == 0.0, 1.0, l), o_ref[...])

        return 0

    jax.lax.fori_loop(first_ref[tile], end_ref[tile], attend_span, 0)
