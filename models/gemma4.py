"""Gemma 4 (text; `Gemma4ForCausalLM` / `Gemma4TextConfig`, and the text model of the
multimodal `Gemma4ForConditionalGeneration` checkpoints), as transformers 5.25 defines it.

    x = embed(tokens) * sqrt(D)                                (the scale cast to the dtype)
    ple = (norm(x @ ple_model_proj * D^-0.5 -> [L, P], ple_proj_norm)
           + ple_embed(tokens) * sqrt(P) -> [L, P]) * 2^-0.5    per-layer inputs, when P > 0
    per layer i:
      x = x + norm(attention(norm(x)))
      h = mlp(norm(x))                                         GeGLU, twice as wide on shared-KV
                                                               layers with use_double_wide_mlp
      MoE layers (enable_moe_block): h = norm(h) + norm(experts(norm(x)))
                                      routed on norm(x) * router_scale * D^-0.5, top-k softmax
                                      renormalised, then times per_expert_scale[expert]
      x = x + norm(h)
      P > 0: x = x + norm(ple_proj(gelu_tanh(x @ ple_gate) * ple[:, i]))
      x = x * layer_scalar
    logits = final_logit_softcap * tanh((norm(x) @ W) / cap)   (when the config sets it)

Norms are RMSNorm times w in f32 (not Gemma 2/3's 1 + w): `rms_norm_w`.
Attention: q = norm(q_heads, q_norm), k = norm(k_heads, k_norm), v = norm(v_heads) (no
weight), q and k rotated; scale 1 (the q/k norms set the logits' size); no soft-capping.
- sliding layers (`layer_types`): window `sliding_window`, head size `head_dim`, kv heads
  `num_key_value_heads`, RoPE "local": default, its own theta over head_dim.
- full layers: head size and kv heads from `per_layer_config` (transformers writes it from
  `global_head_dim` / `num_global_key_value_heads`); RoPE "global": proportional
  (models/rope.py) over their head size, or default. With `attention_k_eq_v` they have no
  v_proj: values are the keys' projection before k_norm and RoPE, normed without weight.
  Keys are rotated and scaled, values are not, so the cache still holds both arrays.
  Their head size is not the one the model's attention kernel is built for (`head_dim`),
  so they attend in pure JAX (`AttentionSpec.kernels`).
- shared-KV layers (the last `num_kv_shared_layers`): no k/v projections; they attend over
  the cache of the last earlier non-shared layer of their type, and hold no cache of their
  own: `kv_layout()` lists the non-shared layers only, `kv_source(i)` names the array a
  layer reads, and the bytes per block count only those arrays. With the sliding KV group's
  own pool (`ferrox_jax/kv_groups.py`) the sliding arrays hold slots: a layer writes and
  reads its array through its source's table, the window tables when the source slides
  (`source_slides`), the block tables otherwise.

Per-layer parameters (HF name after `model.layers.{i}.`):

    input_norm / post_attn_norm / pre_mlp_norm / post_mlp_norm  [D]   *_layernorm.weight
    q_proj, o_proj, q_norm [hd]                                       self_attn.*
    k_proj, k_norm [hd], v_proj (not k_eq_v full layers)              self_attn.*  (not shared)
    gate_proj / up_proj / down_proj                                   mlp.*
    ple_gate [D, P], ple_proj [P, D], ple_norm [D]                    per_layer_input_gate,
                                                                      per_layer_projection,
                                                                      post_per_layer_input_norm
    router [D, E], router_scale [D], expert_scale [E]                 router.{proj,scale,per_expert_scale}
    experts_gate_up [E, D, 2F'], experts_down [E, F', D]              experts.{gate_up,down}_proj
    post_mlp_norm_1, pre_moe_norm, post_moe_norm [D]                  post_feedforward_layernorm_1,
                                                                      pre/post_feedforward_layernorm_2
    layer_scalar [1]                                                  layer_scalar
Global: ple_embed [V', L*P], ple_model_proj [D, L*P], ple_proj_norm [P].

Refused at load, by name: use_bidirectional_attention "all", attention_bias, another
activation or rope type, per_layer_config keys other than head_dim / num_key_value_heads,
full layers of different head sizes, every layer sharing KV.

GGUF: llama.cpp's `gemma4` architecture, with or without experts; models/gemma4_gguf.py reads
its keys and names its tensors (`FAMILY` for dense files, `GGUF_MOE_FAMILY` for files with experts:
the same model and tables).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import gemma2
from models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, UnsupportedModelError, rope_theta
from models.decoder import CausalLM
from models.family import ExpertStack, Family
from models.layers import (AttentionSpec, ForwardContext, attend, gated_mlp, gelu_tanh, norm_param, param, project,
                           project_many, softcap)
from models.attention import write_kv
from models.moe import moe_mlp
from models.quant import embed_lookup
from models.rope import apply_rope, cos_sin_of, proportional_inv_freq, rope_inv_freq
from models.config import RopeScaling
from models.gemma4_gguf import GGUF_GLOBAL_WEIGHTS, GGUF_LAYER_WEIGHTS, config_fields


@dataclasses.dataclass(frozen=True)
class Gemma4Config(ModelConfig):
    final_logit_softcap: float | None = None
    layer_head_dims: tuple[int, ...] = ()  # per layer; head_dim is the sliding layers'
    layer_kv_heads: tuple[int, ...] = ()
    k_eq_v: bool = False  # full layers take values from the key projection
    rope_local_theta: float = 10000.0
    rope_global_type: str = "proportional"  # or "default"
    rope_global_partial: float = 1.0
    rope_global_factor: float = 1.0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    ple_dim: int = 0  # hidden_size_per_layer_input; 0: no per-layer inputs
    ple_vocab: int = 0
    num_experts: int = 0  # 0: no MoE block
    top_k: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_layers
        if len(self.layer_head_dims) != n or len(self.layer_kv_heads) != n:
            raise ValueError(f"Gemma4Config needs a head size and kv heads for each of {n} layers")
        if not 0 <= self.num_kv_shared_layers < n:
            raise UnsupportedModelError(f"num_kv_shared_layers {self.num_kv_shared_layers} of {n} layers is not "
                                        "supported: at least one layer must compute its own K/V")
        first = n - self.num_kv_shared_layers
        missing = set(self.layer_types[first:]) - set(self.layer_types[:first])
        if missing:
            raise UnsupportedModelError(f"num_kv_shared_layers: no earlier layer of type {sorted(missing)} to "
                                        "share K/V from")

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def is_shared(self, layer: int) -> bool:
        return layer >= self.first_shared_layer

    def kv_source(self, layer: int) -> int:
        """The cache array pair layer `layer` writes (its own) or reads (shared: the last
        non-shared layer of its type)."""
        if not self.is_shared(layer):
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(self.first_shared_layer) if self.layer_types[i] == kind)

    def kv_layout(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((self.layer_kv_heads[i], self.layer_head_dims[i], self.layer_head_dims[i])
                     for i in range(self.first_shared_layer))


def rms_norm_w(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm: normalised and times w (when it has one) in f32, then cast."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        xf = xf * weight.astype(jnp.float32)
    return xf.astype(x.dtype)


class Gemma4DecoderLayer(nnx.Module):
    def __init__(self, cfg: Gemma4Config, index: int, dtype, rngs: nnx.Rngs):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.eps = eps
        hd, kv = cfg.layer_head_dims[index], cfg.layer_kv_heads[index]
        full = cfg.layer_types[index] == FULL_ATTENTION
        self.shared = cfg.is_shared(index)
        # The table this layer's K/V array is indexed by: its source's (a shared layer reads
        # another layer's array), the window tables when that array holds the sliding pool.
        self.source_slides = cfg.window(cfg.kv_source(index)) is not None
        self.k_eq_v = cfg.k_eq_v and full
        self.spec = AttentionSpec(num_heads=cfg.num_heads, num_kv_heads=kv, head_dim=hd, scale=1.0,
                                  window=cfg.window(index), rope="global" if full else "local", norm_eps=eps,
                                  kernels=hd == cfg.head_dim)
        self.input_norm, self.post_attn_norm = norm_param(d, dtype), norm_param(d, dtype)
        self.pre_mlp_norm, self.post_mlp_norm = norm_param(d, dtype), norm_param(d, dtype)
        self.q_proj = param(rngs, (d, cfg.num_heads * hd), dtype)
        self.q_norm = norm_param(hd, dtype)
        self.o_proj = param(rngs, (cfg.num_heads * hd, d), dtype)
        if not self.shared:
            self.k_proj = param(rngs, (d, kv * hd), dtype)
            self.k_norm = norm_param(hd, dtype)
            if not self.k_eq_v:
                self.v_proj = param(rngs, (d, kv * hd), dtype)
        f = cfg.intermediate_size * (2 if cfg.double_wide_mlp and self.shared else 1)
        self.gate_proj, self.up_proj = param(rngs, (d, f), dtype), param(rngs, (d, f), dtype)
        self.down_proj = param(rngs, (f, d), dtype)
        self.moe = cfg.num_experts > 0
        if self.moe:
            e, fe = cfg.num_experts, cfg.moe_intermediate_size
            self.top_k = cfg.top_k
            self.router = param(rngs, (d, e), dtype)
            self.router_scale = norm_param(d, dtype)
            self.expert_scale = norm_param(e, dtype)
            self.experts_gate_up = param(rngs, (e, d, 2 * fe), dtype)
            self.experts_down = param(rngs, (e, fe, d), dtype)
            self.post_mlp_norm_1 = norm_param(d, dtype)
            self.pre_moe_norm, self.post_moe_norm = norm_param(d, dtype), norm_param(d, dtype)
        self.ple = cfg.ple_dim > 0
        if self.ple:
            self.ple_gate = param(rngs, (d, cfg.ple_dim), dtype)
            self.ple_proj = param(rngs, (cfg.ple_dim, d), dtype)
            self.ple_norm = norm_param(d, dtype)
        self.layer_scalar = norm_param(1, dtype)

    def attention(self, h, fwd: ForwardContext, k_cache, v_cache):
        spec, n = self.spec, h.shape[0]
        cos, sin = fwd.rope[spec.rope]
        # the array's table (the RoPE tables above are the same in either context)
        fwd = fwd.window if self.source_slides and fwd.window is not None else fwd
        q = project(h, self.q_proj.get_value()).reshape(n, spec.num_heads, spec.head_dim)
        q = apply_rope(rms_norm_w(q, self.q_norm[...], self.eps), cos, sin)
        if not self.shared:  # a shared layer reads the cache its source layer wrote in this forward
            if self.k_eq_v:
                k = v = project(h, self.k_proj.get_value())
            else:
                k, v = project_many(h, [self.k_proj.get_value(), self.v_proj.get_value()])
            k = k.reshape(n, spec.num_kv_heads, spec.head_dim)
            v = rms_norm_w(v.reshape(n, spec.num_kv_heads, spec.head_dim), None, self.eps)
            k = apply_rope(rms_norm_w(k, self.k_norm[...], self.eps), cos, sin)
            k_cache, v_cache = write_kv(k_cache, v_cache, k, v, fwd.kv_blocks, fwd.kv_offsets)
        out = attend(spec, q, k_cache, v_cache, fwd)
        return project(out.astype(h.dtype), self.o_proj.get_value()), k_cache, v_cache

    def experts(self, x):
        """The MoE block beside the dense MLP, on the residual x [N, D]."""
        d = x.shape[-1]
        r = rms_norm_w(x, None, self.eps) * self.router_scale[...] * jnp.asarray(d ** -0.5, x.dtype)
        probs = jax.nn.softmax(project(r, self.router.get_value()).astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        weights = weights * self.expert_scale[...].astype(jnp.float32)[chosen]
        gate_up = self.experts_gate_up.get_value()
        fe = gate_up.shape[-1] // 2
        h = rms_norm_w(x, self.pre_moe_norm[...], self.eps)
        h = moe_mlp(h, self.router.get_value(), gate_up[..., :fe], gate_up[..., fe:], self.experts_down.get_value(),
                    top_k=self.top_k, normalize=True, act=gelu_tanh, routing=(weights, chosen.astype(jnp.int32)))
        return rms_norm_w(h, self.post_moe_norm[...], self.eps)

    def __call__(self, x, fwd, k_cache, v_cache, ple):
        """x [N, D], ple [N, P] or None -> (x, k_cache, v_cache)."""
        eps = self.eps
        attn, k_cache, v_cache = self.attention(rms_norm_w(x, self.input_norm[...], eps), fwd, k_cache, v_cache)
        x = x + rms_norm_w(attn, self.post_attn_norm[...], eps)
        h = gated_mlp(rms_norm_w(x, self.pre_mlp_norm[...], eps), self.gate_proj.get_value(),
                      self.up_proj.get_value(), self.down_proj.get_value(), gelu_tanh)
        if self.moe:
            h = rms_norm_w(h, self.post_mlp_norm_1[...], eps) + self.experts(x)
        x = x + rms_norm_w(h, self.post_mlp_norm[...], eps)
        if self.ple:
            g = gelu_tanh(project(x, self.ple_gate.get_value())) * ple
            x = x + rms_norm_w(project(g, self.ple_proj.get_value()), self.ple_norm[...], eps)
        return x * self.layer_scalar[...], k_cache, v_cache


class Gemma4Model(CausalLM):
    def __init__(self, cfg: Gemma4Config, dtype=jnp.float32, *, rngs: nnx.Rngs, decode_attention=None):
        super().__init__(cfg, dtype, rngs=rngs, decode_attention=decode_attention)
        if cfg.ple_dim:
            width = cfg.num_layers * cfg.ple_dim
            self.ple_embed = param(rngs, (cfg.ple_vocab, width), dtype)
            self.ple_model_proj = param(rngs, (cfg.hidden_size, width), dtype)
            self.ple_proj_norm = norm_param(cfg.ple_dim, dtype)

    def make_layer(self, index, rngs):
        return Gemma4DecoderLayer(self.cfg, index, self.dtype, rngs)

    def embed_tokens(self, tokens):
        x = embed_lookup(self.embed.get_value(), tokens, self.dtype)
        return x * jnp.asarray(math.sqrt(self.cfg.hidden_size), jnp.float32).astype(x.dtype)

    def norm(self, x, weight):
        return rms_norm_w(x, weight, self.cfg.rms_norm_eps)

    def logits(self, hidden):
        return softcap(super().logits(hidden), self.cfg.final_logit_softcap)

    def rope(self, positions, valid):
        cfg = self.cfg
        tables = {}
        if SLIDING_ATTENTION in cfg.layer_types:
            tables["local"] = cos_sin_of(positions, rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, RopeScaling()))
        if FULL_ATTENTION in cfg.layer_types:
            hd = cfg.layer_head_dims[cfg.layer_types.index(FULL_ATTENTION)]
            # transformers' default RoPE ignores partial_rotary_factor and factor; proportional takes both
            proportional = cfg.rope_global_type == "proportional"
            tables["global"] = cos_sin_of(positions, proportional_inv_freq(
                hd, cfg.rope_theta, cfg.rope_global_partial if proportional else 1.0,
                cfg.rope_global_factor if proportional else 1.0))
        return tables

    def per_layer_inputs(self, tokens, x):
        """The per-layer inputs f32/dtype[N, L, P] of the new tokens (x: their scaled embeddings)."""
        cfg, n = self.cfg, tokens.shape[0]
        shape = (n, cfg.num_layers, cfg.ple_dim)
        own = embed_lookup(self.ple_embed.get_value(), tokens, self.dtype)
        own = (own * jnp.asarray(math.sqrt(cfg.ple_dim), jnp.float32).astype(own.dtype)).reshape(shape)
        ctx = project(x, self.ple_model_proj.get_value()) * jnp.asarray(cfg.hidden_size ** -0.5, x.dtype)
        ctx = rms_norm_w(ctx.reshape(shape), self.ple_proj_norm[...], cfg.rms_norm_eps)
        return (ctx + own) * jnp.asarray(2.0 ** -0.5, x.dtype)

    def __call__(self, tokens, positions, valid, k_caches, v_caches, block_tables, segment_tokens, images=None,
                 window_tables=None):
        """As `CausalLM.__call__`, over the caches of `kv_layout()` (fewer than the layers
        when some share KV); text only (`images` must be None). `window_tables`: the
        sliding arrays' slot tables when those arrays hold the sliding pool
        (`ferrox_jax/kv_groups.py`); a layer reads its source array through them."""
        cfg = self.cfg
        arrays = len(cfg.kv_layout())
        if len(k_caches) != arrays or len(v_caches) != arrays:
            raise ValueError(f"expected {arrays} K and V cache arrays; got {len(k_caches)} and {len(v_caches)}")
        if images is not None:
            raise ValueError("Gemma 4 is served as a text model: no image inputs")
        fwd = ForwardContext.build(positions, valid, block_tables, segment_tokens, k_caches[0].shape[2], self.rope,
                                   self.decode_attention, window_tables=window_tables)
        x = self.embed_tokens(tokens)
        ple = self.per_layer_inputs(tokens, x) if cfg.ple_dim else None
        ks, vs = list(k_caches), list(v_caches)
        for i, layer in enumerate(self.layers):
            c = cfg.kv_source(i)
            x, ks[c], vs[c] = layer(x, fwd, ks[c], vs[c], None if ple is None else ple[:, i])
        return self.norm(x, self.final_norm[...]), tuple(ks), tuple(vs)


_KNOWN_PER_LAYER = {"head_dim", "num_key_value_heads"}


def config_from_hf(cfg: dict[str, Any]) -> Gemma4Config:
    if cfg.get("text_config") is not None:
        return _multimodal_config(cfg)
    arch = (cfg.get("architectures") or ["Gemma4ForCausalLM"])[0]
    fields = gemma2.gemma_common_fields({**cfg, "use_bidirectional_attention": None})
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(f"{arch}: use_bidirectional_attention='all' (an encoder) is not supported")
    n = fields["num_layers"]
    types = tuple(cfg.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(n)])
    types = types[:-1] + (FULL_ATTENTION,)  # transformers forces the last layer to full attention
    hd, kv = fields["head_dim"], fields["num_kv_heads"]
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:  # transformers' derivation from the top-level keys
        over = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        per_layer = {str(i): over for i, t in enumerate(types) if t == FULL_ATTENTION}
    per_layer = {int(k): v for k, v in per_layer.items()}
    for i, over in per_layer.items():
        unknown = sorted(set(over) - _KNOWN_PER_LAYER)
        if unknown:
            raise UnsupportedModelError(f"{arch}: per_layer_config of layer {i} sets {', '.join(unknown)}, which is "
                                        "not supported (only head_dim and num_key_value_heads)")
    head_dims = tuple(per_layer.get(i, {}).get("head_dim", hd) for i in range(n))
    kv_heads = tuple(per_layer.get(i, {}).get("num_key_value_heads", kv) for i in range(n))
    for kind in (SLIDING_ATTENTION, FULL_ATTENTION):
        sizes = {head_dims[i] for i in range(n) if types[i] == kind}
        if len(sizes) > 1:
            raise UnsupportedModelError(f"{arch}: {kind} layers of different head sizes {sorted(sizes)} are not "
                                        "supported")
    if any(head_dims[i] != hd for i in range(n) if types[i] == SLIDING_ATTENTION):
        raise UnsupportedModelError(f"{arch}: per_layer_config changing a sliding layer's head_dim is not supported")
    params = cfg.get("rope_parameters") or {}
    local, full = params.get(SLIDING_ATTENTION) or {}, params.get(FULL_ATTENTION) or {}
    for kind, p, allowed in ((SLIDING_ATTENTION, local, ("default",)), (FULL_ATTENTION, full, ("default", "proportional"))):
        rope_type = p.get("rope_type", "default")
        if rope_type not in allowed:
            raise UnsupportedModelError(f"{arch}: rope_type {rope_type!r} on {kind} layers is not supported "
                                        f"(only {', '.join(allowed)})")
    experts = cfg.get("num_experts") or 0 if cfg.get("enable_moe_block") else 0
    fields.update(rope_theta=rope_theta(full, 1_000_000.0), rope_scaling=RopeScaling())
    return Gemma4Config(
        **fields, sliding_window=cfg.get("sliding_window") or 512, layer_types=types,
        final_logit_softcap=cfg.get("final_logit_softcapping"), layer_head_dims=head_dims, layer_kv_heads=kv_heads,
        k_eq_v=bool(cfg.get("attention_k_eq_v", False)), rope_local_theta=rope_theta(local, 10000.0),
        rope_global_type=full.get("rope_type", "default"),
        rope_global_partial=float(full.get("partial_rotary_factor", 1.0)),
        rope_global_factor=float(full.get("factor", 1.0)),
        num_kv_shared_layers=int(cfg.get("num_kv_shared_layers") or 0),
        double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        ple_dim=int(cfg.get("hidden_size_per_layer_input") or 0),
        ple_vocab=int(cfg.get("vocab_size_per_layer_input") or fields["vocab_size"]),
        num_experts=int(experts), top_k=int(cfg.get("top_k_experts") or 0) if experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0)


def _multimodal_config(cfg: dict[str, Any]) -> Gemma4Config:
    """A `Gemma4ForConditionalGeneration` config: its text model (the vision and audio
    towers are not read: their tensors are skipped by the loader)."""
    text = dict(cfg["text_config"])
    text["architectures"] = [(cfg.get("architectures") or ["Gemma4ForConditionalGeneration"])[0]]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return config_from_hf(text)


def config_from_gguf(meta, fields: dict) -> Gemma4Config:
    return Gemma4Config(**config_fields(meta, fields))


HF_LAYER_WEIGHTS = {
    **gemma2.HF_LAYER_WEIGHTS,
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "per_layer_input_gate.weight": "ple_gate",
    "per_layer_projection.weight": "ple_proj",
    "post_per_layer_input_norm.weight": "ple_norm",
    "router.proj.weight": "router",
    "router.scale": "router_scale",
    "router.per_expert_scale": "expert_scale",
    "experts.gate_up_proj": ExpertStack(("experts_gate_up",), transpose=True),
    "experts.down_proj": ExpertStack(("experts_down",), transpose=True),
    "post_feedforward_layernorm_1.weight": "post_mlp_norm_1",
    "pre_feedforward_layernorm_2.weight": "pre_moe_norm",
    "post_feedforward_layernorm_2.weight": "post_moe_norm",
    "layer_scalar": "layer_scalar",
}
HF_GLOBAL_WEIGHTS = {
    "model.embed_tokens_per_layer.weight": ("ple_embed", False),
    "model.per_layer_model_projection.weight": ("ple_model_proj", True),
    "model.per_layer_projection_norm.weight": ("ple_proj_norm", False),
}

FAMILY = Family(
    name="gemma4",
    model=Gemma4Model,
    architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    config_from_hf=config_from_hf,
    hf_layer_weights=HF_LAYER_WEIGHTS,
    hf_global_weights=HF_GLOBAL_WEIGHTS,
    gguf_architectures={"gemma4": "Gemma4ForCausalLM"},
    config_from_gguf=config_from_gguf,
    gguf_layer_weights=GGUF_LAYER_WEIGHTS,
    gguf_global_weights=GGUF_GLOBAL_WEIGHTS,
    gguf_layer_arrays=True,
)
# The same family for `gemma4` files with experts (the registry tells GGUF files apart by them).
GGUF_MOE_FAMILY = dataclasses.replace(FAMILY, architectures=(), gguf_experts=True)
