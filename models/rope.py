"""Rotary position embeddings: the frequency tables of every supported scaling, and applying them.

A model computes its tables at trace time from the (static) config, so they are constants
of the compiled step, not parameters. `rope_cos_sin` turns positions into cos/sin once
per step and kind of RoPE (Gemma 3 has a local and a global one); every layer then
rotates its q and k with `apply_rope`.

Scalings, as transformers computes them (`modeling_rope_utils.py`):
- default: inv_freq[i] = theta^(-2i/d).
- linear: inv_freq / factor.
- llama3: long wavelengths divided by factor, short ones kept, a smooth blend between.
- longrope (Phi-3): inv_freq / short_factor[i] while a sequence fits the pretraining
  context, / long_factor[i] once it is longer; cos and sin times `attention_factor`.
  transformers picks the table per forward call from the call's largest position, so
  here each row picks it from its own largest valid position in the step: identical for
  decode and one-shot prefill; a prompt prefilled in chunks across the boundary sees
  the short table for its earlier chunks, as HF does with a KV cache.
- yarn (gpt-oss): per frequency a blend of the interpolated (inv_freq / factor) and the
  original one, by a linear ramp over the dims between the ones that turn beta_fast and
  beta_slow times over the pretraining context; cos and sin times `attention_factor`
  (YaRN's mscale, 0.1 ln(factor) + 1 unless the checkpoint states it). Computed in
  float32 as transformers does.
- proportional (Gemma 4's full layers, `proportional_inv_freq`): the first
  partial_rotary_factor of the head's frequency pairs theta^(-2i/head_dim) (the exponent
  over the whole head, not the rotated part), the rest 0 (cos 1, sin 0: those pairs pass
  through), all divided by `factor`; the table spans the whole head, so rotate-half
  pairs dim i with i + head_dim/2 as transformers does, unlike Phi-3's partial rotation.
Rotation is rotate-half (GPT-NeoX) over the first `rotary_dim` dims of each head; the
rest pass through (Phi-3's `partial_rotary_factor`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling, *, long: bool = False) -> np.ndarray:
    """Inverse frequencies f32[rotary_dim/2] (longrope: the short table, or the long one)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
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
    elif scaling.rope_type == "longrope":
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope factors have {factors.size} entries; rotary_dim {rotary_dim} needs "
                             f"{inv_freq.size}")
        # transformers: 1 / (factor * theta^(2i/d)), the power taken in float32
        powers = theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))
        inv_freq = 1.0 / (factors.astype(np.float32) * powers.astype(np.float32))
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rotary_dim, theta, scaling)
    return inv_freq.astype(np.float32)


def _yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """transformers' `_compute_yarn_parameters` inverse frequencies, in its float32."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(scaling.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: the original frequency (extrapolated), 0: interpolated
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_cos_sin(positions: jax.Array, valid: jax.Array, rotary_dim: int, theta: float,
                 scaling: RopeScaling) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[B, T, rotary_dim] for each token's position.

    Args:
      positions: i32[B, T]; valid: bool[B, T] (longrope picks its table per row from the
        largest valid position).
    """
    inv_freq = jnp.asarray(rope_inv_freq(rotary_dim, theta, scaling))[None, None, :]  # [1, 1, r/2]
    if scaling.rope_type == "longrope":
        long = jnp.asarray(rope_inv_freq(rotary_dim, theta, scaling, long=True))[None, None, :]
        seq_len = jnp.max(jnp.where(valid, positions, -1), axis=1) + 1  # [B]
        is_long = (seq_len > scaling.original_max_position_embeddings)[:, None, None]
        inv_freq = jnp.where(is_long, long, inv_freq)  # [B, 1, r/2]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, r/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scaling.attention_factor, jnp.sin(emb) * scaling.attention_factor


def proportional_inv_freq(head_dim: int, theta: float, partial: float, factor: float = 1.0) -> np.ndarray:
    """transformers' proportional RoPE: f32[head_dim/2], rotated pairs first, then zeros."""
    angles = int(partial * head_dim // 2)
    rotated = 1.0 / (theta ** (np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv_freq = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)]).astype(np.float32)
    return (inv_freq / np.float32(factor)).astype(np.float32)


def cos_sin_of(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[B, T, 2 * len(inv_freq)] of positions i32[B, T] for a given table."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first cos.shape[-1] dims of each head.

    Args:
      x: [..., heads, hd]; cos, sin: f32[..., r] with r <= hd (the same leading shape).
    Returns:
      x's shape and dtype.
    """
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    cos, sin = cos[..., None, :], sin[..., None, :]
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = (rot.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
    return out if r == x.shape[-1] else jnp.concatenate([out, rest], axis=-1)


def mrope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, section: tuple[int, ...]
                  ) -> tuple[jax.Array, jax.Array]:
    """M-RoPE (Qwen2.5-VL): cos, sin f32[B, T, rotary_dim] for 3-D positions i32[B, T, 3]
    (temporal, height, width). The rotary_dim / 2 frequencies are split into `section`'s runs
    (summing to rotary_dim / 2); run i turns with axis i % 3 of the position, so a text token
    (three equal positions) gets plain RoPE."""
    if sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {section} sums to {sum(section)}; rotary_dim {rotary_dim} needs "
                         f"{rotary_dim // 2}")
    inv_freq = jnp.asarray(rope_inv_freq(rotary_dim, theta, RopeScaling()))
    axis = np.repeat(np.arange(len(section)) % 3, section)  # the position axis each frequency reads
    freqs = positions[..., axis].astype(jnp.float32) * inv_freq  # [B, T, r/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)
