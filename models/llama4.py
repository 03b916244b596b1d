"""Llama 4 text (`Llama4ForCausalLM` / `Llama4TextConfig`: Scout 17B-16E, Maverick 17B-128E).

    x = x + attention(rms_norm(x))
        RoPE layers (no_rope_layers[i] = 1; three of every four):
            q, k de-interleaved, rotated, then (use_qk_norm) a weightless RMS norm per head
            (transformers' Llama4TextL2Norm, eps rms_norm_eps); chunked local attention: a
            query at p sees keys s <= p with s // attention_chunk_size == p // attention_chunk_size
        NoPE layers (every fourth): no RoPE, no q/k norm, full causal attention; with
            attn_temperature_tuning the queries are scaled by
            log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (p: the token's position)
    x = x + ffn(rms_norm(x))
        MoE layers (`moe_layers`, else every `interleave_moe_layer_step`-th from step - 1):
            s, e = sigmoid(top_k(x @ router))          sigmoid of the top-k logits only
            y    = shared(x) + sum_j expert_{e_j}(x * s_j)    the score scales the expert's
                                                              input, not its output
        dense layers: a SwiGLU MLP of intermediate_size_mlp

RoPE: transformers applies it as complex multiplication over adjacent pairs (x0, x1),
(x2, x3)... (llama.cpp's "normal" RoPE; its converter writes Llama 4's q/k rows as HF has
them). We de-interleave each head of q and k (evens then odds) before the rotate-half
`apply_rope`: exactly HF's rotation in a permuted basis of the head, the same for q and k,
so the scores are unchanged; the weightless norm does not see the order either. Values are
never permuted. NoPE layers keep HF's order.

A `Llama4ForConditionalGeneration` checkpoint (the Hub's Scout and Maverick) is served as
its text model: its `text_config`, its `language_model.*` tensors; the vision model's are
left unread (images are not supported for Llama 4).

Chunked layers attend in pure JAX (`models/attention.py:paged_attention` with `chunk`),
walking from the attention chunk that holds their first query's position chunk; their
cache stays full-length (the blocks before the chunk are kept and accounted, nothing is
evicted). The NoPE layers are plain causal attention and take the model's kernels.

Per-layer parameters (our layouts; HF name after `model.layers.{i}.`; GGUF after `blk.{i}.`):

    input_norm     [D]          input_layernorm.weight                 attn_norm.weight
    q_proj/k_proj/v_proj/o_proj self_attn.{q,k,v,o}_proj.weight         attn_{q,k,v,output}.weight
    post_attn_norm [D]          post_attention_layernorm.weight        ffn_norm.weight
  MoE layers (F = intermediate_size, the experts' and the shared expert's width):
    router         [D, E]       feed_forward.router.weight             ffn_gate_inp.weight
    experts_gate   [E, D, F]    feed_forward.experts.gate_up_proj      ffn_gate_exps.weight
    experts_up     [E, D, F]      (its first F columns gate, then up)   ffn_up_exps.weight
    experts_down   [E, F, D]    feed_forward.experts.down_proj         ffn_down_exps.weight
    gate_proj / up_proj [D, F], down_proj [F, D]
                                feed_forward.shared_expert.*_proj      ffn_{gate,up,down}_shexp.weight
  dense layers (F = intermediate_size_mlp):
    gate_proj / up_proj / down_proj   feed_forward.{gate,up,down}_proj  ffn_{gate,up,down}.weight
The shared expert takes the dense MLP's names (an expert layer has no dense MLP), so tensor
parallelism splits it like one.

GGUF (`llama4`, llama.cpp's converter): `feed_forward_length` is the dense width
(intermediate_size_mlp), `expert_feed_forward_length` the experts', `interleave_moe_layer_step`
marks the MoE layers; the file carries neither the chunk size nor the temperature tuning's
constants, which llama.cpp fixes at 8192, 8192 and 0.1, with a NoPE layer every fourth and the
q/k norm on all but the 128-expert model; so do we. A file whose `attention.sliding_window`
is 0 (the converter's mark for every layer full) has no chunked or NoPE layer. Three keys the
converter never writes for llama4 are read when present (our test files write them for a tiny
model's own values): a positive `attention.sliding_window` as the chunk size, and
`attention.temperature_length` / `attention.temperature_scale` as floor_scale / attn_scale
(their meaning in llama.cpp's DeepSeek files).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import paged_attention, write_kv
from models.config import UnsupportedModelError, hf_common_fields
from models.decoder import CausalLM
from models.family import ExpertStack, Family
from models.layers import AttentionSpec, SelfAttention, attend, gated_mlp, norm_param, param, project, project_many, \
    rms_norm, silu
from models.mla import deinterleave
from models.moe import GGUF_EXPERT_WEIGHTS, MoeConfig, moe_mlp
from models.rope import apply_rope

LLAMA_CPP_CHUNK = 8192  # llama.cpp's chunk size, floor scale and attention scale for every llama4 file
LLAMA_CPP_FLOOR_SCALE = 8192.0
LLAMA_CPP_ATTN_SCALE = 0.1


@dataclasses.dataclass(frozen=True)
class Llama4Config(MoeConfig):
    """MoeConfig plus Llama 4's attention kinds. `intermediate_size` is the dense layers'
    MLP (HF's intermediate_size_mlp); `moe_intermediate_size` the experts' and the shared
    expert's width (HF's intermediate_size)."""

    rope_layers: tuple[bool, ...] = ()  # per layer: RoPE (and chunked attention) or NoPE
    attention_chunk: int | None = None  # attention_chunk_size of the RoPE layers; None: full attention
    qk_norm: bool = True  # use_qk_norm: weightless RMS norm of q and k on RoPE layers
    temperature_tuning: bool = True  # attn_temperature_tuning on NoPE layers
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.rope_layers) != self.num_layers:
            raise ValueError(f"Llama4Config.rope_layers has {len(self.rope_layers)} entries for "
                             f"{self.num_layers} layers")
        if self.attention_chunk is not None and self.attention_chunk <= 0:
            raise ValueError(f"Llama4Config.attention_chunk must be > 0; got {self.attention_chunk}")
        if self.floor_scale <= 0:
            raise ValueError(f"Llama4Config.floor_scale must be > 0; got {self.floor_scale}")

    def chunk(self, layer: int) -> int | None:
        """The attention chunk of `layer` (a RoPE layer's), or None (full causal attention)."""
        return self.attention_chunk if self.rope_layers[layer] else None


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """transformers' Llama4TextL2Norm: RMS norm without a weight, in f32, cast back."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def temperature(positions: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """f32[N] query scale of the NoPE layers at each position (attn_temperature_tuning)."""
    p = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4DecoderLayer(nnx.Module, SelfAttention):
    def __init__(self, cfg: Llama4Config, index: int, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.use_rope = bool(cfg.rope_layers[index])
        self.chunk = cfg.chunk(index)
        self.qk_norm = cfg.qk_norm and self.use_rope
        self.temperature = (cfg.floor_scale, cfg.attn_scale) if cfg.temperature_tuning and not self.use_rope else None
        self.moe = cfg.is_moe_layer(index)
        self.top_k = cfg.num_experts_per_tok
        self.input_norm = norm_param(d, dtype)
        self.init_attention(AttentionSpec.from_config(cfg, index), d, dtype, rngs)
        self.post_attn_norm = norm_param(d, dtype)
        f = cfg.moe_intermediate_size if self.moe else cfg.intermediate_size
        self.gate_proj = param(rngs, (d, f), dtype)
        self.up_proj = param(rngs, (d, f), dtype)
        self.down_proj = param(rngs, (f, d), dtype)
        if self.moe:
            e = cfg.num_experts
            self.router = param(rngs, (d, e), dtype)
            self.experts_gate = param(rngs, (e, d, f), dtype)
            self.experts_up = param(rngs, (e, d, f), dtype)
            self.experts_down = param(rngs, (e, f, d), dtype)

    def __call__(self, x, fwd, k_cache, v_cache):
        """x: [N, D] -> ([N, D], k_cache, v_cache)."""
        attn, k_cache, v_cache = self._attention(rms_norm(x, self.input_norm[...], self.eps), fwd, k_cache, v_cache)
        x = x + attn
        h = rms_norm(x, self.post_attn_norm[...], self.eps)
        y = gated_mlp(h, self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value(), silu)
        if self.moe:
            y = y + self._experts(h)
        return x + y, k_cache, v_cache

    def _attention(self, h, fwd, k_cache, v_cache):
        spec = self.attn_spec
        n = h.shape[0]
        q, k, v = project_many(h, [self.q_proj.get_value(), self.k_proj.get_value(), self.v_proj.get_value()])
        q = q.reshape(n, spec.num_heads, spec.head_dim)
        k, v = k.reshape(n, spec.num_kv_heads, spec.head_dim), v.reshape(n, spec.num_kv_heads, spec.head_dim)
        if self.use_rope:
            cos, sin = fwd.rope["global"]
            q, k = apply_rope(deinterleave(q), cos, sin), apply_rope(deinterleave(k), cos, sin)
            if self.qk_norm:
                q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature is not None:  # NoPE layers only
            positions = jnp.concatenate([s.positions.reshape(-1) for s in fwd.segments])
            q = (q * temperature(positions, *self.temperature)[:, None, None]).astype(q.dtype)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, fwd.kv_blocks, fwd.kv_offsets)
        out = attend(spec, q, k_cache, v_cache, fwd) if self.chunk is None else \
            self._attend_chunked(q, k_cache, v_cache, fwd)
        return self._out(out, h.dtype), k_cache, v_cache

    def _attend_chunked(self, q, k_cache, v_cache, fwd):
        """Chunked local attention, segment by segment in pure JAX -> [N, H*hd]."""
        spec, outs = self.attn_spec, []
        for seg in fwd.segments:
            q_seg = q[seg.start:seg.stop].reshape(seg.rows, seg.tokens, spec.num_heads, spec.head_dim)
            out = paged_attention(q_seg, k_cache, v_cache, seg.block_tables, seg.positions, spec.scale,
                                  valid=seg.valid, limits=seg.limits, chunk=self.chunk)
            outs.append(out.reshape(seg.rows * seg.tokens, -1))
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs)

    def _experts(self, h):
        """The routed experts: sigmoid of the top-k router logits, each scaling its expert's
        input (one top-1 pass of models/moe.py's tiles per choice: released models choose one)."""
        logits = project(h, self.router.get_value()).astype(jnp.float32)
        top, experts = jax.lax.top_k(logits, self.top_k)
        scores = jax.nn.sigmoid(top)
        ones = jnp.ones((h.shape[0], 1), jnp.float32)
        y = jnp.zeros_like(h)
        for j in range(self.top_k):
            routed_in = (h * scores[:, j:j + 1].astype(h.dtype)).astype(h.dtype)
            y = y + moe_mlp(routed_in, None, self.experts_gate.get_value(), self.experts_up.get_value(),
                            self.experts_down.get_value(), top_k=1, normalize=False, act=silu,
                            routing=(ones, experts[:, j:j + 1].astype(jnp.int32)))
        return y


class Llama4Model(CausalLM):
    def make_layer(self, index, rngs):
        return Llama4DecoderLayer(self.cfg, index, self.dtype, rngs)


def config_from_hf(cfg: dict[str, Any]) -> Llama4Config:
    if cfg.get("text_config") is not None:
        return config_from_hf(_text_config(cfg))
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("Llama 4 with attention_bias=true is not supported")
    fields = hf_common_fields(cfg)
    n = fields["num_layers"]
    interval = cfg.get("no_rope_layer_interval", 4) or 4
    rope_layers = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    chunk = cfg.get("attention_chunk_size", 8192)
    types = cfg.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                       for r in rope_layers[:n]]
    unknown = sorted(set(types) - {"chunked_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"Llama 4 layer_types {unknown} are not supported; supported: chunked_attention, "
                                    "full_attention")
    # A layer's kind follows no_rope_layers; layer_types must agree (transformers derives it so).
    if any((t == "chunked_attention") != bool(r and chunk) for t, r in zip(types, rope_layers)):
        raise UnsupportedModelError("Llama 4 layer_types that differ from no_rope_layers (a chunked NoPE layer or a "
                                    "full RoPE layer) are not supported")
    step = cfg.get("interleave_moe_layer_step", 1) or 1
    moe_layers = cfg.get("moe_layers")
    moe_layers = set(moe_layers if moe_layers is not None else range(step - 1, n, step))
    return Llama4Config(**{**fields, "intermediate_size": cfg.get("intermediate_size_mlp", 16384)},
                        num_experts=cfg.get("num_local_experts", 16),
                        num_experts_per_tok=cfg.get("num_experts_per_tok", 1),
                        moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=False,
                        dense_layers=tuple(i for i in range(n) if i not in moe_layers),
                        rope_layers=tuple(bool(r) for r in rope_layers[:n]), attention_chunk=chunk or None,
                        qk_norm=bool(cfg.get("use_qk_norm", True)),
                        temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
                        floor_scale=float(cfg.get("floor_scale", 8192)), attn_scale=float(cfg.get("attn_scale", 0.1)))


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A `Llama4ForConditionalGeneration` config's text model, under the wrapper's architecture
    (the loader then reads the language model's tensors and leaves the vision model's)."""
    text = dict(cfg["text_config"])
    text["architectures"] = [(cfg.get("architectures") or ["Llama4ForConditionalGeneration"])[0]]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def config_from_gguf(meta, fields: dict) -> Llama4Config:
    """`llama4` GGUFs as llama.cpp reads them (module docstring)."""
    arch, n = meta.arch, fields["num_layers"]
    experts = int(meta.require(f"{arch}.expert_count"))
    step = int(meta.get(f"{arch}.interleave_moe_layer_step", 1) or 1)
    window = meta.get(f"{arch}.attention.sliding_window")
    all_full = window is not None and int(window) == 0
    interval = int(meta.get(f"{arch}.attention.sliding_window_pattern", 4) or 4)
    return Llama4Config(**fields, num_experts=experts,
                        num_experts_per_tok=int(meta.require(f"{arch}.expert_used_count")),
                        moe_intermediate_size=int(meta.require(f"{arch}.expert_feed_forward_length")),
                        norm_topk_prob=False,
                        dense_layers=tuple(i for i in range(n) if (i + 1) % step),
                        rope_layers=tuple(all_full or (i + 1) % interval != 0 for i in range(n)),
                        attention_chunk=None if all_full else int(window or LLAMA_CPP_CHUNK),
                        qk_norm=experts != 128, temperature_tuning=True,
                        floor_scale=float(meta.get(f"{arch}.attention.temperature_length", LLAMA_CPP_FLOOR_SCALE)),
                        attn_scale=float(meta.get(f"{arch}.attention.temperature_scale", LLAMA_CPP_ATTN_SCALE)))


HF_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attn_norm",
    "feed_forward.gate_proj.weight": "gate_proj",
    "feed_forward.up_proj.weight": "up_proj",
    "feed_forward.down_proj.weight": "down_proj",
    "feed_forward.shared_expert.gate_proj.weight": "gate_proj",
    "feed_forward.shared_expert.up_proj.weight": "up_proj",
    "feed_forward.shared_expert.down_proj.weight": "down_proj",
    "feed_forward.router.weight": "router",
    "feed_forward.experts.gate_up_proj": ExpertStack(("experts_gate", "experts_up"), halves=True),
    "feed_forward.experts.down_proj": ExpertStack(("experts_down",)),
}
GGUF_LAYER_WEIGHTS = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attn_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "ffn_gate_shexp.weight": "gate_proj",
    "ffn_up_shexp.weight": "up_proj",
    "ffn_down_shexp.weight": "down_proj",
    **GGUF_EXPERT_WEIGHTS,
}

FAMILY = Family(
    name="llama4",
    model=Llama4Model,
    architectures=("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    gguf_architectures={"llama4": "Llama4ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_non_parameters=("rope_freqs.weight",),
    gguf_experts=True,
)
