"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a mixture of experts.

    x = x + attention(rms_norm(x))              q/k norms as Qwen3 (models/qwen3.py)
    x = x + moe_mlp(rms_norm(x))                top-k (8 of 128) softmax routing; the top-k
                                                weights renormalised iff norm_topk_prob
    layers in `mlp_only_layers`, or off the `decoder_sparse_step` beat, keep a dense
    SwiGLU MLP of `intermediate_size` (released checkpoints have none)

Per-layer parameters: Qwen3's attention and norms, and on expert layers

    router        [D, E]      mlp.gate.weight
    experts_gate  [E, D, F]   mlp.experts.{e}.gate_proj.weight   (stacked; F = moe_intermediate_size)
    experts_up    [E, D, F]   mlp.experts.{e}.up_proj.weight
    experts_down  [E, F, D]   mlp.experts.{e}.down_proj.weight
on dense layers Llama's gate_proj / up_proj / down_proj.

GGUF (`qwen3moe`): Qwen3's names plus the stacked experts of models/moe.py's
GGUF_EXPERT_WEIGHTS.
"""

from __future__ import annotations

from typing import Any

from models import llama, qwen3
from models.config import hf_common_fields
from models.decoder import CausalLM
from models.family import Family
from models.layers import AttentionSpec
from models.mixtral import MoeDecoderLayer
from models.moe import GGUF_EXPERT_WEIGHTS, MoeConfig


class Qwen3MoeModel(CausalLM):
    def make_layer(self, index, rngs):
        spec = AttentionSpec.from_config(self.cfg, index, qk_norm="rms")
        if self.cfg.is_moe_layer(index):
            return MoeDecoderLayer(self.cfg, spec, self.dtype, rngs)
        return llama.LlamaDecoderLayer(self.cfg, index, self.dtype, rngs, attention=spec)


def config_from_hf(cfg: dict[str, Any]) -> MoeConfig:
    fields = hf_common_fields(cfg)
    n = fields["num_layers"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(n) if i in only_mlp or (i + 1) % step)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return MoeConfig(**fields, attention_bias=bool(cfg.get("attention_bias", False)), sliding_window=window,
                     layer_types=("sliding_attention",) * n if window else (),
                     # Hub configs say num_experts; transformers 5 saves num_local_experts
                     num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                     num_experts_per_tok=cfg["num_experts_per_tok"],
                     moe_intermediate_size=cfg["moe_intermediate_size"],
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)


def config_from_gguf(meta, fields: dict) -> MoeConfig:
    """`qwen3moe` GGUFs: experts `expert_feed_forward_length` wide; the top-k weights always
    renormalised (llama.cpp's qwen3moe graph does, whatever norm_topk_prob was: the file
    does not record it); a layer without `ffn_gate_inp` is a dense one."""
    arch, n = meta.arch, fields["num_layers"]
    return MoeConfig(**fields, attention_bias=meta.has_tensor("blk.0.attn_q.bias"),
                     num_experts=int(meta.require(f"{arch}.expert_count")),
                     num_experts_per_tok=int(meta.require(f"{arch}.expert_used_count")),
                     moe_intermediate_size=int(meta.require(f"{arch}.expert_feed_forward_length")),
                     norm_topk_prob=True,
                     dense_layers=tuple(i for i in range(n) if not meta.has_tensor(f"blk.{i}.ffn_gate_inp.weight")))


HF_LAYER_WEIGHTS = {
    **llama.HF_LAYER_WEIGHTS,
    **qwen3.QK_NORM_HF,
    "mlp.gate.weight": "router",
    "mlp.experts.{e}.gate_proj.weight": "experts_gate",
    "mlp.experts.{e}.up_proj.weight": "experts_up",
    "mlp.experts.{e}.down_proj.weight": "experts_down",
}

FAMILY = Family(
    name="qwen3_moe",
    model=Qwen3MoeModel,
    architectures=("Qwen3MoeForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    gguf_architectures={"qwen3moe": "Qwen3MoeForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights={**llama.GGUF_LAYER_WEIGHTS, **qwen3.QK_NORM_GGUF, **GGUF_EXPERT_WEIGHTS},
    gguf_experts=True,
)
