"""Phi-3 (and Phi-3.5 / Phi-4-mini, same architecture): the Llama layer with fused weights
and longrope.

    layer: exactly Llama's (models/llama.py); the checkpoint fuses what Llama keeps apart:
      self_attn.qkv_proj.weight  [(H + 2K)*hd, D]  -> q_proj, k_proj, v_proj  (rows, in order)
      mlp.gate_up_proj.weight    [2F, D]           -> gate_proj, up_proj      (first half gates)
    split once at load, so sharding splits each projection like any other.
    RoPE: default, or `longrope` (short_factor within original_max_position_embeddings,
      long_factor beyond, cos/sin times the attention factor; models/rope.py), over the
      first partial_rotary_factor * head_dim dims (Phi-4-mini: 0.75).
    sliding_window: every layer, as transformers' mask does (llama.cpp disables it).

GGUF (`phi3`): attn_qkv.weight (or attn_q/k/v) and a fused ffn_up.weight [2F, D]; the
longrope factors are the tensors rope_factors_short/long.weight with
`phi3.rope.scaling.attn_factor` and `.original_context_length`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from models import llama
from models.config import ModelConfig, RopeScaling, UnsupportedModelError, hf_common_fields
from models.decoder import CausalLM
from models.family import Family


class Phi3Model(CausalLM):
    def make_layer(self, index, rngs):
        return llama.LlamaDecoderLayer(self.cfg, index, self.dtype, rngs)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    fields = hf_common_fields(cfg)
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary = int(fields["head_dim"] * partial)
    window = cfg.get("sliding_window") or None
    return ModelConfig(**fields, rotary_dim=None if rotary == fields["head_dim"] else rotary,
                       sliding_window=window,
                       layer_types=("sliding_attention",) * fields["num_layers"] if window else ())


def config_from_gguf(meta, fields: dict) -> ModelConfig:
    short, long = meta.tensor("rope_factors_short.weight"), meta.tensor("rope_factors_long.weight")
    if (short is None) != (long is None):
        raise UnsupportedModelError("phi3 GGUF has only one of rope_factors_short/long.weight")
    if short is not None:
        original = int(meta.get("phi3.rope.scaling.original_context_length", fields["max_position_embeddings"]))
        factor = fields["max_position_embeddings"] / original
        default_attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        fields["rope_scaling"] = RopeScaling(
            "longrope", factor=factor, original_max_position_embeddings=original,
            short_factor=tuple(np.asarray(short, np.float64).reshape(-1).tolist()),
            long_factor=tuple(np.asarray(long, np.float64).reshape(-1).tolist()),
            attention_factor=float(meta.get("phi3.rope.scaling.attn_factor", default_attn)))
    window = meta.get("phi3.attention.sliding_window")
    return ModelConfig(**fields, sliding_window=window or None,
                       layer_types=("sliding_attention",) * fields["num_layers"] if window else ())


HF_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attn_norm",
    "mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
    "mlp.down_proj.weight": "down_proj",
}
GGUF_LAYER_WEIGHTS = {
    "attn_norm.weight": "input_norm",
    "attn_qkv.weight": ("q_proj", "k_proj", "v_proj"),
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attn_norm",
    "ffn_up.weight": ("gate_proj", "up_proj"),
    "ffn_down.weight": "down_proj",
}

FAMILY = Family(
    name="phi3",
    model=Phi3Model,
    architectures=("Phi3ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    gguf_architectures={"phi3": "Phi3ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_non_parameters=("rope_factors_short.weight", "rope_factors_long.weight"),
)
