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

GGUF files (llama.cpp's `glm4moe`, written by `conversion/glm.py:Glm4MoeModel`) carry the config
as these keys (`glm4moe.` prefix) and tensors:

    layers              block_count - nextn_predict_layers: the converter counts the
                        multi-token-prediction layers in block_count; their tensors
                        (`blk.{n}.nextn.*` beside a full layer's) are dropped at load
    rotary dims         rope.dimension_count = head_dim * partial_rotary_factor
    experts             expert_count, expert_used_count, expert_feed_forward_length,
                        expert_shared_count, leading_dense_block_count, expert_group_count,
                        expert_group_used_count, expert_weights_scale, expert_weights_norm
                        (absent: off, as llama.cpp reads it), expert_gating_func (sigmoid)
    biases, qk norm     no keys: read from the tensors (attn_q.bias, attn_q_norm.weight)
    second norm         post_attention_norm.weight (llama.cpp's name for GLM's)
    routing bias        exp_probs_b.bias

Rows are written unpermuted (llama.cpp runs GLM-4.5 with rotate-half RoPE). Refused at load,
by key: softmax routing (`expert_gating_func`), M-RoPE sections (`rope.dimension_sections`:
GLM-4.5V's vision RoPE), per-layer expert widths that differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from models import llama, qwen3
from models.config import UnsupportedModelError, hf_common_fields, rope_parameters
from models.decoder import CausalLM
from models.family import Family
from models.layers import AttentionSpec, SelfAttention, norm_param, rms_norm
from models.moe_grouped import (GGUF_MOE_WEIGHTS, GGUF_SIGMOID_GATING, HF_MOE_WEIGHTS, GroupedMoe, GroupedMoeConfig,
                                 grouped_moe_fields)


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

GGUF_ARCH = "glm4moe"
GGUF_LAYER_WEIGHTS = {
    **{k: v for k, v in llama.GGUF_LAYER_WEIGHTS.items() if k != "ffn_norm.weight"},
    **qwen3.QK_NORM_GGUF,
    "post_attention_norm.weight": "post_attn_norm",
    **GGUF_MOE_WEIGHTS,
}


def _one_width(value, key: str) -> int:
    values = set(int(v) for v in value) if isinstance(value, list) else {int(value)}
    if len(values) != 1:
        raise UnsupportedModelError(f"GGUF {GGUF_ARCH}.{key} {sorted(values)} (per-layer widths) is not supported")
    return values.pop()


def config_from_gguf(meta, fields: dict) -> Glm4MoeConfig:
    """A `glm4moe` file's config (module docstring: the keys)."""
    a = meta.arch
    gating = int(meta.get(f"{a}.expert_gating_func", GGUF_SIGMOID_GATING) or GGUF_SIGMOID_GATING)
    if gating != GGUF_SIGMOID_GATING:
        raise UnsupportedModelError(f"GGUF {a}.expert_gating_func {gating} is not supported: GLM-4.5 routes by "
                                    "sigmoid (2)")
    if meta.get(f"{a}.rope.dimension_sections") is not None:
        raise UnsupportedModelError(f"GGUF {a}.rope.dimension_sections (M-RoPE, GLM-4.5V's vision positions) is "
                                    "not supported: serve the text model's file")
    n = int(fields["num_layers"]) - int(meta.get(f"{a}.nextn_predict_layers", 0) or 0)
    if n <= 0:
        raise UnsupportedModelError(f"GGUF {a} holds only multi-token-prediction layers (block_count "
                                    f"{fields['num_layers']}); serve the file with the main layers")
    stray = [i for i in range(n) if meta.has_tensor(f"blk.{i}.nextn.eh_proj.weight")]
    if stray:
        raise UnsupportedModelError(f"GGUF {a} block {stray[0]} is a multi-token-prediction layer (nextn.* tensors) "
                                    f"but {a}.nextn_predict_layers leaves it among the {n} main layers")
    first_dense = int(meta.get(f"{a}.leading_dense_block_count", 0) or 0)
    return Glm4MoeConfig(
        **{**fields, "num_layers": n},
        num_experts=int(meta.require(f"{a}.expert_count")),
        num_experts_per_tok=int(meta.require(f"{a}.expert_used_count")),
        moe_intermediate_size=_one_width(meta.require(f"{a}.expert_feed_forward_length"),
                                         "expert_feed_forward_length"),
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", False)),
        dense_layers=tuple(range(min(first_dense, n))),
        n_group=int(meta.get(f"{a}.expert_group_count", 1) or 1),
        topk_group=int(meta.get(f"{a}.expert_group_used_count", 1) or 1),
        routed_scaling_factor=float(meta.get(f"{a}.expert_weights_scale", 1.0)),
        n_shared_experts=int(meta.require(f"{a}.expert_shared_count")),
        attention_bias=meta.has_tensor("blk.0.attn_q.bias"),
        qk_norm=meta.has_tensor("blk.0.attn_q_norm.weight"))


def drop_gguf_mtp_layers(tensors: dict, cfg: Glm4MoeConfig) -> None:
    """Drop, in place, every tensor of the multi-token-prediction layers the converter appends
    after the main ones (`blk.{n}` on): they serve only speculative decoding, which this family
    does not run."""
    for name in list(tensors):
        if name.startswith(("gguf:blk.", "layers.")) and int(name.split(".")[1]) >= cfg.num_layers:
            del tensors[name]


FAMILY = Family(
    name="glm4_moe",
    model=Glm4MoeModel,
    architectures=("Glm4MoeForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    hf_skips_extra_layers=True,
    gguf_architectures={GGUF_ARCH: "Glm4MoeForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_experts=True,
    gguf_merge=drop_gguf_mtp_layers,
)
