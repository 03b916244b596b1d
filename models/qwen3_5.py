"""Qwen3.5 (text): Gated DeltaNet layers mixed with gated full-attention layers.

    x = x + mixer(norm(x));  x = x + swiglu_mlp(norm(x))          norm: RMSNorm times (1 + w)
    mixer, per `layer_types`:
      linear_attention  Gated DeltaNet (models/deltanet.py): a short causal conv and the gated
                        delta rule over a per-row recurrent state; no KV cache
      full_attention    q_proj is twice as wide: per head [query | gate]; q/k RMSNorm (1 + w)
                        per head, partial RoPE (the first head_dim * partial_rotary_factor dims,
                        rotate-half), paged attention, then out * sigmoid(gate) before o_proj

Qwen3.5's RoPE is multimodal (mrope sections over t/h/w positions); a text-only sequence
has the same position on all three, where it is plain RoPE. Only the full-attention layers
hold K/V (`kv_layout`: one pair each); the DeltaNet layers' states live in the engine's state
pool (`ferrox_jax/state_pool.py`), one slot per running row, passed to the forward beside
the paged cache (`RecurrentStates`). Under tensor parallelism the gated attention splits by
head as any attention (q_proj's [query | gate] rows are per head, so head-major), and the
DeltaNet layers and their states by key-head group (models/deltanet.py).

Per-layer parameters (HF name after `model.layers.{i}.`), besides DeltaNet's:

    input_norm      [D]            input_layernorm.weight            (stored w, applied 1 + w)
    q_proj          [D, 2*H*hd]    self_attn.q_proj.weight           per head: query rows, then gate rows
    k_proj, v_proj  [D, K*hd]      self_attn.{k,v}_proj.weight
    o_proj          [H*hd, D]      self_attn.o_proj.weight
    q_norm, k_norm  [hd]           self_attn.{q,k}_norm.weight       (1 + w)
    post_attn_norm  [D]            post_attention_layernorm.weight   (1 + w)
    gate/up/down_proj              mlp.{gate,up,down}_proj.weight

The checkpoints' multi-token-prediction block (`mtp.*`, `MTP_PREFIXES`) is skipped by the
model's loader and read by `--speculative mtp` alone (models/qwen3_5_mtp.py).

GGUF files (llama.cpp's `qwen35`) are read by models/qwen3_5_gguf.py: its keys, and the layouts
its converter changed (norms as 1 + w, A_log as -exp(A_log), value heads reordered) undone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import qwen3_5_gguf
from models.attention import write_kv
from models.config import ModelConfig, UnsupportedModelError, hf_common_fields, rope_parameters
from models.decoder import CausalLM
from models.deltanet import DeltaNetSpec, GatedDeltaNet, RecurrentStates, state_rows
from models.family import Family
from models.layers import (AttentionSpec, ForwardContext, attend, gated_mlp, norm_param, param, project,
                           project_many, rms_norm_plus_one, silu)
from models.rope import apply_rope

LINEAR_ATTENTION = "linear_attention"
MTP_PREFIXES = ("mtp.", "model.mtp.")  # the multi-token-prediction block's tensors (models/qwen3_5_mtp.py)
FULL_ATTENTION = "full_attention"


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    """ModelConfig plus the DeltaNet shapes and which layers are DeltaNet ones."""

    linear_layers: tuple[bool, ...] = ()  # per layer: True for a DeltaNet layer, False for full attention
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    fused_deltanet: bool = False  # Qwen3-Next's fused in_proj_qkvz / in_proj_ba (models/deltanet.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.linear_layers) != self.num_layers:
            raise ValueError(f"Qwen3_5Config.linear_layers has {len(self.linear_layers)} entries for "
                             f"{self.num_layers} layers")
        if all(self.linear_layers):
            raise UnsupportedModelError("Qwen3.5: every layer is linear attention; at least one full-attention "
                                        "layer is needed (it holds the paged KV cache)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"Qwen3_5Config.linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                             f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"Qwen3_5Config.linear_conv_kernel_dim must be >= 2; got {self.linear_conv_kernel_dim}")

    def deltanet_spec(self) -> DeltaNetSpec:
        return DeltaNetSpec(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                            self.linear_value_head_dim, self.linear_conv_kernel_dim, self.rms_norm_eps,
                            self.fused_deltanet)

    def recurrent_specs(self) -> tuple[DeltaNetSpec, ...]:
        """One spec per DeltaNet layer, in layer order (the state pool's arrays)."""
        return (self.deltanet_spec(),) * sum(self.linear_layers)

    def kv_layout(self) -> tuple[tuple[int, int, int], ...]:
        """One K/V pair per full-attention layer; DeltaNet layers keep none."""
        return (self.kv_cache_dims(),) * (self.num_layers - sum(self.linear_layers))

    def lora_widths(self) -> int:
        """As `ModelConfig.lora_widths`, with a DeltaNet layer's five projections (in_proj_qkv,
        in_proj_z, in_proj_b, in_proj_a, out_proj; Qwen3-Next's fused pair is no wider) in
        place of attention's four, and the gated attention's q_proj twice as wide."""
        h, s, linear = self.hidden_size, self.deltanet_spec(), sum(self.linear_layers)
        mlp = 3 * (h + self.intermediate_size)
        attention = super().lora_widths() // self.num_layers - mlp + self.num_heads * self.head_dim  # + q's gate
        deltanet = (h + s.conv_dim) + (h + s.value_dim) + 2 * (h + s.num_v_heads) + (s.value_dim + h)
        return linear * deltanet + (self.num_layers - linear) * attention + self.num_layers * mlp


class GatedAttention:
    """Mix-in: Qwen3.5's full attention (a gate beside each query head, q/k norms, partial RoPE)."""

    def init_gated_attention(self, spec: AttentionSpec, hidden: int, dtype, rngs: nnx.Rngs) -> None:
        self.attn_spec = spec
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q_proj = param(rngs, (hidden, 2 * q_dim), dtype)
        self.k_proj = param(rngs, (hidden, kv_dim), dtype)
        self.v_proj = param(rngs, (hidden, kv_dim), dtype)
        self.o_proj = param(rngs, (q_dim, hidden), dtype)
        self.q_norm = norm_param(spec.head_dim, dtype, 0.0)
        self.k_norm = norm_param(spec.head_dim, dtype, 0.0)

    def gated_attention(self, h: jax.Array, fwd: ForwardContext, k_cache: jax.Array, v_cache: jax.Array):
        spec = self.attn_spec
        n, heads, hd = h.shape[0], spec.num_heads, spec.head_dim
        qg, k, v = project_many(h, [self.q_proj.get_value(), self.k_proj.get_value(), self.v_proj.get_value()])
        qg = qg.reshape(n, heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, heads * hd)
        q = rms_norm_plus_one(q, self.q_norm[...], spec.norm_eps)
        k = rms_norm_plus_one(k.reshape(n, spec.num_kv_heads, hd), self.k_norm[...], spec.norm_eps)
        v = v.reshape(n, spec.num_kv_heads, hd)
        cos, sin = fwd.rope[spec.rope]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, fwd.kv_blocks, fwd.kv_offsets)
        out = attend(spec, q, k_cache, v_cache, fwd)
        out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(h.dtype)
        return project(out, self.o_proj.get_value()), k_cache, v_cache


class Qwen3_5DecoderLayer(nnx.Module, GatedAttention, GatedDeltaNet):
    def __init__(self, cfg: Qwen3_5Config, index: int, dtype, rngs: nnx.Rngs, dense: bool = True):
        """`dense`: this layer's MLP is a dense SwiGLU (a subclass adds experts otherwise)."""
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.is_linear = cfg.linear_layers[index]
        self.input_norm = norm_param(d, dtype, 0.0)
        if self.is_linear:
            self.init_deltanet(cfg.deltanet_spec(), d, dtype, rngs)
        else:
            self.init_gated_attention(AttentionSpec.from_config(cfg, index, qk_norm="rms_plus_one"), d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype, 0.0)
        if dense:
            self.gate_proj = param(rngs, (d, f), dtype)
            self.up_proj = param(rngs, (d, f), dtype)
            self.down_proj = param(rngs, (f, d), dtype)

    def __call__(self, x, fwd, a, b, slots=None):
        """x [N, D] -> (x, a, b): (k_cache, v_cache) for a full-attention layer, its (conv,
        recurrent) state pool arrays for a DeltaNet one (`slots`: `models/deltanet.py:StateRows`)."""
        h = rms_norm_plus_one(x, self.input_norm[...], self.eps)
        if self.is_linear:
            out, a, b = self.deltanet(h, fwd, a, b, slots)
        else:
            out, a, b = self.gated_attention(h, fwd, a, b)
        x = x + out
        return x + self.feed_forward(rms_norm_plus_one(x, self.post_attn_norm[...], self.eps)), a, b

    def feed_forward(self, h):
        """The MLP (Qwen3-Next's expert layers override it)."""
        return gated_mlp(h, self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value(), silu)


class Qwen3_5Model(CausalLM):
    final_norm_init = 0.0

    def make_layer(self, index, rngs):
        return Qwen3_5DecoderLayer(self.cfg, index, self.dtype, rngs)

    def norm(self, x, weight):
        return rms_norm_plus_one(x, weight, self.cfg.rms_norm_eps)

    def __call__(self, tokens, positions, valid, k_caches, v_caches, block_tables, segment_tokens, images=None,
                 states: RecurrentStates | None = None, state_slots: jax.Array | None = None):
        """As `CausalLM.__call__`, over the K/V of the full-attention layers (`kv_layout`) and
        the DeltaNet layers' state pool: `states` with `state_slots` i32[R] (each padded row's
        slot, rows in segment order). Returns (hidden, k_caches, v_caches, states)."""
        cfg = self.cfg
        arrays = len(cfg.kv_layout())
        if len(k_caches) != arrays or len(v_caches) != arrays:
            raise ValueError(f"expected {arrays} K and V cache arrays; got {len(k_caches)} and {len(v_caches)}")
        if images is not None:
            raise ValueError("Qwen3.5 is served as a text model: no image inputs")
        if states is None or state_slots is None:
            raise ValueError("Qwen3.5's DeltaNet layers need the state pool (states and state_slots)")
        fwd = ForwardContext.build(positions, valid, block_tables, segment_tokens, k_caches[0].shape[2], self.rope,
                                   self.decode_attention)
        x = self.embed_tokens(tokens)
        ks, vs = list(k_caches), list(v_caches)
        convs, recs = list(states.conv), list(states.recurrent)
        rows = state_rows(fwd, state_slots, states)  # where each row's states are read and written
        kv_index = state_index = 0
        for layer in self.layers:
            if layer.is_linear:
                i = state_index
                x, convs[i], recs[i] = layer(x, fwd, convs[i], recs[i], rows)
                state_index += 1
            else:
                i = kv_index
                x, ks[i], vs[i] = layer(x, fwd, ks[i], vs[i])
                kv_index += 1
        return (self.norm(x, self.final_norm[...]), tuple(ks), tuple(vs),
                RecurrentStates(conv=tuple(convs), recurrent=tuple(recs), positions=rows.positions))


def config_from_hf(cfg: dict[str, Any]) -> Qwen3_5Config:
    return Qwen3_5Config(**hf_fields(cfg))


def config_from_gguf(meta, fields: dict) -> Qwen3_5Config:
    return Qwen3_5Config(**qwen3_5_gguf.config_fields(meta, fields))


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `Qwen3_5Config` fields of a config.json (Qwen3-Next's too)."""
    fields = hf_common_fields(cfg)
    n = fields["num_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise UnsupportedModelError(f"Qwen3.5 layer_types {unknown} are not supported; supported: "
                                    f"{LINEAR_ATTENTION}, {FULL_ATTENTION}")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("Qwen3.5 with attention_bias=true is not supported")
    params = rope_parameters(cfg)
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary = int(fields["head_dim"] * partial)
    return dict(
        **fields, rotary_dim=None if rotary == fields["head_dim"] else rotary,
        linear_layers=tuple(t == LINEAR_ATTENTION for t in types[:n]),
        linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
        linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
        linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
        linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4))


HF_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "linear_attn.in_proj_qkv.weight": "in_proj_qkv",
    "linear_attn.in_proj_z.weight": "in_proj_z",
    "linear_attn.in_proj_b.weight": "in_proj_b",
    "linear_attn.in_proj_a.weight": "in_proj_a",
    "linear_attn.conv1d.weight": "conv_weight",
    "linear_attn.A_log": "A_log",
    "linear_attn.dt_bias": "dt_bias",
    "linear_attn.norm.weight": "gate_norm",
    "linear_attn.out_proj.weight": "out_proj",
}

FAMILY = Family(
    name="qwen3_5",
    model=Qwen3_5Model,
    architectures=("Qwen3_5ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    hf_skipped_prefixes=MTP_PREFIXES,
    gguf_architectures={qwen3_5_gguf.ARCH: "Qwen3_5ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=qwen3_5_gguf.GGUF_LAYER_WEIGHTS,
    gguf_merge=qwen3_5_gguf.merge_tensors,
    gguf_adapter_merge=qwen3_5_gguf.merge_adapter,
)
