"""DeepSeek-V3 (and V3.1, Kimi K2: the same architecture): latent attention and grouped MoE.

    x = x + mla(rms_norm(x))             multi-head latent attention over a latent cache
                                         (models/mla.py), YaRN RoPE (models/yarn.py)
    x = x + moe(rms_norm(x))             sigmoid group-limited top-k experts plus shared
                                         experts (models/moe_grouped.py); the first
                                         `first_k_dense_replace` layers a dense SwiGLU MLP

Per-layer parameters: the norms (input_norm, post_attn_norm as Llama), MLA's
(models/mla.py), and on expert layers the grouped MoE's (models/moe_grouped.py), on dense
layers Llama's gate_proj / up_proj / down_proj.

`head_dim` is qk_rope_head_dim (as transformers sets it): the width RoPE rotates. The KV
cache is sized by `kv_cache_dims` (one latent head of kv_lora_rank + qk_rope_head_dim, no V),
not by num_kv_heads x head_dim. Refused at load: attention_bias (no released checkpoint
has it), a rope type other than default or yarn. The multi-token-prediction layers some
checkpoints append (`model.layers.{num_hidden_layers}`, DeepSeek-V3's layer 61) are skipped
by the loader: they only serve speculative decoding in DeepSeek's own stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from models import llama
from models.config import UnsupportedModelError, hf_common_fields, rope_parameters, rope_theta
from models.decoder import CausalLM
from models.family import Family
from models.layers import gated_mlp, norm_param, param, rms_norm, silu
from models.mla import LatentAttention, MlaSpec
from models.moe_grouped import HF_MOE_WEIGHTS, GroupedMoe, GroupedMoeConfig, grouped_moe_fields
from models.yarn import YarnScaling, softmax_scale, yarn_cos_sin, yarn_from_dict


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(GroupedMoeConfig):
    q_lora_rank: int = 0  # 0: q_proj directly (DeepSeek-V2-Lite's q_lora_rank None)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DeepseekV3Config.{name} must be > 0; got {getattr(self, name)}")
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"DeepseekV3Config.head_dim ({self.head_dim}) must be qk_rope_head_dim "
                             f"({self.qk_rope_head_dim})")

    def kv_cache_dims(self) -> tuple[int, int, int]:
        return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0

    def mla_spec(self) -> MlaSpec:
        return MlaSpec(num_heads=self.num_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                       nope_dim=self.qk_nope_head_dim, rope_dim=self.qk_rope_head_dim, v_dim=self.v_head_dim,
                       scale=softmax_scale((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5, self.yarn),
                       interleave=self.rope_interleave, norm_eps=self.rms_norm_eps)


class DeepseekV3DecoderLayer(nnx.Module, LatentAttention, GroupedMoe):
    def __init__(self, cfg: DeepseekV3Config, index: int, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.input_norm = norm_param(d, dtype)
        self.init_attention(cfg.mla_spec(), d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            self.init_moe(cfg, dtype, rngs)
        else:
            self.gate_proj = param(rngs, (d, cfg.intermediate_size), dtype)
            self.up_proj = param(rngs, (d, cfg.intermediate_size), dtype)
            self.down_proj = param(rngs, (cfg.intermediate_size, d), dtype)

    def __call__(self, x, fwd, k_cache, v_cache):
        """x: [N, D] -> ([N, D], k_cache, v_cache)."""
        attn, k_cache, v_cache = self.attention(rms_norm(x, self.input_norm[...], self.eps), fwd, k_cache, v_cache)
        x = x + attn
        h = rms_norm(x, self.post_attn_norm[...], self.eps)
        if self.is_moe:
            return x + self.moe(h), k_cache, v_cache
        mlp = gated_mlp(h, self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value(), silu)
        return x + mlp, k_cache, v_cache


class DeepseekV3Model(CausalLM):
    def make_layer(self, index, rngs):
        return DeepseekV3DecoderLayer(self.cfg, index, self.dtype, rngs)

    def rope(self, positions, valid):
        cfg = self.cfg
        if cfg.yarn is not None:
            return {"global": yarn_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn)}
        return super().rope(positions, valid)


def config_from_hf(cfg: dict[str, Any]) -> DeepseekV3Config:
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("DeepseekV3ForCausalLM with attention_bias=true is not supported")
    params = rope_parameters(cfg)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise UnsupportedModelError(f"DeepseekV3ForCausalLM: rope type {rope_type!r} is not supported "
                                    "(only default and yarn)")
    yarn = yarn_from_dict(params, cfg) if rope_type == "yarn" else None
    # the common parser knows no yarn: it reads the plain RoPE, the yarn tables are ours
    plain = {**{k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")},
             "rope_theta": rope_theta(params), "head_dim": cfg["qk_rope_head_dim"]}
    fields = hf_common_fields(plain)
    q_lora = cfg.get("q_lora_rank")
    return DeepseekV3Config(**fields, **grouped_moe_fields(cfg, fields["num_layers"]),
                            q_lora_rank=int(q_lora or 0), kv_lora_rank=cfg["kv_lora_rank"],
                            qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                            v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)),
                            yarn=yarn)


HF_LAYER_WEIGHTS = {
    **{k: v for k, v in llama.HF_LAYER_WEIGHTS.items() if k.startswith(("input_", "post_", "mlp."))},
    "self_attn.q_a_proj.weight": "q_a_proj",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b_proj",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "kv_b_proj",
    "self_attn.o_proj.weight": "o_proj",
    **HF_MOE_WEIGHTS,
}

FAMILY = Family(
    name="deepseek_v3",
    model=DeepseekV3Model,
    architectures=("DeepseekV3ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    hf_skips_extra_layers=True,
)
