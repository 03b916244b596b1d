"""YaRN RoPE scaling as transformers computes it (`_compute_yarn_parameters`,
`yarn_get_mscale`, `yarn_apply_mscale` in `modeling_rope_utils.py`), for DeepSeek-V3.

    pos_freqs[i]  = theta^(2i/d)                                   (float32, as torch)
    extrapolated  = 1 / pos_freqs;  interpolated = 1 / (factor * pos_freqs)
    low, high     = the dims where beta_fast / beta_slow rotations fit the pretraining
                    context (floored / ceiled when `truncate`)
    ramp[i]       = clip((i - low) / (high - low), 0, 1)
    inv_freq      = interpolated * ramp + extrapolated * (1 - ramp)
    cos, sin      * attention_factor: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
                    when both are set, else mscale(factor); mscale(s, m) = 0.1 m ln(s) + 1 (s > 1)

MLA models also scale the softmax constant by mscale(factor, mscale_all_dim)^2
(`softmax_scale`): the non-rotary dims of q.k see it too, as in DeepSeek's reference.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float = 1.0  # resolved at parse time (module docstring)
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling yarn factor must be > 0; got {self.factor}")


def mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_from_dict(params: dict[str, Any], cfg: dict[str, Any]) -> YarnScaling:
    """A yarn `rope_parameters` / `rope_scaling` dict (with `cfg`, the whole config.json)."""
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    factor = params.get("factor")
    factor = float(factor) if factor else cfg.get("max_position_embeddings", original) / original
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return YarnScaling(factor=float(factor), original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       mscale=m, mscale_all_dim=m_all, attention_factor=float(attention_factor),
                       truncate=bool(params.get("truncate", True)))


def softmax_scale(base: float, yarn: YarnScaling | None) -> float:
    """The q.k constant of an MLA model: base * mscale(factor, mscale_all_dim)^2 under YaRN."""
    if yarn is None or not yarn.mscale_all_dim:
        return base
    return base * mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling) -> np.ndarray:
    """Inverse frequencies f32[dim/2] (module docstring)."""
    pos_freqs = (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (np.float32(yarn.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    return (interpolated * (1 - extrapolation) + extrapolated * extrapolation).astype(np.float32)


def yarn_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, yarn: YarnScaling) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[B, T, rotary_dim] (rotate-half layout: the frequencies twice)."""
    inv_freq = jnp.asarray(yarn_inv_freq(rotary_dim, theta, yarn))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * yarn.attention_factor, jnp.sin(emb) * yarn.attention_factor
