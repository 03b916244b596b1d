"""Expert parallelism: each device holds E / M whole experts and runs only their pairs.

Under tensor parallelism (`ferrox_jax/sharding.py`) every expert is split over its
intermediate axis: each device holds a 1/M slice of every expert, and each tile of an
expert's tokens all-reduces its [tile, D] down projection (one all-reduce per tile in
use). With `--expert-parallel` the stacks are split by expert instead:

    param                        shape       spec (expert parallel)
    experts_gate / experts_up    [E, D, F]   P("model", None, None)
    experts_down                 [E, F, D]   P("model", None, None)
    experts_*_bias               [E, n]      P("model", None)
    router, router_bias          [D, E], [E] P()   (every device routes every token)

and the block runs under `shard_map` on the engine's mesh (`ExpertParallel.run`):

    1. tokens x [N, D], routing weights and experts [N, k]: replicated (the hidden state
       already is after attention's all-reduce, so nothing moves to "all-gather" them);
    2. device m owns experts [m * E/M, (m+1) * E/M): a pair whose expert is another
       device's is sent to a bucket that never runs, with weight 0;
    3. the local experts run by tiles exactly as on one device (`models/moe.py:expert_sum`);
    4. one psum of the float32 [N, D] partial sums over "model".

So the communication is one all-reduce of N x D float32 per MoE layer, whatever the
routing, against one [tile, D] all-reduce per tile in use for the intermediate split;
and each device reads only its own experts' weights (whole matrices, no 1/M slivers).
This is the simple form, the one tpu-inference's grouped-matmul EP path takes
(`expert_parallel_gmm` in its layers/common/fused_moe_gmm.py: tokens replicated over the
expert axis, each shard its experts from a group offset, rows of other shards' experts
masked, one psum); an all-to-all dispatch moves less at large N but needs capacity
padding and is later work. Each device's work depends on how many pairs
routed to its experts: the loop runs over that device's tiles in use only.

Which split serves (`--expert-parallel on|off|auto`, `resolve_expert_parallel`; docs/models.md):
the intermediate split suits few large experts (Mixtral: 8 of width 14336, 1792 columns
per device at 8 devices; split by expert, 8 devices would hold one expert each and a
decode step's top-2 pairs would land on a few of them), the expert split many small ones
(Qwen3-MoE: 128 of width 768, DeepSeek-V3: 256 of 2048, gpt-oss-120b: 128 of 2880), whose
1/M intermediate slivers (96 columns for Qwen3-MoE at 8 devices) are too thin to fill a
device and whose per-tile all-reduces add up (a 32-row top-8 decode step touches up to
128 experts' tiles: up to 128 all-reduces per layer against 1). `auto` splits by expert
from AUTO_MIN_EXPERTS = 32 experts (gpt-oss-20b's count; at 8 devices 4 experts each) when
the devices divide E, by width below; it is a rule of thumb from those shapes, not a
measurement on TPU/GPU (none was available to this work).

The mesh reaches the layers as a static attribute (`enable_expert_parallel` sets it
after the model is built, as the decode-attention kernel reaches them): hashable, so
it is part of the compiled step's identity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from models.moe import ExpertBiases, expert_sum

# The families whose expert layers route through `moe_mlp` with `expert_parallel`
# (their layer classes set `supports_expert_parallel`); the others are refused at load.
EXPERT_PARALLEL_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                                 "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
EXPERT_AXIS = "model"  # the mesh axis experts split over (`ferrox_jax/sharding.py` MODEL_AXIS)
# `--expert-parallel auto` splits by expert from this many experts (module docstring: why).
AUTO_MIN_EXPERTS = 32


def resolve_expert_parallel(mode: str, cfg, model_axis: int) -> tuple[bool, str]:
    """(split by expert?, a start-up note or "") for `--expert-parallel` `mode` ("on", "off",
    "auto"). "on" is checked (`check_expert_parallel` raises); "auto" splits by expert only
    where that can serve: a supported family with at least AUTO_MIN_EXPERTS experts that
    the model axis divides, on more than one device."""
    num_experts = int(getattr(cfg, "num_experts", 0) or 0)
    if mode == "on":
        check_expert_parallel(cfg, model_axis)
        return model_axis > 1, f"expert parallelism on: {num_experts // model_axis} of {num_experts} experts per device"
    if mode == "off" or model_axis == 1 or num_experts == 0:
        return False, ""
    if (cfg.architecture in EXPERT_PARALLEL_ARCHITECTURES and num_experts >= AUTO_MIN_EXPERTS
            and num_experts % model_axis == 0):
        return True, (f"expert parallelism auto -> on: {num_experts} experts, {num_experts // model_axis} per "
                      f"device (--expert-parallel off splits each expert's width instead)")
    return False, (f"expert parallelism auto -> off: {num_experts} experts split over their intermediate axis "
                   f"(auto splits by expert from {AUTO_MIN_EXPERTS} experts the {model_axis} devices divide)")


def check_expert_parallel(cfg, model_axis: int) -> None:
    """Raise ValueError when `--expert-parallel` cannot serve `cfg` on `model_axis` devices."""
    num_experts = int(getattr(cfg, "num_experts", 0) or 0)
    if num_experts == 0:
        raise ValueError(f"--expert-parallel: the model ({cfg.architecture}) has no routed experts; "
                         "pass --expert-parallel off (or auto)")
    if cfg.architecture not in EXPERT_PARALLEL_ARCHITECTURES:
        raise ValueError(f"--expert-parallel is not supported for {cfg.architecture} yet (supported: "
                         f"{', '.join(EXPERT_PARALLEL_ARCHITECTURES)}); pass --expert-parallel off to split "
                         "its experts over their intermediate axis")
    if num_experts % model_axis:
        raise ValueError(f"--expert-parallel: {model_axis} devices do not divide the model's num_experts "
                         f"{num_experts}; choose a tensor parallel size dividing {num_experts}, or pass "
                         "--expert-parallel off to split each expert over its intermediate axis")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The mesh an expert layer runs its experts on, split by expert over `axis`."""

    mesh: Mesh
    axis: str = EXPERT_AXIS

    def first_expert(self, device: jax.Array, per_device: int) -> jax.Array:
        """The first expert device `device` (its index on `axis`) holds: its stack shard is
        experts [device * per_device, (device + 1) * per_device), as NamedSharding lays out
        P(axis) (shard m of an axis split M ways is its m-th contiguous 1/M)."""
        return device * per_device

    def run(self, x: jax.Array, weights: jax.Array, experts: jax.Array, stacks: tuple[Any, Any, Any],
            biases, *, act: Callable, glu: Callable | None, tile: int) -> jax.Array:
        """`models/moe.py:expert_sum` with the stacks split by expert (module docstring).

        Args:
          x: [N, D]; weights f32[N, k], experts i32[N, k] (global expert ids): replicated.
          stacks: (gate [E, D, F], up [E, D, F], down [E, F, D]), float or quantized,
            split over `axis` by expert.
          biases: `models/moe.py:ExpertBiases` (split by expert too) or None.
        Returns:
          f32[N, D], replicated.
        """
        per_device = stacks[0].shape[0] // self.mesh.shape[self.axis]
        bias_arrays = () if biases is None else (biases.gate, biases.up, biases.down)

        def local(x, weights, experts, stacks, bias_arrays):
            first = self.first_expert(jax.lax.axis_index(self.axis), per_device)
            mine = (experts >= first) & (experts < first + per_device)
            local_experts = jnp.where(mine, experts - first, per_device)  # per_device: the bucket never run
            local_weights = jnp.where(mine, weights, 0.0)
            local_biases = ExpertBiases(*bias_arrays) if bias_arrays else None
            y = expert_sum(x, local_weights, local_experts, *stacks, act=act, glu=glu, tile=tile,
                           biases=local_biases, num_run=per_device)
            return jax.lax.psum(y, self.axis)

        split = P(self.axis)  # a prefix: every leaf of a stack (a QuantizedWeight's values and scales) by expert
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(), P(), split, split), out_specs=P(),
                             check_vma=False)(x, weights, experts, tuple(stacks), bias_arrays)


def enable_expert_parallel(model, mesh: Mesh | None, kind: type[ExpertParallel] = ExpertParallel) -> int:
    """Point every expert layer of `model` at `mesh` (split by expert); returns how many.

    Raises ValueError when a layer holding expert stacks cannot run them split by expert
    (its class does not set `supports_expert_parallel`). `kind`: the tests' negative
    controls pass a subclass that misplaces the experts."""
    if mesh is None:
        return 0
    ep = kind(mesh)
    return sum(point_layer_at_mesh(layer, mesh, ep, model.cfg.architecture) for layer in model.layers)


def point_layer_at_mesh(layer, mesh: Mesh, ep: ExpertParallel | None = None, architecture: str = "the model") -> bool:
    """Point one layer at `mesh` if it holds expert stacks (`enable_expert_parallel`; the MTP
    layer of `ferrox_jax/mtp.py`, which is not among `model.layers`); whether it did."""
    if not hasattr(layer, "experts_down"):
        return False
    if not getattr(layer, "supports_expert_parallel", False):
        raise ValueError(f"--expert-parallel is not supported for {architecture}'s expert layers "
                         f"({type(layer).__name__}); pass --expert-parallel off")
    layer.expert_parallel = ep if ep is not None else ExpertParallel(mesh)
    return True


def uses_expert_parallel(model) -> bool:
    """Whether `enable_expert_parallel` pointed any of `model`'s layers at a mesh."""
    return any(getattr(layer, "expert_parallel", None) is not None for layer in getattr(model, "layers", ()))
