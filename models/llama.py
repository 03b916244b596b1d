"""Llama-family decoder in Flax NNX, computing over a paged KV cache.

The model is pure math: it never owns the KV cache. Each call takes the per-layer K/V
block arrays (layout: `ferrox_jax/kv_cache.py`) and block tables, writes the new
tokens' K/V into their blocks, attends through the block tables and returns the
updated arrays. The engine splits the model once (`nnx.split`) and jits the step
functions over (graphdef static, state traced).

Parameter names and our layouts (x @ W, i.e. HF's `[out, in]` weights transposed);
loaders produce exactly these names (`models/loaders/common.py` checks them):

    embed                    [V, D]
    layers.{i}.input_norm    [D]
    layers.{i}.q_proj        [D, H*hd]     (+ q_bias [H*hd] when attention_bias)
    layers.{i}.k_proj        [D, K*hd]     (+ k_bias [K*hd])
    layers.{i}.v_proj        [D, K*hd]     (+ v_bias [K*hd])
    layers.{i}.o_proj        [H*hd, D]
    layers.{i}.post_attn_norm [D]
    layers.{i}.gate_proj     [D, F]
    layers.{i}.up_proj       [D, F]
    layers.{i}.down_proj     [F, D]
    final_norm               [D]
    lm_head                  [D, V]        (absent when tie_word_embeddings; the model then
                                            keeps `tied_lm_head`, a transposed copy of embed)

With `quantization` "int8" or "w8a8" (`models/quant.py`) every projection, the embedding
and the LM head hold a `QuantizedWeight` (int8 values of the same shape plus one f32 scale
per output channel; the embedding's scales are per row) instead of a float array, and every
product goes through `project(x, w)`, which dispatches on the weight's type.

q/k rows are in HF's rotate-half RoPE order (the GGUF loader undoes llama.cpp's
interleaved permutation). Axis names: B rows, T tokens per row, D hidden, H query
heads, K kv heads, G = H/K groups, hd head_dim, F intermediate, V vocab, S key positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import paged_attention, write_kv
from models.config import ModelConfig, RopeScaling
from models.quant import QuantizedWeight, check_mode, embed_lookup, quantize, quantized_matmul


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies f32[hd/2], with linear or llama3 scaling as in transformers."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, heads, hd]; positions: i32[B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in f32, cast back before the weight (as transformers does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def project(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, out]: a plain product for a float weight, the int8 matmul of
    `models/quant.py` for a `QuantizedWeight`. Every projection of the model calls this."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w)
    return x @ w


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


def _weight(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, quantization: str, channel_axis: int = 1) -> nnx.Param:
    """A matrix parameter: float, or a QuantizedWeight when `quantization` is not "none"."""
    param = _param(rngs, shape, dtype)
    if quantization == "none":
        return param
    return nnx.Param(quantize(param.get_value(), quantization, channel_axis))


def tied_head(embed):
    """The [D, V] LM head of a tied embedding [V, D]: its transpose (a quantized embedding's
    per-row scales are the head's per-output-channel scales)."""
    if isinstance(embed, QuantizedWeight):
        return QuantizedWeight(embed.values.T, embed.scales, embed.mode, channel_axis=1)
    return embed.T


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization: str = "none"):
        d, f = cfg.hidden_size, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = nnx.Param(jnp.ones((d,), dtype))
        self.q_proj = _weight(rngs, (d, q_dim), dtype, quantization)
        self.k_proj = _weight(rngs, (d, kv_dim), dtype, quantization)
        self.v_proj = _weight(rngs, (d, kv_dim), dtype, quantization)
        if cfg.attention_bias:
            self.q_bias = _param(rngs, (q_dim,), dtype)
            self.k_bias = _param(rngs, (kv_dim,), dtype)
            self.v_bias = _param(rngs, (kv_dim,), dtype)
        self.o_proj = _weight(rngs, (q_dim, d), dtype, quantization)
        self.post_attn_norm = nnx.Param(jnp.ones((d,), dtype))
        self.gate_proj = _weight(rngs, (d, f), dtype, quantization)
        self.up_proj = _weight(rngs, (d, f), dtype, quantization)
        self.down_proj = _weight(rngs, (f, d), dtype, quantization)

    def __call__(self, x, positions, valid, k_cache, v_cache, block_tables, inv_freq, cfg: ModelConfig,
                 decode_attention=None):
        """x: [B, T, D] -> ([B, T, D], k_cache, v_cache). decode_attention: see LlamaModel."""
        b, t, _ = x.shape
        h = rms_norm(x, self.input_norm[...], cfg.rms_norm_eps)
        q = project(h, self.q_proj.get_value())
        k = project(h, self.k_proj.get_value())
        v = project(h, self.v_proj.get_value())
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
        k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, positions, valid, block_tables)
        attend = decode_attention if decode_attention is not None and t == 1 else paged_attention
        attn = attend(q, k_cache, v_cache, block_tables, positions, 1.0 / math.sqrt(cfg.head_dim))
        x = x + project(attn.reshape(b, t, -1).astype(x.dtype), self.o_proj.get_value())
        h = rms_norm(x, self.post_attn_norm[...], cfg.rms_norm_eps)
        gated = jax.nn.silu(project(h, self.gate_proj.get_value())) * project(h, self.up_proj.get_value())
        x = x + project(gated, self.down_proj.get_value())
        return x, k_cache, v_cache


class LlamaModel(nnx.Module):
    """A Llama-family causal LM. Construct under `nnx.eval_shape` to get abstract params."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs, decode_attention=None,
                 quantization: str = "none"):
        """`decode_attention`: None for pure-JAX paged attention everywhere, else a hashable
        callable used for one-query-per-row steps (`models/pallas_attention.py`). It is
        static (part of the graphdef), so it is chosen here, when the model is built.
        `quantization`: "none", "int8" or "w8a8" (`models/quant.py`)."""
        check_mode(quantization)
        self.cfg = cfg
        self.dtype = dtype
        self.quantization = quantization
        self.embed = _weight(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, quantization, channel_axis=0)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, quantization) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if cfg.tie_word_embeddings:
            # A [D, V] copy of the tied embedding, refreshed by the loader: reading [V, D]
            # transposed inside the step made XLA CPU re-transpose it every decode step.
            self.tied_lm_head = nnx.Variable(tied_head(self.embed.get_value()))
        else:
            self.lm_head = _weight(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, quantization)
        self.inv_freq = nnx.Variable(
            jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        )
        self.decode_attention = decode_attention

    def __call__(self, tokens, positions, valid, k_caches, v_caches, block_tables):
        """Run the decoder over new tokens, writing their K/V into the paged cache.

        Args:
          tokens: i32[B, T] new token ids (padding anywhere `valid` is False).
          positions: i32[B, T] absolute position of each token.
          valid: bool[B, T] which tokens are real; padded ones write into block 0.
          k_caches, v_caches: tuples of L arrays [K, num_blocks, block_size, hd].
          block_tables: i32[B, MB] block ids per row (0 = null block).
        Returns:
          (hidden f32/dtype[B, T, D] after the final norm, k_caches, v_caches).
        """
        cfg = self.cfg
        inv_freq = self.inv_freq[...]
        x = embed_lookup(self.embed.get_value(), tokens, self.dtype)
        new_k, new_v = [], []
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x, k_cache, v_cache = layer(x, positions, valid, k_cache, v_cache, block_tables, inv_freq, cfg,
                                        self.decode_attention)
            new_k.append(k_cache)
            new_v.append(v_cache)
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return x, tuple(new_k), tuple(new_v)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> f32[..., V]."""
        w = self.tied_lm_head.get_value() if self.cfg.tie_word_embeddings else self.lm_head.get_value()
        return project(hidden, w).astype(jnp.float32)
