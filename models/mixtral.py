"""Mixtral: Mistral's attention with a mixture of experts in place of the MLP.

    x = x + attention(rms_norm(x))                          as Mistral (window on every layer if set)
    x = x + moe_mlp(rms_norm(x))                            top-k (2 of 8) softmax routing, the
                                                            top-k weights renormalised; experts are
                                                            SwiGLU MLPs (models/moe.py)

Per-layer parameters: Llama's attention and norms (models/llama.py), and

    router        [D, E]      block_sparse_moe.gate.weight
    experts_gate  [E, D, F]   block_sparse_moe.experts.{e}.w1.weight   (stacked)
    experts_up    [E, D, F]   block_sparse_moe.experts.{e}.w3.weight
    experts_down  [E, F, D]   block_sparse_moe.experts.{e}.w2.weight

llama.cpp writes Mixtral GGUFs as architecture `llama` (q/k rows permuted, as for Llama)
with `llama.expert_count` / `expert_used_count`, the router as `ffn_gate_inp` and each
layer's experts stacked (`ffn_{gate,up,down}_exps`: models/moe.py GGUF_EXPERT_WEIGHTS).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from models import llama
from models.config import hf_common_fields
from models.decoder import CausalLM
from models.family import Family
from models.layers import AttentionSpec, TwoHalves, norm_param, param, rms_norm, silu
from models.moe import GGUF_EXPERT_WEIGHTS, MoeConfig, moe_mlp


class MoeDecoderLayer(nnx.Module, TwoHalves):
    """Attention then experts; the layer Mixtral and Qwen3-MoE share (Qwen3-MoE adds q/k
    norms through its AttentionSpec)."""

    supports_expert_parallel = True  # models/moe_ep.py: the stacks may be split by expert
    expert_parallel = None  # set by models/moe_ep.py:enable_expert_parallel

    def __init__(self, cfg: MoeConfig, attention: AttentionSpec, dtype, rngs: nnx.Rngs):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.eps = cfg.rms_norm_eps
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.input_norm = norm_param(d, dtype)
        self.init_attention(attention, d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype)
        self.router = param(rngs, (d, e), dtype)
        self.experts_gate = param(rngs, (e, d, f), dtype)
        self.experts_up = param(rngs, (e, d, f), dtype)
        self.experts_down = param(rngs, (e, f, d), dtype)

    def finish(self, x):
        """The experts' half, token by token (routing is per token): x [M, D] -> [M, D]."""
        h = rms_norm(x, self.post_attn_norm[...], self.eps)
        y = moe_mlp(h, self.router[...], self.experts_gate.get_value(), self.experts_up.get_value(),
                    self.experts_down.get_value(), top_k=self.top_k, normalize=self.normalize, act=silu,
                    expert_parallel=self.expert_parallel)
        return x + y


class MixtralModel(CausalLM):
    def make_layer(self, index, rngs):
        return MoeDecoderLayer(self.cfg, AttentionSpec.from_config(self.cfg, index), self.dtype, rngs)


def config_from_gguf(meta, fields: dict) -> MoeConfig:
    """A `llama` GGUF with experts (llama.cpp writes Mixtral so): the experts are
    feed_forward_length wide, the top-k weights always renormalised (as llama.cpp does)."""
    window = meta.get(f"{meta.arch}.attention.sliding_window") or None
    return MoeConfig(**fields, sliding_window=window,
                     layer_types=("sliding_attention",) * fields["num_layers"] if window else (),
                     num_experts=int(meta.require(f"{meta.arch}.expert_count")),
                     num_experts_per_tok=int(meta.require(f"{meta.arch}.expert_used_count")),
                     moe_intermediate_size=fields["intermediate_size"], norm_topk_prob=True)


def config_from_hf(cfg: dict[str, Any]) -> MoeConfig:
    fields = hf_common_fields(cfg)
    window = cfg.get("sliding_window") or None
    return MoeConfig(**fields, sliding_window=window,
                     layer_types=("sliding_attention",) * fields["num_layers"] if window else (),
                     num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                     moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)


HF_LAYER_WEIGHTS = {
    **{k: v for k, v in llama.HF_LAYER_WEIGHTS.items() if k.startswith(("self_attn.", "input_", "post_"))},
    "block_sparse_moe.gate.weight": "router",
    "block_sparse_moe.experts.{e}.w1.weight": "experts_gate",
    "block_sparse_moe.experts.{e}.w3.weight": "experts_up",
    "block_sparse_moe.experts.{e}.w2.weight": "experts_down",
}

FAMILY = Family(
    name="mixtral",
    model=MixtralModel,
    architectures=("MixtralForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    gguf_architectures={"llama": "MixtralForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights={**{k: v for k, v in llama.GGUF_LAYER_WEIGHTS.items() if k.startswith(("attn_", "ffn_norm"))},
                        **GGUF_EXPERT_WEIGHTS},
    gguf_non_parameters=("rope_freqs.weight",),
    gguf_qk_permuted=("llama",),
    gguf_experts=True,
)
