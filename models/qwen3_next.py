"""Qwen3-Next and Qwen3.5-MoE: Qwen3.5's layer mix (Gated DeltaNet + gated full attention) with experts.

    x = x + mixer(norm(x))                      as Qwen3.5 (models/qwen3_5.py); the DeltaNet
                                                projections fused (models/deltanet.py, `fused`)
    x = x + moe(norm(x)) + sigmoid(x_n . g) * shared_mlp(norm(x))
                                                top-k softmax routing (models/moe.py), the top-k
                                                weights renormalised iff norm_topk_prob, plus a
                                                shared expert scaled by a sigmoid gate per token
    layers in `mlp_only_layers`, or off the `decoder_sparse_step` beat, keep a dense SwiGLU MLP

Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, `QWEN3_5_MOE`) is the same model with Qwen3.5's unfused
DeltaNet projections and experts on every layer.

Qwen3.5-MoE GGUF files (llama.cpp's `qwen35moe`) read as Qwen3.5's (models/qwen3_5_gguf.py: the
DeltaNet keys and the layouts the converter changed) plus the experts: expert_count,
expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length; the router
`ffn_gate_inp`, the stacks `ffn_{gate,up,down}_exps`, the shared expert `ffn_*_shexp` and its gate
`ffn_gate_inp_shexp`. The converter writes no feed_forward_length (no layer is dense): the shared
loader takes the experts' width for it, as config_from_hf does. The top-k weights are always
renormalised (the converter writes no key for it; HF's router does).

Qwen3-Next GGUF files (`qwen3next`) read the same keys (feed_forward_length present); every layer
has experts (llama.cpp's `qwen3next` has no dense-MLP tensors, so a checkpoint with
`mlp_only_layers` has no GGUF form: its converter stops on them); the top-k weights are always
renormalised, as llama.cpp's graph does; the fused DeltaNet projections are joined back
(models/qwen3_5_gguf.py).

Both ship Qwen3.5's multi-token-prediction block (`mtp.*`, with this layer's experts), skipped
here and read by `--speculative mtp` (models/qwen3_5_mtp.py).

Per-layer parameters: Qwen3.5's mixers and norms (DeltaNet's `in_proj_qkvz` / `in_proj_ba`
in place of its four input projections), and on expert layers

    router             [D, E]      mlp.gate.weight
    experts_gate/up    [E, D, F]   mlp.experts.{e}.{gate,up}_proj.weight   (F = moe_intermediate_size)
    experts_down       [E, F, D]   mlp.experts.{e}.down_proj.weight
    shared_gate/up     [D, S]      mlp.shared_expert.{gate,up}_proj.weight (S = shared_expert_intermediate_size)
    shared_down        [S, D]      mlp.shared_expert.down_proj.weight
    shared_expert_gate [D, 1]      mlp.shared_expert_gate.weight
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from models import qwen3_5, qwen3_5_gguf
from models.family import ExpertStack, Family
from models.layers import gated_mlp, param, project, silu
from models.moe import MoeConfig, moe_mlp


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(qwen3_5.Qwen3_5Config, MoeConfig):
    shared_expert_intermediate_size: int = 0  # the shared expert's width (0: none)

    def sharded_sizes(self) -> dict[str, int]:
        """Tensor parallelism splits the shared expert's width too, as a dense MLP's."""
        sizes = super().sharded_sizes()
        if self.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return sizes


class Qwen3NextDecoderLayer(qwen3_5.Qwen3_5DecoderLayer):
    def __init__(self, cfg: Qwen3NextConfig, index: int, dtype, rngs: nnx.Rngs):
        self.is_moe = cfg.is_moe_layer(index)
        super().__init__(cfg, index, dtype, rngs, dense=not self.is_moe)
        if not self.is_moe:
            return
        d, e, f, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = param(rngs, (d, e), dtype)
        self.experts_gate = param(rngs, (e, d, f), dtype)
        self.experts_up = param(rngs, (e, d, f), dtype)
        self.experts_down = param(rngs, (e, f, d), dtype)
        self.has_shared = s > 0
        if self.has_shared:
            self.shared_gate = param(rngs, (d, s), dtype)
            self.shared_up = param(rngs, (d, s), dtype)
            self.shared_down = param(rngs, (s, d), dtype)
            self.shared_expert_gate = param(rngs, (d, 1), dtype)

    def feed_forward(self, h):
        if not self.is_moe:
            return super().feed_forward(h)
        y = moe_mlp(h, self.router[...], self.experts_gate.get_value(), self.experts_up.get_value(),
                    self.experts_down.get_value(), top_k=self.top_k, normalize=self.normalize, act=silu)
        if self.has_shared:
            shared = gated_mlp(h, self.shared_gate.get_value(), self.shared_up.get_value(),
                               self.shared_down.get_value(), silu)
            y = y + jax.nn.sigmoid(project(h, self.shared_expert_gate.get_value())) * shared
        return y


class Qwen3NextModel(qwen3_5.Qwen3_5Model):
    def make_layer(self, index, rngs):
        return Qwen3NextDecoderLayer(self.cfg, index, self.dtype, rngs)


def config_from_hf(cfg: dict[str, Any]) -> Qwen3NextConfig:
    fields = qwen3_5.hf_fields(cfg)
    n = fields["num_layers"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    return Qwen3NextConfig(**fields, fused_deltanet=True, num_experts=cfg["num_experts"],
                           num_experts_per_tok=cfg["num_experts_per_tok"],
                           moe_intermediate_size=cfg["moe_intermediate_size"],
                           norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                           dense_layers=tuple(i for i in range(n) if i in only_mlp or (i + 1) % step),
                           shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0)


def config_from_hf_qwen3_5_moe(cfg: dict[str, Any]) -> Qwen3NextConfig:
    """Qwen3.5-MoE: Qwen3.5's unfused DeltaNet projections, every layer's MLP experts plus a
    shared expert, the top-k weights always renormalised (its router does); the config has no
    dense `intermediate_size` (no layer is dense), so it reads as the experts' width."""
    cfg = {"intermediate_size": cfg["moe_intermediate_size"], **cfg}
    return Qwen3NextConfig(**qwen3_5.hf_fields(cfg), num_experts=cfg["num_experts"],
                           num_experts_per_tok=cfg["num_experts_per_tok"],
                           moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=True,
                           shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0)


def config_from_gguf_qwen3_5_moe(meta, fields: dict) -> Qwen3NextConfig:
    """A `qwen35moe` file's config (module docstring: the keys)."""
    a = meta.arch
    return Qwen3NextConfig(**qwen3_5_gguf.config_fields(meta, fields),
                           num_experts=int(meta.require(f"{a}.expert_count")),
                           num_experts_per_tok=int(meta.require(f"{a}.expert_used_count")),
                           moe_intermediate_size=int(meta.require(f"{a}.expert_feed_forward_length")),
                           norm_topk_prob=True,
                           shared_expert_intermediate_size=int(meta.get(f"{a}.expert_shared_feed_forward_length", 0)
                                                               or 0))


def config_from_gguf_qwen3_next(meta, fields: dict) -> Qwen3NextConfig:
    """A `qwen3next` file's config (module docstring)."""
    return dataclasses.replace(config_from_gguf_qwen3_5_moe(meta, fields), fused_deltanet=True)


GGUF_MOE_WEIGHTS = {
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": ExpertStack(("experts_gate",), transpose=True),
    "ffn_up_exps.weight": ExpertStack(("experts_up",), transpose=True),
    "ffn_down_exps.weight": ExpertStack(("experts_down",), transpose=True),
    "ffn_gate_shexp.weight": "shared_gate",
    "ffn_up_shexp.weight": "shared_up",
    "ffn_down_shexp.weight": "shared_down",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate",
}

MOE_WEIGHTS = {
    "mlp.gate.weight": "router",
    "mlp.experts.{e}.gate_proj.weight": "experts_gate",
    "mlp.experts.{e}.up_proj.weight": "experts_up",
    "mlp.experts.{e}.down_proj.weight": "experts_down",
    "mlp.shared_expert.gate_proj.weight": "shared_gate",
    "mlp.shared_expert.up_proj.weight": "shared_up",
    "mlp.shared_expert.down_proj.weight": "shared_down",
    "mlp.shared_expert_gate.weight": "shared_expert_gate",
}

HF_LAYER_WEIGHTS = {
    **{k: v for k, v in qwen3_5.HF_LAYER_WEIGHTS.items() if not k.startswith("linear_attn.in_proj_")},
    "linear_attn.in_proj_qkvz.weight": "in_proj_qkvz",
    "linear_attn.in_proj_ba.weight": "in_proj_ba",
    **MOE_WEIGHTS,
}

FAMILY = Family(
    name="qwen3_next",
    model=Qwen3NextModel,
    architectures=("Qwen3NextForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    hf_skipped_prefixes=qwen3_5.MTP_PREFIXES,
    gguf_architectures={"qwen3next": "Qwen3NextForCausalLM"},
    config_from_gguf=config_from_gguf_qwen3_next,
    gguf_layer_weights={**qwen3_5_gguf.GGUF_LAYER_WEIGHTS, **GGUF_MOE_WEIGHTS, "ssm_ba.weight": "in_proj_ba"},
    gguf_experts=True,
    gguf_merge=qwen3_5_gguf.merge_tensors,
    gguf_adapter_merge=qwen3_5_gguf.merge_adapter,
)

QWEN3_5_MOE = Family(
    name="qwen3_5_moe",
    model=Qwen3NextModel,
    architectures=("Qwen3_5MoeForCausalLM",),
    config_from_hf=config_from_hf_qwen3_5_moe,
    hf_layer_weights={**qwen3_5.HF_LAYER_WEIGHTS, **MOE_WEIGHTS},
    hf_skipped_prefixes=qwen3_5.MTP_PREFIXES,
    gguf_architectures={"qwen35moe": "Qwen3_5MoeForCausalLM"},
    config_from_gguf=config_from_gguf_qwen3_5_moe,
    gguf_layer_weights={**qwen3_5_gguf.GGUF_LAYER_WEIGHTS, **GGUF_MOE_WEIGHTS},
    gguf_experts=True,
    gguf_merge=qwen3_5_gguf.merge_tensors,
    gguf_adapter_merge=qwen3_5_gguf.merge_adapter,
)
