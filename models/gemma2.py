"""Gemma 2: sandwich norms, GeGLU, soft-capped logits, sliding windows on alternate layers.

    x = embed(tokens) * sqrt(D)                              (the scale cast to the dtype)
    x = x + norm(attention(norm(x)))                         norm: RMSNorm times (1 + w)
    x = x + norm(geglu_mlp(norm(x)))                         down(gelu_tanh(gate(x)) * up(x))
    attention: scale query_pre_attn_scalar^-0.5, logits attn_logit_softcap * tanh(s / cap),
               layers 0, 2, 4, ... windowed (`layer_types`), the others full
    logits = final_logit_softcap * tanh((norm(x) @ W) / cap)

Per-layer parameters (HF name after `model.layers.{i}.`; GGUF after `blk.{i}.`):

    input_norm      [D]   input_layernorm.weight             attn_norm.weight
    q/k/v/o_proj          self_attn.{q,k,v,o}_proj.weight    attn_{q,k,v,output}.weight
    post_attn_norm  [D]   post_attention_layernorm.weight    post_attention_norm.weight
    pre_mlp_norm    [D]   pre_feedforward_layernorm.weight   ffn_norm.weight
    gate/up/down_proj     mlp.{gate,up,down}_proj.weight     ffn_{gate,up,down}.weight
    post_mlp_norm   [D]   post_feedforward_layernorm.weight  post_ffw_norm.weight

Norm weights are stored as HF does (w, applied as 1 + w); llama.cpp's converter writes
1 + w into GGUF files, so the GGUF loader subtracts 1 (`gguf_norm_offset`).
GGUF files carry no query_pre_attn_scalar; llama.cpp derives it from the model size
(hidden / heads for the 27B, whose 46 layers identify it; head_dim otherwise), and so
do we unless the file states `gemma2.attention.scale`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig, UnsupportedModelError, hf_common_fields
from models.decoder import CausalLM
from models.family import Family
from models.quant import embed_lookup
from models.layers import (AttentionSpec, TwoHalves, gated_mlp, gelu_tanh, norm_param, param,
                           rms_norm_plus_one, softcap)

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class Gemma2Config(ModelConfig):
    query_pre_attn_scalar: float = 256.0  # attention scale is its inverse square root
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None


class Gemma2DecoderLayer(nnx.Module, TwoHalves):
    def __init__(self, cfg: Gemma2Config, attention: AttentionSpec, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.input_norm = norm_param(d, dtype, 0.0)
        self.init_attention(attention, d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype, 0.0)
        self.pre_mlp_norm = norm_param(d, dtype, 0.0)
        self.gate_proj = param(rngs, (d, f), dtype)
        self.up_proj = param(rngs, (d, f), dtype)
        self.down_proj = param(rngs, (f, d), dtype)
        self.post_mlp_norm = norm_param(d, dtype, 0.0)

    def attend(self, x, fwd, k_cache, v_cache):
        """The attention half (its output normed before the residual): x [N, D] -> ([N, D], k_cache, v_cache)."""
        attn, k_cache, v_cache = self.attention(rms_norm_plus_one(x, self.input_norm[...], self.eps), fwd,
                                                k_cache, v_cache)
        return x + rms_norm_plus_one(attn, self.post_attn_norm[...], self.eps), k_cache, v_cache

    def finish(self, x):
        """The MLP half, row by row: x [M, D] -> [M, D]."""
        h = rms_norm_plus_one(x, self.pre_mlp_norm[...], self.eps)
        h = gated_mlp(h, self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value(), gelu_tanh)
        return x + rms_norm_plus_one(h, self.post_mlp_norm[...], self.eps)


class Gemma2Model(CausalLM):
    final_norm_init = 0.0

    def attention_spec(self, index: int, **overrides) -> AttentionSpec:
        cfg = self.cfg
        return AttentionSpec.from_config(cfg, index, scale=cfg.query_pre_attn_scalar ** -0.5,
                                         softcap=cfg.attn_logit_softcap, **overrides)

    def make_layer(self, index, rngs):
        return Gemma2DecoderLayer(self.cfg, self.attention_spec(index), self.dtype, rngs)

    def embed_tokens(self, tokens):
        x = embed_lookup(self.embed.get_value(), tokens, self.dtype)
        # transformers multiplies by the scale cast to the embedding dtype first.
        return x * jnp.asarray(math.sqrt(self.cfg.hidden_size), jnp.float32).astype(x.dtype)

    def norm(self, x, weight):
        return rms_norm_plus_one(x, weight, self.cfg.rms_norm_eps)

    def logits(self, hidden):
        return softcap(super().logits(hidden), self.cfg.final_logit_softcap)


def gemma_common_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fields Gemma 2 and 3 read alike from config.json, refusing what they don't run."""
    fields = hf_common_fields(cfg, default_act="gelu_pytorch_tanh", act_key="hidden_activation",
                              supported_acts=GELU_TANH)
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{fields['architecture']}: attention_bias=true is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{fields['architecture']}: use_bidirectional_attention=true (an "
                                    "embedding model) is not supported")
    fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    return fields


def config_from_hf(cfg: dict[str, Any]) -> Gemma2Config:
    fields = gemma_common_fields(cfg)
    n = fields["num_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return Gemma2Config(**fields, sliding_window=cfg.get("sliding_window") or 4096, layer_types=tuple(types),
                        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                        attn_logit_softcap=cfg.get("attn_logit_softcapping", 50.0),
                        final_logit_softcap=cfg.get("final_logit_softcapping", 30.0))


def gguf_sliding_layers(meta, num_layers: int, default_period: int) -> tuple[str, ...]:
    """llama.cpp's window pattern: `attention.sliding_window_pattern` as a period n (layer i
    slides iff i % n < n - 1) or per-layer booleans; absent, the family's default period."""
    pattern = meta.get(f"{meta.arch}.attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        return tuple("sliding_attention" if p else "full_attention" for p in pattern)
    n = int(pattern)
    return tuple("sliding_attention" if i % n < n - 1 else "full_attention" for i in range(num_layers))


def gguf_query_pre_attn_scalar(meta, fields: dict, largest_model_layers: int) -> float:
    """`{arch}.attention.scale` (the multiplier itself) when the file has it; otherwise what
    llama.cpp uses: hidden / heads for the largest model, head_dim for the others."""
    scale = meta.get(f"{meta.arch}.attention.scale")
    if scale:
        return float(scale) ** -2
    if fields["num_layers"] == largest_model_layers:
        return fields["hidden_size"] / fields["num_heads"]
    return float(fields["head_dim"])


def config_from_gguf(meta, fields: dict) -> Gemma2Config:
    return Gemma2Config(**fields, sliding_window=int(meta.get("gemma2.attention.sliding_window", 4096)),
                        layer_types=gguf_sliding_layers(meta, fields["num_layers"], 2),
                        query_pre_attn_scalar=gguf_query_pre_attn_scalar(meta, fields, 46),
                        attn_logit_softcap=meta.get("gemma2.attn_logit_softcapping", 50.0),
                        final_logit_softcap=meta.get("gemma2.final_logit_softcapping", 30.0))


HF_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "pre_mlp_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
GGUF_LAYER_WEIGHTS = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "pre_mlp_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "post_ffw_norm.weight": "post_mlp_norm",
}

FAMILY = Family(
    name="gemma2",
    model=Gemma2Model,
    architectures=("Gemma2ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    gguf_architectures={"gemma2": "Gemma2ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_norm_offset=1.0,
)
