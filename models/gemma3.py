"""Gemma 3 (text; `Gemma3ForCausalLM` / `Gemma3TextConfig`): Gemma 2's layer with q/k
norms, a local RoPE for its sliding layers, and no soft-capping by default.

    differences from Gemma 2 (models/gemma2.py):
    q, k = norm(q_heads, q_norm), norm(k_heads, k_norm)     per head, times (1 + w), before RoPE
    sliding layers: `layer_types` (five of every six: sliding_window_pattern 6),
                    RoPE base `rope_local_base_freq` (10000), unscaled
    full layers:    RoPE base `rope_theta` (1e6) with `rope_scaling` (linear 8 on 4B+)
    soft-capping:   only if the config sets it (released checkpoints don't)

Per-layer parameters: Gemma 2's plus

    q_norm  [hd]   self_attn.q_norm.weight   (GGUF attn_q_norm.weight)
    k_norm  [hd]   self_attn.k_norm.weight   (GGUF attn_k_norm.weight)

The vision-language `Gemma3ForConditionalGeneration` checkpoints (4B and up) load as this text
model: `config_from_hf` reads their `text_config`, the loader reads the language model's tensors
(`model.language_model.*` or the Hub's `language_model.model.*`) and leaves the vision tower's,
and `Gemma3Config.vision` keeps the encoder's shape and the image token ids
(`models/siglip.py`, which reads the encoder's own tensors). In GGUF files the local base is
`rope.freq_base_swa` when present, else 10000 as llama.cpp assumes; the 27B (62 layers) scales queries by hidden / heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models import gemma2
from models.config import (RopeScaling, SLIDING_ATTENTION, rope_parameters, rope_scaling_from_dict,
                           rope_theta)
from models.family import Family
from models.rope import rope_cos_sin
from models.siglip import VisionConfig


@dataclasses.dataclass(frozen=True)
class Gemma3Config(gemma2.Gemma2Config):
    rope_local_theta: float = 10000.0  # RoPE base of the sliding layers
    rope_local_scaling: RopeScaling = RopeScaling()
    vision: VisionConfig | None = None  # a vision-language checkpoint's encoder and image tokens


class Gemma3Model(gemma2.Gemma2Model):
    def make_layer(self, index, rngs):
        local = self.cfg.window(index) is not None
        spec = self.attention_spec(index, qk_norm="rms_plus_one", rope="local" if local else "global")
        return gemma2.Gemma2DecoderLayer(self.cfg, spec, self.dtype, rngs)

    def rope(self, positions, valid):
        cfg = self.cfg
        tables = super().rope(positions, valid)
        if SLIDING_ATTENTION in cfg.layer_types:
            tables["local"] = rope_cos_sin(positions, valid, cfg.rope_dim, cfg.rope_local_theta,
                                           cfg.rope_local_scaling)
        return tables


def config_from_hf(cfg: dict[str, Any]) -> Gemma3Config:
    if cfg.get("text_config") is not None or cfg.get("vision_config") is not None:
        return _vision_language_config(cfg)
    fields = gemma2.gemma_common_fields(cfg)
    params = rope_parameters(cfg)
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one dict per layer type
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # Hub configs: rope_theta + rope_scaling for the full layers, rope_local_base_freq
        full, local = params, {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    fields["rope_theta"] = rope_theta(full, 1_000_000.0)
    fields["rope_scaling"] = rope_scaling_from_dict(full, cfg)
    n = fields["num_layers"]
    period = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    types = cfg.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % period else "full_attention" for i in range(n)]
    return Gemma3Config(**fields, sliding_window=cfg.get("sliding_window") or 4096, layer_types=tuple(types),
                        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
                        final_logit_softcap=cfg.get("final_logit_softcapping"),
                        rope_local_theta=rope_theta(local, 10000.0),
                        rope_local_scaling=rope_scaling_from_dict(local, cfg))


def _vision_language_config(cfg: dict[str, Any]) -> Gemma3Config:
    """A `Gemma3ForConditionalGeneration` config: its text model, plus the vision encoder's shape."""
    arch = (cfg.get("architectures") or ["Gemma3ForConditionalGeneration"])[0]
    text = dict(cfg.get("text_config") or {})
    text["architectures"] = [arch]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):  # the wrapper states them for both
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    text_cfg = config_from_hf(text)
    vision = VisionConfig.from_gemma3(cfg) if cfg.get("vision_config") is not None else None
    return dataclasses.replace(text_cfg, vision=vision)


def config_from_gguf(meta, fields: dict) -> Gemma3Config:
    return Gemma3Config(**fields, sliding_window=int(meta.get("gemma3.attention.sliding_window", 4096)),
                        layer_types=gemma2.gguf_sliding_layers(meta, fields["num_layers"], 6),
                        query_pre_attn_scalar=gemma2.gguf_query_pre_attn_scalar(meta, fields, 62),
                        attn_logit_softcap=meta.get("gemma3.attn_logit_softcapping"),
                        final_logit_softcap=meta.get("gemma3.final_logit_softcapping"),
                        rope_local_theta=float(meta.get("gemma3.rope.freq_base_swa", 10000.0)))


QK_NORM_HF = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
QK_NORM_GGUF = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}

FAMILY = Family(
    name="gemma3",
    model=Gemma3Model,
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    config_from_hf=config_from_hf,
    hf_layer_weights={**gemma2.HF_LAYER_WEIGHTS, **QK_NORM_HF},
    gguf_architectures={"gemma3": "Gemma3ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights={**gemma2.GGUF_LAYER_WEIGHTS, **QK_NORM_GGUF},
    gguf_norm_offset=1.0,
)
