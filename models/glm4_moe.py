"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`): GQA attention with DeepSeek-style experts.

    x = x + attention(rms_norm(x))     q/k/v with biases (attention_bias), per-head q/k RMSNorm
                                       when use_qk_norm, rotate-half RoPE over the first
                                       partial_rotary_factor * head_dim dims (0.5 by default)
    x = x + moe(rms_norm(x))           sigmoid group-limited top-k plus shared experts
                                       (models/moe_grouped.py); the first
                                       `first_k_dense_replace` layers a dense SwiGLU MLP

Per-layer parameters: Llama's attention and norms (models/llama.py, o_proj without bias),
q_norm / k_norm [hd] when use_qk_norm, and on expert layers the grouped MoE's
(models/moe_grouped.py), on dense layers Llama's gate_proj / up_proj / down_proj. The
multi-token-prediction layers a checkpoint appends after `num_hidden_layers` are skipped
at load (they serve only speculative decoding in GLM's own stack).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from models import llama, qwen3
from models.config import hf_common_fields, rope_parameters
from models.decoder import CausalLM
from models.family import Family
from models.layers import AttentionSpec, SelfAttention, norm_param, rms_norm
from models.moe_grouped import HF_MOE_WEIGHTS, GroupedMoe, GroupedMoeConfig, grouped_moe_fields


class Glm4MoeDecoderLayer(nnx.Module, SelfAttention, GroupedMoe):
    """Attention then the grouped experts (an expert layer; dense layers are Llama's)."""

    def __init__(self, cfg: GroupedMoeConfig, attention: AttentionSpec, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.input_norm = norm_param(d, dtype)
        self.init_attention(attention, d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype)
        self.init_moe(cfg, dtype, rngs)

    def __call__(self, x, fwd, k_cache, v_cache):
        """x: [N, D] -> ([N, D], k_cache, v_cache)."""
        attn, k_cache, v_cache = self.attention(rms_norm(x, self.input_norm[...], self.eps), fwd, k_cache, v_cache)
        x = x + attn
        return x + self.moe(rms_norm(x, self.post_attn_norm[...], self.eps)), k_cache, v_cache


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig(GroupedMoeConfig):
    qk_norm: bool = False  # use_qk_norm: per-head RMSNorm of q and k before RoPE


class Glm4MoeModel(CausalLM):
    def make_layer(self, index, rngs):
        spec = AttentionSpec.from_config(self.cfg, index, qk_norm="rms" if self.cfg.qk_norm else None)
        if self.cfg.is_moe_layer(index):
            return Glm4MoeDecoderLayer(self.cfg, spec, self.dtype, rngs)
        return llama.LlamaDecoderLayer(self.cfg, index, self.dtype, rngs, attention=spec)


def config_from_hf(cfg: dict[str, Any]) -> Glm4MoeConfig:
    fields = hf_common_fields(cfg)
    params = rope_parameters(cfg)
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    rotary = int(fields["head_dim"] * partial)
    return Glm4MoeConfig(**fields, **grouped_moe_fields(cfg, fields["num_layers"]),
                         rotary_dim=None if rotary == fields["head_dim"] else rotary,
                         attention_bias=bool(cfg.get("attention_bias", False)),
                         qk_norm=bool(cfg.get("use_qk_norm", False)))


HF_LAYER_WEIGHTS = {**llama.HF_LAYER_WEIGHTS, **qwen3.QK_NORM_HF, **HF_MOE_WEIGHTS}

FAMILY = Family(
    name="glm4_moe",
    model=Glm4MoeModel,
    architectures=("Glm4MoeForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    hf_skips_extra_layers=True,
)
