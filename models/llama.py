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


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = nnx.Param(jnp.ones((d,), dtype))
        self.q_proj = _param(rngs, (d, q_dim), dtype)
        self.k_proj = _param(rngs, (d, kv_dim), dtype)
        self.v_proj = _param(rngs, (d, kv_dim), dtype)
        if cfg.attention_bias:
            self.q_bias = _param(rngs, (q_dim,), dtype)
            self.k_bias = _param(rngs, (kv_dim,), dtype)
            self.v_bias = _param(rngs, (kv_dim,), dtype)
        self.o_proj = _param(rngs, (q_dim, d), dtype)
        self.post_attn_norm = nnx.Param(jnp.ones((d,), dtype))
        self.gate_proj = _param(rngs, (d, f), dtype)
        self.up_proj = _param(rngs, (d, f), dtype)
        self.down_proj = _param(rngs, (f, d), dtype)

    def __call__(self, x, positions, valid, k_cache, v_cache, block_tables, inv_freq, cfg: ModelConfig,
                 decode_attention=None):
        """x: [B, T, D] -> ([B, T, D], k_cache, v_cache). decode_attention: see LlamaModel."""
        b, t, _ = x.shape
        h = rms_norm(x, self.input_norm[...], cfg.rms_norm_eps)
        q = h @ self.q_proj[...]
        k = h @ self.k_proj[...]
        v = h @ self.v_proj[...]
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
        k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, positions, valid, block_tables)
        attend = decode_attention if decode_attention is not None and t == 1 else paged_attention
        attn = attend(q, k_cache, v_cache, block_tables, positions, 1.0 / math.sqrt(cfg.head_dim))
        x = x + attn.reshape(b, t, -1).astype(x.dtype) @ self.o_proj[...]
        h = rms_norm(x, self.post_attn_norm[...], cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ self.gate_proj[...]) * (h @ self.up_proj[...])) @ self.down_proj[...]
        return x, k_cache, v_cache


class LlamaModel(nnx.Module):
    """A Llama-family causal LM. Construct under `nnx.eval_shape` to get abstract params."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs, decode_attention=None):
        """`decode_attention`: None for pure-JAX paged attention everywhere, else a hashable
        callable used for one-query-per-row steps (`models/pallas_attention.py`). It is
        static (part of the graphdef), so it is chosen here, when the model is built."""
        self.cfg = cfg
        self.dtype = dtype
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if cfg.tie_word_embeddings:
            # A [D, V] copy of the tied embedding, refreshed by the loader: reading [V, D]
            # transposed inside the step made XLA CPU re-transpose it every decode step.
            self.tied_lm_head = nnx.Variable(self.embed[...].T)
        else:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)
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
        x = self.embed[...][tokens]
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
        w = self.tied_lm_head[...] if self.cfg.tie_word_embeddings else self.lm_head[...]
        return (hidden @ w).astype(jnp.float32)
