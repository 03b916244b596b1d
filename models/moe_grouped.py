"""DeepSeek-style mixture of experts: sigmoid scores, group-limited top-k, shared experts.

DeepSeek-V3 (and V3.1, Kimi K2) and GLM-4.5 route the same way (transformers'
`DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`), all in float32:

    s       = sigmoid(x @ router)                          f32[N, E]
    c       = s + e_score_correction_bias                  for the CHOICE only
    g       = sum of the 2 best c in each of n_group groups  f32[N, G]
    keep the topk_group best groups; c = -inf outside them
    e       = top_k(c, k)                                  i32[N, k]
    w       = s[e]                                         the uncorrected scores
    w       = w / (sum(w) + 1e-20)                         iff norm_topk_prob
    w       = w * routed_scaling_factor
    y       = sum_j w[j] * expert_{e[j]}(x) + shared(x)    shared: one SwiGLU MLP of
                                                           n_shared_experts * moe_intermediate_size

The experts run through `models/moe.py:moe_mlp` (its tiles, given this routing), so the
work follows the routing as for Mixtral. A layer below `first_k_dense_replace` keeps a
dense SwiGLU MLP of `intermediate_size` instead.

Per-layer parameters of an expert layer (HF names after `model.layers.{i}.`):

    router        [D, E]      mlp.gate.weight
    router_bias   [E]         mlp.gate.e_score_correction_bias
    experts_gate  [E, D, F]   mlp.experts.{e}.gate_proj.weight   (F = moe_intermediate_size)
    experts_up    [E, D, F]   mlp.experts.{e}.up_proj.weight
    experts_down  [E, F, D]   mlp.experts.{e}.down_proj.weight
    gate_proj     [D, S]      mlp.shared_experts.gate_proj.weight  (S = n_shared_experts * F)
    up_proj       [D, S]      mlp.shared_experts.up_proj.weight
    down_proj     [S, D]      mlp.shared_experts.down_proj.weight

The shared experts take the dense MLP's names: an expert layer has no dense MLP, and so
they shard (column / row over "model") and quantize as a dense MLP does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import UnsupportedModelError
from models.family import ExpertStack
from models.layers import gated_mlp, norm_param, param, silu
from models.moe import MoeConfig, moe_mlp


@dataclasses.dataclass(frozen=True)
class GroupedMoeConfig(MoeConfig):
    """MoeConfig plus DeepSeek's routing: groups, the score scale and the shared experts.
    `dense_layers` are the first `first_k_dense_replace` layers."""

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_group <= 0 or self.num_experts % self.n_group:
            raise ValueError(f"GroupedMoeConfig.n_group ({self.n_group}) must divide num_experts "
                             f"({self.num_experts})")
        if self.num_experts // self.n_group < 2:
            # transformers scores a group by its two best experts
            raise UnsupportedModelError(f"n_group {self.n_group} leaves fewer than 2 experts per group "
                                        f"({self.num_experts} experts)")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"GroupedMoeConfig.topk_group must be in [1, n_group={self.n_group}]; "
                             f"got {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * self.num_experts // self.n_group:
            raise ValueError(f"GroupedMoeConfig: num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                             f"experts of {self.topk_group} groups")
        if self.n_shared_experts < 0:
            raise ValueError(f"GroupedMoeConfig.n_shared_experts must be >= 0; got {self.n_shared_experts}")

    def sharded_sizes(self) -> dict[str, int]:
        sizes = super().sharded_sizes()
        if self.n_shared_experts:
            sizes["shared expert width"] = self.n_shared_experts * self.moe_intermediate_size
        return sizes


def grouped_moe_fields(cfg: dict, num_layers: int) -> dict:
    """The GroupedMoeConfig fields of a DeepSeek-V3 / GLM-4.5 config.json."""
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return dict(num_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                dense_layers=tuple(range(min(first_dense, num_layers))),
                n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                n_shared_experts=int(cfg.get("n_shared_experts") or 0))


def grouped_route(x: jax.Array, router: jax.Array, bias: jax.Array, *, top_k: int, n_group: int, topk_group: int,
                  normalize: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """Group-limited sigmoid routing (module docstring). x [N, D], router [D, E], bias [E]
    -> (weights f32[N, k], experts i32[N, k])."""
    n, e = x.shape[0], router.shape[1]
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)[None, :]
    group_scores = jax.lax.top_k(choice.reshape(n, n_group, e // n_group), 2)[0].sum(-1)  # [N, G]
    _, best_groups = jax.lax.top_k(group_scores, topk_group)
    group_mask = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best_groups].set(True)
    expert_mask = jnp.repeat(group_mask, e // n_group, axis=1)
    _, experts = jax.lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * scale, experts.astype(jnp.int32)


class GroupedMoe:
    """Mix-in for a decoder layer (an `nnx.Module`): the routed and shared experts of one
    layer, as flat parameters (table above)."""

    supports_expert_parallel = True  # models/moe_ep.py: the routed stacks may be split by expert
    expert_parallel = None  # set by models/moe_ep.py:enable_expert_parallel

    def init_moe(self, cfg: GroupedMoeConfig, dtype, rngs: nnx.Rngs) -> None:
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scale = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.router = param(rngs, (d, e), dtype)
        self.router_bias = norm_param(e, dtype, 0.0)
        self.experts_gate = param(rngs, (e, d, f), dtype)
        self.experts_up = param(rngs, (e, d, f), dtype)
        self.experts_down = param(rngs, (e, f, d), dtype)
        self.has_shared = cfg.n_shared_experts > 0
        if self.has_shared:
            s = cfg.n_shared_experts * f
            self.gate_proj = param(rngs, (d, s), dtype)
            self.up_proj = param(rngs, (d, s), dtype)
            self.down_proj = param(rngs, (s, d), dtype)

    def moe(self, h: jax.Array) -> jax.Array:
        """h [N, D] (normed) -> [N, D]: the routed experts' weighted sum plus the shared ones."""
        routing = grouped_route(h, self.router[...], self.router_bias[...], top_k=self.top_k, n_group=self.n_group,
                                topk_group=self.topk_group, normalize=self.normalize, scale=self.scale)
        y = moe_mlp(h, None, self.experts_gate.get_value(), self.experts_up.get_value(),
                    self.experts_down.get_value(), top_k=self.top_k, normalize=False, act=silu, routing=routing,
                    expert_parallel=self.expert_parallel)
        if self.has_shared:
            y = y + gated_mlp(h, self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value(), silu)
        return y


HF_MOE_WEIGHTS = {
    "mlp.gate.weight": "router",
    "mlp.gate.e_score_correction_bias": "router_bias",
    "mlp.experts.{e}.gate_proj.weight": "experts_gate",
    "mlp.experts.{e}.up_proj.weight": "experts_up",
    "mlp.experts.{e}.down_proj.weight": "experts_down",
    "mlp.shared_experts.gate_proj.weight": "gate_proj",
    "mlp.shared_experts.up_proj.weight": "up_proj",
    "mlp.shared_experts.down_proj.weight": "down_proj",
}
# The same tensors as llama.cpp's converter names them (DeepSeek-V3's and GLM-4.5's GGUF files),
# each expert stack stored transposed.
GGUF_MOE_WEIGHTS = {
    "ffn_gate_inp.weight": "router",
    "exp_probs_b.bias": "router_bias",
    "ffn_gate_exps.weight": ExpertStack(("experts_gate",), transpose=True),
    "ffn_up_exps.weight": ExpertStack(("experts_up",), transpose=True),
    "ffn_down_exps.weight": ExpertStack(("experts_down",), transpose=True),
    "ffn_gate_shexp.weight": "gate_proj",
    "ffn_up_shexp.weight": "up_proj",
    "ffn_down_shexp.weight": "down_proj",
}
GGUF_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
