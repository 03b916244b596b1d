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

GGUF (`deepseek2`, llama.cpp's name for DeepSeek-V2/V3 and Kimi K2), as its converter writes it:

    attn_q_a / attn_q_a_norm / attn_q_b     q_a_proj / q_a_norm / q_b_proj (attn_q: q_proj)
    attn_kv_a_mqa / attn_kv_a_norm          kv_a_proj / kv_a_norm
    attn_k_b [H, r, dn] + attn_v_b [H, dv, r]   kv_b_proj (newer converters split it for
                                            their absorbed attention; older ones wrote attn_kv_b)
    attn_output, attn_norm, ffn_norm        o_proj, input_norm, post_attn_norm
    ffn_gate_inp / exp_probs_b.bias         router / router_bias (e_score_correction_bias)
    ffn_{gate,up,down}_exps [E, out, in]    the expert stacks
    ffn_{gate,up,down}_shexp, ffn_*         the shared expert; the dense layers' MLP

Metadata: MLA as MQA (`head_count_kv` 1, `key_length` r + dr, `value_length` r) with the
real widths in `key_length_mla` (dn + dr) and `value_length_mla` (dv) (older files: in
key_length / value_length); `kv_lora_rank`, `q_lora_rank` (absent: q_proj); the routing in
`expert_group_count`, `expert_group_used_count`, `expert_weights_scale`,
`expert_weights_norm`, `expert_shared_count`, `leading_dense_block_count`,
`expert_gating_func` (sigmoid; DeepSeek-V2's softmax is refused); YaRN in `rope.scaling.*`
with mscale_all_dim as `yarn_log_multiplier` / 0.1 (llama.cpp's convention); the layers are
`block_count` less `nextn_predict_layers` (the multi-token-prediction block a converter may
append at block n, `blk.{n}.nextn.*`, read only for `--speculative mtp`: models/deepseek_mtp.py). A file cannot
say mscale apart from mscale_all_dim (every released config has them equal): the YaRN
attention factor is `rope.scaling.yarn_attn_factor` when written, else 1. RoPE pairs are
interleaved (llama.cpp runs deepseek2 with its NORM rope, DeepSeek's `rope_interleave`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from models import llama
import numpy as np

from models.config import RopeScaling, UnsupportedModelError, hf_common_fields, rope_parameters, rope_theta
from models.decoder import CausalLM
from models.family import Family
from models.layers import gated_mlp, norm_param, param, rms_norm, silu
from models.mla import EXPAND_PREFILL_FROM, LatentAttention, MlaSpec
from models.moe_grouped import (GGUF_MOE_WEIGHTS, GGUF_SIGMOID_GATING, HF_MOE_WEIGHTS, GroupedMoe, GroupedMoeConfig,
                                 grouped_moe_fields)
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
                       interleave=self.rope_interleave, norm_eps=self.rms_norm_eps,
                       expand_from=EXPAND_PREFILL_FROM)


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

GGUF_LAYER_WEIGHTS = {
    **{k: v for k, v in llama.GGUF_LAYER_WEIGHTS.items() if k.startswith(("attn_norm", "ffn_", "attn_output"))},
    "attn_q_a.weight": "q_a_proj",
    "attn_q_a_norm.weight": "q_a_norm",
    "attn_q_b.weight": "q_b_proj",
    "attn_q.weight": "q_proj",
    "attn_kv_a_mqa.weight": "kv_a_proj",
    "attn_kv_a_norm.weight": "kv_a_norm",
    "attn_kv_b.weight": "kv_b_proj",
    **GGUF_MOE_WEIGHTS,
}


def config_from_gguf(meta, fields: dict) -> DeepseekV3Config:
    """A `deepseek2` file's config (module docstring: the keys)."""
    a = meta.arch
    gating = int(meta.get(f"{a}.expert_gating_func", GGUF_SIGMOID_GATING))
    if gating != GGUF_SIGMOID_GATING:
        raise UnsupportedModelError(f"deepseek2 GGUF with expert_gating_func {gating} (softmax routing, "
                                    "DeepSeek-V2) is not supported; DeepSeek-V3 / Kimi K2 route by sigmoid")
    rope_dim = int(meta.require(f"{a}.rope.dimension_count"))
    if meta.get(f"{a}.attention.key_length_mla") is not None:
        qk_dim, v_dim = int(meta.get(f"{a}.attention.key_length_mla")), int(meta.require(f"{a}.attention.value_length_mla"))
    else:  # older converters: the per-head widths in key_length / value_length
        qk_dim, v_dim = int(meta.require(f"{a}.attention.key_length")), int(meta.require(f"{a}.attention.value_length"))
    yarn = None
    if str(meta.get(f"{a}.rope.scaling.type", "none")) == "yarn":
        log_mul = meta.get(f"{a}.rope.scaling.yarn_log_multiplier")
        m_all = float(log_mul) / 0.1 if log_mul else None
        params = {"factor": meta.get(f"{a}.rope.scaling.factor"), "mscale": m_all, "mscale_all_dim": m_all,
                  "original_max_position_embeddings": meta.get(f"{a}.rope.scaling.original_context_length"),
                  "beta_fast": meta.get(f"{a}.rope.scaling.yarn_beta_fast"),
                  "beta_slow": meta.get(f"{a}.rope.scaling.yarn_beta_slow"),
                  "attention_factor": meta.get(f"{a}.rope.scaling.yarn_attn_factor")}
        yarn = yarn_from_dict(params, {"max_position_embeddings": fields["max_position_embeddings"]})
    n = fields["num_layers"] - int(meta.get(f"{a}.nextn_predict_layers", 0) or 0)  # the MTP blocks after them
    if n <= 0:
        raise UnsupportedModelError(f"GGUF {a} holds only multi-token-prediction layers; serve the main model's file")
    first_dense = int(meta.get(f"{a}.leading_dense_block_count", 0))
    # the plain RoPE, as from config.json (the yarn tables are ours); heads as HF counts them
    fields = {**fields, "num_layers": n, "head_dim": rope_dim, "num_kv_heads": fields["num_heads"], "rope_scaling": RopeScaling(),
              "rotary_dim": None}
    q_lora = meta.get(f"{a}.attention.q_lora_rank")
    return DeepseekV3Config(
        **fields, num_experts=int(meta.require(f"{a}.expert_count")),
        num_experts_per_tok=int(meta.require(f"{a}.expert_used_count")),
        moe_intermediate_size=int(meta.require(f"{a}.expert_feed_forward_length")),
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", False)),
        dense_layers=tuple(range(min(first_dense, n))),
        n_group=int(meta.get(f"{a}.expert_group_count", 1) or 1),
        topk_group=int(meta.get(f"{a}.expert_group_used_count", 1) or 1),
        routed_scaling_factor=float(meta.get(f"{a}.expert_weights_scale", 1.0)),
        n_shared_experts=int(meta.get(f"{a}.expert_shared_count", 0)),
        q_lora_rank=int(q_lora or 0), kv_lora_rank=int(meta.require(f"{a}.attention.kv_lora_rank")),
        qk_nope_head_dim=qk_dim - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=v_dim, rope_interleave=True,
        yarn=yarn)


def merge_gguf_kv_b(tensors: dict, cfg=None) -> None:
    """Newer converters' `attn_k_b` [H, r, dn] and `attn_v_b` [H, dv, r] back into our
    kv_b_proj [r, H*(dn+dv)] (each head's k_nope columns, then its v), in place; the two
    came through the loader as unknown names ("gguf:blk.{i}.attn_k_b.weight"). The
    multi-token-prediction blocks after `cfg.num_layers` are dropped (read for
    `--speculative mtp` by models/loaders/gguf_mtp.py)."""
    for name in list(tensors) if cfg is not None else ():
        if name.startswith(("gguf:blk.", "layers.")) and int(name.split(".")[1]) >= cfg.num_layers:
            del tensors[name]
    for name in [n for n in tensors if n.startswith("gguf:blk.") and n.endswith(".attn_k_b.weight")]:
        layer = name.split(".")[1]
        v_name = name.replace("attn_k_b", "attn_v_b")
        if v_name not in tensors:
            continue  # reported as unexpected by the build, with its name

        def read(k_load=tensors.pop(name), v_load=tensors.pop(v_name)):
            k_b, v_b = np.asarray(k_load()), np.asarray(v_load())  # [H, r, dn], [H, dv, r]
            per_head = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # [H, dn+dv, r]: HF's rows
            return np.ascontiguousarray(per_head.reshape(-1, per_head.shape[-1]).T)

        tensors[f"layers.{layer}.kv_b_proj"] = read


FAMILY = Family(
    name="deepseek_v3",
    model=DeepseekV3Model,
    architectures=("DeepseekV3ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    hf_skips_extra_layers=True,
    gguf_architectures={"deepseek2": "DeepseekV3ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_experts=True,
    gguf_merge=merge_gguf_kv_b,
)
