"""gpt-oss: attention with sinks on alternating sliding / full layers, and biased experts.

    x = x + attention(rms_norm(x))       q/k/v/o all biased; YaRN RoPE; every head has a learned
                                         sink logit joining its softmax's denominator (no value);
                                         `layer_types` alternate a 128-key sliding window and
                                         full attention
    x = x + moe_mlp(rms_norm(x))         router with a bias; softmax over the top-k logits;
                                         experts: down(clamped_swiglu(gate(x), up(x))) with
                                         biases on all three projections (models/moe.py)

    clamped_swiglu(g, u) = (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),
                           g' = min(g, limit)          alpha 1.702, limit 7.0

Per-layer parameters (HF names after `model.layers.{i}.`):

    q/k/v/o_proj, q/k/v_bias           self_attn.{q,k,v,o}_proj.weight / .bias
    o_bias       [D]                   self_attn.o_proj.bias
    sinks        [H]                   self_attn.sinks
    router       [D, E]                mlp.router.weight
    router_bias  [E]                   mlp.router.bias
    experts_gate [E, D, F]             mlp.experts.gate_up_proj [E, D, 2F], even columns
    experts_up   [E, D, F]             ... odd columns (HF stores [in, out] here: no transpose)
    experts_gate_bias, experts_up_bias [E, F]   mlp.experts.gate_up_proj_bias [E, 2F], likewise
    experts_down [E, F, D]             mlp.experts.down_proj
    experts_down_bias [E, D]           mlp.experts.down_proj_bias

The fused gate/up is split at load into the two stacks Mixtral has (and llama.cpp writes),
so sharding, int8 quantization and the expert tiles treat them as every other family's.

GGUF (`gpt-oss`, as llama.cpp's converter writes it): gate and up already split and each
expert transposed (`ffn_{gate,up,down}_exps`, usually MXFP4: see below), their
biases `ffn_*_exps.bias` [E, n], the router `ffn_gate_inp` (+ bias), `attn_sinks`, and
the second norm named `post_attention_norm`.

Sliding layers mask by position (models/attention.py) and keep their K/V in the sliding
KV group's window-sized pool (ferrox_jax/kv_groups.py). Released checkpoints store the experts in MXFP4
(`quantization_config.quant_method: mxfp4`, `*_blocks` + `*_scales`; GGUFs as MXFP4 expert
stacks); any other quantization method is refused. Under `--quantization gguf` (what `auto`
picks on one x86 CPU device with ferrox's kernels) the experts stay MXFP4 blocks,
u8[E, out, in / 32 * 17] (HF blocks repacked at load, `models/loaders/mxfp4.py`; a GGUF's
as stored), each expert's tile multiplied by the MXFP4 kernel from its own slice
(`models/gguf_mxfp4.py`); otherwise, and on TPU / GPU, they are dequantized to float at load.
Either way the values are the checkpoint's exactly (every MXFP4 weight is exact in float32).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import llama
from models.config import FULL_ATTENTION, SLIDING_ATTENTION, UnsupportedModelError, hf_common_fields, hf_layer_types
from models.decoder import CausalLM
from models.family import ExpertStack, Family
from models.layers import AttentionSpec, TwoHalves, norm_param, param, rms_norm, silu
from models.moe import GGUF_EXPERT_WEIGHTS, ExpertBiases, MoeConfig, moe_mlp


@dataclasses.dataclass(frozen=True)
class GptOssConfig(MoeConfig):
    """MoeConfig plus the experts' clamped SwiGLU."""

    swiglu_alpha: float = 1.702  # sigmoid gain
    swiglu_limit: float = 7.0  # gate clamped above, up clamped both sides


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's expert gating: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    g = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * (g * jax.nn.sigmoid(g * alpha))


class GptOssDecoderLayer(nnx.Module, TwoHalves):
    supports_expert_parallel = True  # models/moe_ep.py: the stacks and their biases may be split by expert
    expert_parallel = None  # set by models/moe_ep.py:enable_expert_parallel

    def __init__(self, cfg: GptOssConfig, attention: AttentionSpec, dtype, rngs: nnx.Rngs):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.eps, self.top_k = cfg.rms_norm_eps, cfg.num_experts_per_tok
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.input_norm = norm_param(d, dtype)
        self.init_attention(attention, d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype)
        self.router = param(rngs, (d, e), dtype)
        self.router_bias = param(rngs, (e,), dtype)
        self.experts_gate = param(rngs, (e, d, f), dtype)
        self.experts_up = param(rngs, (e, d, f), dtype)
        self.experts_down = param(rngs, (e, f, d), dtype)
        self.experts_gate_bias = param(rngs, (e, f), dtype)
        self.experts_up_bias = param(rngs, (e, f), dtype)
        self.experts_down_bias = param(rngs, (e, d), dtype)

    def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return clamped_swiglu(gate, up, self.alpha, self.limit)

    def finish(self, x):
        """The experts' half, token by token: x [M, D] -> [M, D]."""
        h = rms_norm(x, self.post_attn_norm[...], self.eps)
        biases = ExpertBiases(self.experts_gate_bias[...], self.experts_up_bias[...], self.experts_down_bias[...])
        y = moe_mlp(h, self.router[...], self.experts_gate.get_value(), self.experts_up.get_value(),
                    self.experts_down.get_value(), top_k=self.top_k, normalize=True, act=silu,
                    router_bias=self.router_bias[...], biases=biases, glu=self.glu,
                    expert_parallel=self.expert_parallel)
        return x + y


class GptOssModel(CausalLM):
    def make_layer(self, index, rngs):
        spec = AttentionSpec.from_config(self.cfg, index, o_bias=True, sinks=True)
        return GptOssDecoderLayer(self.cfg, spec, self.dtype, rngs)


def config_from_hf(cfg: dict[str, Any]) -> GptOssConfig:
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise UnsupportedModelError(f"GptOssForCausalLM: quantization_config.quant_method {quant!r} is not "
                                    "supported (only mxfp4 experts, or float weights)")
    fields = hf_common_fields(cfg)
    window, types = hf_layer_types(cfg, fields["num_layers"], window_applies=True)
    return GptOssConfig(**fields, attention_bias=bool(cfg.get("attention_bias", True)), sliding_window=window,
                        layer_types=types, num_experts=cfg["num_local_experts"],
                        num_experts_per_tok=cfg["num_experts_per_tok"],
                        moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def config_from_gguf(meta, fields: dict) -> GptOssConfig:
    """`gpt-oss` GGUFs: experts `expert_feed_forward_length` wide, the window on even layers
    (llama.cpp's pattern 2: layer 0 sliding, as `layer_types` in HF configs), YaRN with
    `truncate: false` as every gpt-oss config sets it (the file does not record it). The
    file records neither SwiGLU constant: llama.cpp uses gpt-oss's 1.702 and 7.0, so do we."""
    arch, n = meta.arch, fields["num_layers"]
    scaling = fields["rope_scaling"]
    if scaling.rope_type == "yarn":
        fields = {**fields, "rope_scaling": dataclasses.replace(scaling, truncate=False)}
    window = int(meta.require(f"{arch}.attention.sliding_window"))
    return GptOssConfig(**fields, attention_bias=True, sliding_window=window,
                        layer_types=tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(n)),
                        num_experts=int(meta.require(f"{arch}.expert_count")),
                        num_experts_per_tok=int(meta.require(f"{arch}.expert_used_count")),
                        moe_intermediate_size=int(meta.require(f"{arch}.expert_feed_forward_length")),
                        norm_topk_prob=True)


HF_LAYER_WEIGHTS = {
    **{k: v for k, v in llama.HF_LAYER_WEIGHTS.items() if k.startswith(("self_attn.", "input_", "post_"))},
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.sinks": "sinks",
    "mlp.router.weight": "router",
    "mlp.router.bias": "router_bias",
    "mlp.experts.gate_up_proj": ExpertStack(("experts_gate", "experts_up")),
    "mlp.experts.gate_up_proj_bias": ExpertStack(("experts_gate_bias", "experts_up_bias")),
    "mlp.experts.down_proj": ExpertStack(("experts_down",)),
    "mlp.experts.down_proj_bias": ExpertStack(("experts_down_bias",)),
}

GGUF_LAYER_WEIGHTS = {
    **{k: v for k, v in llama.GGUF_LAYER_WEIGHTS.items() if k.startswith("attn_")},
    "attn_output.bias": "o_bias",
    "attn_sinks.weight": "sinks",
    "post_attention_norm.weight": "post_attn_norm",
    **GGUF_EXPERT_WEIGHTS,
    "ffn_gate_inp.bias": "router_bias",
    "ffn_gate_exps.bias": ExpertStack(("experts_gate_bias",)),  # [E, F]: already ours
    "ffn_up_exps.bias": ExpertStack(("experts_up_bias",)),
    "ffn_down_exps.bias": ExpertStack(("experts_down_bias",)),
}

FAMILY = Family(
    name="gpt_oss",
    model=GptOssModel,
    architectures=("GptOssForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    gguf_architectures={"gpt-oss": "GptOssForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_experts=True,
)
