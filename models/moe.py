"""Mixture of experts: top-k softmax routing and experts computed only for their tokens.

`MoeConfig` adds the expert fields to `ModelConfig`; `moe_mlp` is the block Mixtral and
Qwen3-MoE layers call in place of a dense MLP:

    probs   = softmax(x @ router)                      f32[N, E]
    w, e    = top_k(probs, k)                          f32[N, k], i32[N, k]
    w       = w / sum(w)        (norm_topk_prob; Mixtral always)
    y[n]    = sum_j w[n, j] * expert_{e[n, j]}(x[n])   expert: down(silu(gate(x)) * up(x))

Options a family may add (defaults keep the block above): a router bias, per-expert
biases on gate/up/down (`ExpertBiases`), another gating of the two projections
(`glu`: gpt-oss's clamped SwiGLU) and routing chosen by the caller (`routing`: Gemma 4
routes on another input than its experts read, and scales each expert's weight).

How the experts run (measured, `tools/bench/bench_moe.py`): the N*k (token, expert) pairs are
sorted by expert, each expert's run is padded to whole tiles of `tile` rows, and a
`fori_loop` with a traced trip count runs one tile per iteration against that tile's
expert's weights, over the tiles in use only. Shapes depend only on N (fixed per step
bucket: nothing recompiles) while the work follows the routing: a decode step reads the
weights of the experts its rows chose, not all of them.

On this 2-core CPU, shared and loaded (float32, ms per MoE block, min of 5 runs;
`python -m tools.bench.bench_moe`), a Mixtral-like layer (D=1024, F=3584, E=8, top-2) and a
Qwen3-MoE-like one (D=1024, F=384, E=64, top-8), at 1..32 decode rows and a 128-token
prefill:

                          Mixtral-like               Qwen3-MoE-like
    tokens               1     8     32    128      1     8     32    128
    all experts (dense) 759   717   785   1472     643   684   920   2038
    gather per pair     157  1410  5280     -       80   711  2667  14911
    ragged_dot          802   848   619   2300     852  1121  2842   6467
    tiles of 8          152   440   457   1600     6.3    29   180    416
    tiles of 32         197   552   732    987      14   254   124    321
    tiles (tile_rows)   152   313   507    997     5.9    30   102    307

`jax.lax.ragged_dot` lowers on XLA CPU to a masked dense product over every group (each
row times every expert), so it is the slowest here; on TPU/GPU it is a grouped matmul
and worth measuring again there. Gathering each pair's expert weights reads an expert
once per pair (64 reads for 32 rows of top-2 among 8 experts). Tiles win or tie at every
shape, by 2-100x over the others with many small experts; the tile size grows with the
rows per expert (`tile_rows`): 8 at decode, 32 for a 128-token Mixtral prefill.

Tensor parallelism splits every expert over its intermediate axis (gate/up by columns,
down by rows; `ferrox_jax/sharding.py`), so each tile's matmuls are local to a device and
its down projection is summed across devices inside the loop: one all-reduce of
[tile, D] per tile in use (checked in the compiled HLO). Expert parallelism
(`models/moe_ep.py`, `--expert-parallel`) splits the stacks by expert instead: each device
runs `expert_sum` over its own experts' pairs under shard_map and the layer sums once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.family import ExpertStack
from models.layers import project
from models.quant import select_expert


# llama.cpp's per-layer expert tensors (Mixtral and Qwen3-MoE files alike): the router
# [E, D] in the reader's order (transposed like any projection) and the stacks [E, out, in].
GGUF_EXPERT_WEIGHTS = {
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": ExpertStack(("experts_gate",), transpose=True),
    "ffn_up_exps.weight": ExpertStack(("experts_up",), transpose=True),
    "ffn_down_exps.weight": ExpertStack(("experts_down",), transpose=True),
}


@dataclasses.dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """ModelConfig plus the experts. `intermediate_size` stays the dense MLP's width (the
    layers listed in `dense_layers`); experts are `moe_intermediate_size` wide."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MoeConfig.{name} must be > 0; got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoeConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"num_experts ({self.num_experts})")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def sharded_sizes(self) -> dict[str, int]:
        sizes = super().sharded_sizes()
        sizes["moe_intermediate_size"] = self.moe_intermediate_size
        if len(self.dense_layers) == 0:
            del sizes["intermediate_size"]  # no dense MLP anywhere
        return sizes


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool,
          router_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing. x [N, D], router [D, E], router_bias [E] or None ->
    (weights f32[N, k], experts i32[N, k]).

    Normalised, this is also gpt-oss's "softmax over the top-k logits": softmax is monotonic,
    so the top-k probabilities are those of the top-k logits, and renormalising them is
    exactly the softmax over the selected logits."""
    probs = jax.nn.softmax(project(x, router, router_bias).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: the expected rows per expert rounded up to a power of two, in [8, 64]."""
    per_expert = max(1, -(-num_pairs // num_experts))
    return min(64, max(8, 1 << (per_expert - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class ExpertBiases:
    """Per-expert biases of the three expert projections (gpt-oss): gate, up f32[E, F], down [E, D]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


def moe_mlp(x: jax.Array, router: jax.Array | None, gate: jax.Array, up: jax.Array, down: jax.Array, *,
            top_k: int, normalize: bool, act: Callable[[jax.Array], jax.Array], tile: int | None = None,
            router_bias: jax.Array | None = None, biases: ExpertBiases | None = None,
            glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
            routing: tuple[jax.Array, jax.Array] | None = None, expert_parallel=None) -> jax.Array:
    """The mixture-of-experts MLP over N tokens.

    Args:
      x: [N, D]; router: [D, E]; gate, up: [E, D, F]; down: [E, F, D], float or quantized
        (`models/quant.py`: int8 with per-expert, per-output-column scales).
      tile: rows per tile (default `tile_rows`; static).
      router_bias: [E] added to the router logits, or None.
      biases: the experts' projection biases, or None.
      glu: `glu(gate_out, up_out)` in place of `act(gate_out) * up_out` (gpt-oss's clamped
        SwiGLU), or None.
      routing: (weights f32[N, k], experts i32[N, k]) chosen by the caller (DeepSeek's
        grouped routing, `models/moe_grouped.py`); None: `route` with `router`.
      expert_parallel: a `models/moe_ep.ExpertParallel` (the stacks split by expert over its
        mesh: each device runs its own experts' pairs, one all-reduce of [N, D]), or None.
    Returns:
      [N, D] in x's dtype.
    """
    weights, experts = routing if routing is not None else route(x, router, top_k, normalize, router_bias)
    tile = tile or tile_rows(x.shape[0] * top_k, gate.shape[0])
    if expert_parallel is not None:
        y = expert_parallel.run(x, weights, experts, (gate, up, down), biases, act=act, glu=glu, tile=tile)
    else:
        y = expert_sum(x, weights, experts, gate, up, down, act=act, glu=glu, tile=tile, biases=biases)
    return y.astype(x.dtype)


def expert_sum(x: jax.Array, weights: jax.Array, experts: jax.Array, gate, up, down, *,
               act: Callable[[jax.Array], jax.Array], tile: int, biases: ExpertBiases | None = None,
               glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
               num_run: int | None = None) -> jax.Array:
    """sum_j weights[n, j] * expert_{experts[n, j]}(x[n]) in float32 [N, D], by tiles (module docstring).

    `num_run`: run only experts [0, num_run) of the E = gate.shape[0] stacks; pairs naming
    expert `num_run` are sorted after them and never computed (expert parallelism routes
    the pairs of other devices' experts there, with weight 0). None: all E.
    """
    n, d = x.shape
    top_k = experts.shape[1]
    num_experts = gate.shape[0] if num_run is None else num_run + 1  # + the bucket never run
    pairs = n * top_k
    # Sort the (token, expert) pairs by expert; stable, so each expert sees its tokens in order.
    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    token = order // top_k
    sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    rank = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[sorted_expert]
    row = (padded_end - padded)[sorted_expert] + rank  # where each sorted pair sits among the tiles
    # At most one partly filled tile per expert in use: ceil(pairs / tile) + min(E, pairs) - 1 tiles.
    max_tiles = -(-pairs // tile) + min(num_experts, pairs) - 1
    rows = jnp.zeros((max_tiles * tile, d), x.dtype).at[row].set(x[token])
    last = num_experts - 1 if num_run is None else num_run - 1  # the last expert whose tiles run
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(max_tiles, dtype=jnp.int32) * tile, side="right")
    tile_expert = jnp.minimum(tile_expert, last).astype(jnp.int32)

    def run_tile(i, out):
        xt = jax.lax.dynamic_slice_in_dim(rows, i * tile, tile)
        e = tile_expert[i]
        g = project(xt, select_expert(gate, e), None if biases is None else biases.gate[e])
        u = project(xt, select_expert(up, e), None if biases is None else biases.up[e])
        yt = project(act(g) * u if glu is None else glu(g, u), select_expert(down, e),
                     None if biases is None else biases.down[e])
        return jax.lax.dynamic_update_slice_in_dim(out, yt.astype(out.dtype), i * tile, 0)

    out = jax.lax.fori_loop(0, padded_end[last] // tile, run_tile, jnp.zeros_like(rows))
    pair_weight = weights.reshape(-1)[order][:, None]
    y = out[row].astype(jnp.float32) * pair_weight
    return jnp.zeros((n, d), jnp.float32).at[token].add(y)
