"""Ragged paged attention as a Pallas GPU (Triton) kernel over our paged cache.

The contract, the span layout and the per-tile math are `models/ragged_attention.py`'s;
this module is how a tile of K/V reaches a GPU program. JAX ships no ragged kernel for
GPUs; its Pallas GPU `paged_attention` (the "pallas-gpu" decode candidate of
`models/gpu_attention.py`) takes one query per row. This kernel keeps that one's way of
reading the cache (a gather of `tile_blocks` blocks through the block table, in place)
and adds what the unified step needs: spans of any length, causal within a span, sliding
windows, soft-capping and sinks.

    grid      (K kv heads, q tiles)                      one program: one KV head, one q tile
    q tile    [tq * Gp, hdp]  (Gp = G padded to a power of two, hdp = head_dim padded to
              one, >= 16: Triton's tiles are powers of two), tq chosen so a tile has
              GPU_TILE_ROWS rows
    K/V       `tile_blocks` blocks per step (GPU_KEYS_PER_TILE keys), gathered through the
              span's block table; a head_dim that is not a power of two is read with a
              lane mask (the cache keeps the model's head_dim)
    output    f32 [tq * Gp, hdp] per program, zero where no span has the token

Verified without a GPU: the kernel in Pallas interpret mode against the dense reference
(tests/models/test_ragged_attention.py), and its lowering to Triton through
`jax.export(platforms=("cuda",))` in every compiled step (tools/device/export_steps.py). Triton's
compile to PTX and every timing need a GPU (`tools/device/device_check.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import Mesh

from models.ragged_attention import (RaggedAttention, RaggedLayout, attend_tile, initial_carry, kv_tile_range,
                                     load_tile, span_rows)

GPU_TILE_ROWS = 64  # rows (tokens x query heads) of one program's q tile
GPU_KEYS_PER_TILE = 64  # keys per K/V step
GPU_MIN_TILE = 16  # Triton's dot needs every dimension >= 16


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def gpu_layout(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               keys_per_tile: int = GPU_KEYS_PER_TILE) -> RaggedLayout:
    """The GPU kernel's padding (module docstring)."""
    group = _next_power_of_two(num_heads // num_kv_heads)
    return RaggedLayout(q_tile_tokens=max(1, GPU_TILE_ROWS // group), group=group,
                        head_dim=max(GPU_MIN_TILE, _next_power_of_two(head_dim)),
                        tile_blocks=max(1, keys_per_tile // block_size))


def gpu_problems(block_size: int) -> list[str]:
    """Unmet Triton constraints of the kernel (empty when it can lower)."""
    keys = max(1, GPU_KEYS_PER_TILE // block_size) * block_size
    if block_size & (block_size - 1) or keys < GPU_MIN_TILE:
        return [f"block_size {block_size} is not a power of two making a K/V tile of >= {GPU_MIN_TILE} keys"]
    return []


@dataclasses.dataclass(frozen=True)
class GpuRaggedAttention(RaggedAttention):
    """Ragged paged attention via the Pallas GPU (Triton) kernel. Hashable: a static field.

    Fields:
      keys_per_tile: keys per K/V step (whole blocks, a power of two).
      mesh: run under shard_map on this mesh (None: single device).
      kv_sharded: KV heads split over the mesh's "model" axis (False: replicated).
      interpret: run in Pallas interpret mode (any backend; slow; tests).
    """

    keys_per_tile: int = GPU_KEYS_PER_TILE
    mesh: Mesh | None = None
    kv_sharded: bool = False
    interpret: bool = False

    def layout(self, num_heads: int, num_kv: int, head_dim: int, block_size: int) -> RaggedLayout:
        return gpu_layout(num_heads, num_kv, head_dim, block_size, self.keys_per_tile)

    def _call(self, q, k_cache, v_cache, *rest, layout: RaggedLayout, q_tiles: int, scale, window, softcap,
              has_sinks: bool):
        num_kv, num_blocks, block_size, head_dim = k_cache.shape
        rows = layout.q_tile_tokens * layout.group
        width = rest[-1].shape[0] // rest[-4].shape[0]  # the padded table width
        tile = pl.BlockSpec((None, rows, layout.head_dim), lambda h, i: (h, i, 0))
        cache = pl.BlockSpec((None, num_blocks, block_size, head_dim), lambda h, i: (h, 0, 0, 0))
        in_specs = [tile, cache, cache]
        if has_sinks:
            in_specs.append(pl.BlockSpec((None, rows, 1), lambda h, i: (h, 0, 0)))
        in_specs += [pl.BlockSpec(a.shape, lambda h, i: (0,)) for a in rest[-6:]]
        body = functools.partial(_kernel, layout=layout, table_width=width, scale=scale, window=window,
                                 softcap=softcap, has_sinks=has_sinks)
        call = pl.pallas_call(
            body, grid=(num_kv, q_tiles), in_specs=in_specs, out_specs=tile,
            out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            interpret=self.interpret, name="ferrox_ragged_paged_attention")
        return call(q, k_cache, v_cache, *rest)


def _kernel(q_ref, k_ref, v_ref, *refs, layout: RaggedLayout, table_width: int, scale, window, softcap,
            has_sinks: bool):
    if has_sinks:
        sinks_ref, refs = refs[0], refs[1:]
    first_ref, end_ref, q_starts_ref, q_lens_ref, kv_lens_ref, tables_ref, o_ref = refs
    tile = pl.program_id(1)
    rows, head_dim = q_ref.shape
    block_size, cache_head_dim = k_ref.shape[-2:]
    tile_blocks = layout.tile_blocks
    tile_keys = tile_blocks * block_size
    tile_start = tile * layout.q_tile_tokens
    q = q_ref[...]
    shape = (tile_blocks, block_size, head_dim)
    offsets = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    lanes = jax.lax.broadcasted_iota(jnp.int32, shape, 2)

    def load(ref, blocks):
        """[tile_keys, hdp]: the blocks' keys (or values), zero past the cache's head_dim
        (those lanes are read from the last real one, then masked)."""
        if head_dim == cache_head_dim:
            tile = ref[blocks]
        else:
            index = (jnp.broadcast_to(blocks[:, None, None], shape), offsets, jnp.minimum(lanes, cache_head_dim - 1))
            tile = plgpu.load(ref.at[index], mask=lanes < cache_head_dim, other=0)
        return load_tile(tile.reshape(tile_keys, head_dim), q.dtype)

    def attend_span(span, out):
        masks = span_rows(tile_start, layout.q_tile_tokens, layout.group, q_starts_ref[span], q_lens_ref[span],
                          kv_lens_ref[span])
        lo, stop = kv_tile_range(masks, window, tile_keys)

        def step(kv_tile, carry):
            blocks = tables_ref[pl.ds(span * table_width + kv_tile * tile_blocks, tile_blocks)]
            return attend_tile(carry, q, load(k_ref, blocks), load(v_ref, blocks), kv_tile * tile_keys, masks,
                               scale=scale, window=window, softcap=softcap)

        init = initial_carry(rows, head_dim, sinks_ref[...] if has_sinks else None)
        _, l, acc = jax.lax.fori_loop(lo, stop, step, init)
        return jnp.where(masks.row_in_span, acc / jnp.where(l == 0.0, 1.0, l), out)

    o_ref[...] = jax.lax.fori_loop(first_ref[tile], end_ref[tile], attend_span, jnp.zeros((rows, head_dim),
                                                                                            jnp.float32))
