"""Qwen3: the Llama layer with a per-head RMSNorm on q and k before RoPE.

    q, k = rms_norm(q_heads, q_norm), rms_norm(k_heads, k_norm)    per head, over hd
    x = x + attention(rms_norm(x));  x = x + swiglu_mlp(rms_norm(x))

No q/k/v bias (unlike Qwen2); `head_dim` is its own setting (128 while hidden / heads may
differ). Sliding windows only with `use_sliding_window`, as Qwen2.

Per-layer parameters: Llama's (models/llama.py) plus

    q_norm  [hd]   self_attn.q_norm.weight   (GGUF attn_q_norm.weight)
    k_norm  [hd]   self_attn.k_norm.weight   (GGUF attn_k_norm.weight)
"""

from __future__ import annotations

from typing import Any

from models import llama
from models.config import ModelConfig, hf_common_fields, hf_layer_types
from models.decoder import CausalLM
from models.family import Family
from models.layers import AttentionSpec


class Qwen3Model(CausalLM):
    def make_layer(self, index, rngs):
        spec = AttentionSpec.from_config(self.cfg, index, qk_norm="rms")
        return llama.LlamaDecoderLayer(self.cfg, index, self.dtype, rngs, attention=spec)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    fields = hf_common_fields(cfg)
    window, types = hf_layer_types(llama.qwen_layer_types(cfg), fields["num_layers"],
                                   window_applies=bool(cfg.get("use_sliding_window")))
    return ModelConfig(**fields, attention_bias=bool(cfg.get("attention_bias", False)),
                       sliding_window=window, layer_types=types)


def config_from_gguf(meta, fields: dict) -> ModelConfig:
    return ModelConfig(**fields, attention_bias=meta.has_tensor("blk.0.attn_q.bias"))


QK_NORM_HF = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
QK_NORM_GGUF = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}

FAMILY = Family(
    name="qwen3",
    model=Qwen3Model,
    architectures=("Qwen3ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights={**llama.HF_LAYER_WEIGHTS, **QK_NORM_HF},
    gguf_architectures={"qwen3": "Qwen3ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights={**llama.GGUF_LAYER_WEIGHTS, **QK_NORM_GGUF},
)
