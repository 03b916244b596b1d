"""Llama family: Llama 2/3, Mistral, Qwen2 (and the layer Phi-3 reuses).

    x = x + attention(rms_norm(x))          q/k/v (+ bias: Qwen2), RoPE, causal or sliding
    x = x + swiglu_mlp(rms_norm(x))         down(silu(gate(x)) * up(x))

Mistral's `sliding_window` applies to every layer; Qwen2's only with
`use_sliding_window`, on the layers `layer_types` (or `max_window_layers`) marks.

Per-layer parameters (our layouts, x @ W; HF name after `model.layers.{i}.`):

    input_norm     [D]          input_layernorm.weight
    q_proj         [D, H*hd]    self_attn.q_proj.weight   (+ q_bias [H*hd] when attention_bias)
    k_proj         [D, K*hd]    self_attn.k_proj.weight   (+ k_bias [K*hd])
    v_proj         [D, K*hd]    self_attn.v_proj.weight   (+ v_bias [K*hd])
    o_proj         [H*hd, D]    self_attn.o_proj.weight
    post_attn_norm [D]          post_attention_layernorm.weight
    gate_proj      [D, F]       mlp.gate_proj.weight
    up_proj        [D, F]       mlp.up_proj.weight
    down_proj      [F, D]       mlp.down_proj.weight

q/k rows are in HF's rotate-half RoPE order (the GGUF loader undoes llama.cpp's
interleaved permutation for `llama` files).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from models.config import ModelConfig, UnsupportedModelError, hf_common_fields, hf_layer_types
from models.decoder import CausalLM
from models.family import Family
from models.layers import AttentionSpec, TwoHalves, gated_mlp, norm_param, param, rms_norm, silu


class LlamaDecoderLayer(nnx.Module, TwoHalves):
    def __init__(self, cfg: ModelConfig, index: int, dtype, rngs: nnx.Rngs, attention: AttentionSpec | None = None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.input_norm = norm_param(d, dtype)
        self.init_attention(attention or AttentionSpec.from_config(cfg, index), d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype)
        self.gate_proj = param(rngs, (d, f), dtype)
        self.up_proj = param(rngs, (d, f), dtype)
        self.down_proj = param(rngs, (f, d), dtype)

    def finish(self, x):
        """The MLP half, row by row: x [M, D] -> [M, D]."""
        h = rms_norm(x, self.post_attn_norm[...], self.eps)
        return x + gated_mlp(h, self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value(), silu)


class LlamaModel(CausalLM):
    def make_layer(self, index, rngs):
        return LlamaDecoderLayer(self.cfg, index, self.dtype, rngs)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    fields = hf_common_fields(cfg)
    arch = fields["architecture"]
    is_qwen2 = arch == "Qwen2ForCausalLM"
    if is_qwen2:
        window, types = hf_layer_types(qwen_layer_types(cfg), fields["num_layers"],
                                       window_applies=bool(cfg.get("use_sliding_window")))
    else:  # Llama has no window; Mistral's covers every layer
        window = cfg.get("sliding_window") or None
        types = ("sliding_attention",) * fields["num_layers"] if window else ()
    return ModelConfig(**fields, attention_bias=bool(cfg.get("attention_bias", is_qwen2)),
                       sliding_window=window, layer_types=types)


def qwen_layer_types(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen configs without `layer_types` window the layers from `max_window_layers` on."""
    if cfg.get("layer_types") is not None or not cfg.get("use_sliding_window"):
        return cfg
    first = cfg.get("max_window_layers", 0)
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return {**cfg, "layer_types": types}


def config_from_gguf(meta, fields: dict) -> ModelConfig:
    """llama/qwen2 GGUFs: a llama file's sliding_window (Mistral) covers every layer; qwen2
    files carry the window of models that never enable it (use_sliding_window=false)."""
    window = meta.get(f"{meta.arch}.attention.sliding_window") if meta.arch == "llama" else None
    if fields.get("rotary_dim") is not None:
        raise UnsupportedModelError(f"partial rotary embedding (rope.dimension_count {fields['rotary_dim']} < "
                                    f"head_dim {fields['head_dim']}) is not supported for {meta.arch}")
    return ModelConfig(**fields, attention_bias=meta.has_tensor("blk.0.attn_q.bias"),
                       sliding_window=window or None,
                       layer_types=("sliding_attention",) * fields["num_layers"] if window else ())


HF_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attn_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
GGUF_LAYER_WEIGHTS = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attn_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}

FAMILY = Family(
    name="llama",
    model=LlamaModel,
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    gguf_architectures={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_non_parameters=("rope_freqs.weight",),
    gguf_qk_permuted=("llama",),
)
