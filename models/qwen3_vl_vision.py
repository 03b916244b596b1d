"""Qwen3-VL's vision side: Qwen2.5-VL's processor and packing (`models/qwen_vision.py`) with
16-pixel patches, and its own vision transformer, which differs from Qwen2.5-VL's in:

    x        = patches @ W_patch + b  +  pos_embed bilinearly resampled (align_corners) from its
               square learned grid (`num_position_embeddings`) to the image's patch grid
    blocks   full attention within the image in every block (no windows); LayerNorms with
             biases; MLP fc2(gelu_tanh(fc1(x))); the same 2-D rotary angles
    merger   LayerNorm(x) per patch, 4 patches of a unit concatenated, fc1 -> GELU (erf) -> fc2
    deepstack after each block of `deepstack_visual_indexes`, a merger of its own over that block's
             output (its LayerNorm over the 4 concatenated patches): one more set of image tokens
             each, which the text model adds to its hidden states after its first layers
             (`models/qwen3_vl.py`)

`qwen3_image_tokens` returns the main tokens and the deepstack ones side by side,
f32[P / 4, out_hidden * (1 + len(deepstack))]: one embedding row per image token, as the engine's
encoder cache and image columns hold them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.loaders.shards import read_tower
from models.qwen_vision import QwenVisionConfig, _rotate_half, read_processor, vision_config

_TOWERS = ("model.visual.", "visual.")


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig(QwenVisionConfig):
    grid_side: int = 48  # sqrt(num_position_embeddings)
    deepstack: tuple[int, ...] = ()  # the blocks whose outputs feed the text model's first layers

    @property
    def token_width(self) -> int:
        """Floats per image token: the main tokens and the deepstack ones side by side."""
        return self.out_hidden * (1 + len(self.deepstack))


def qwen3_vision_config(cfg: Mapping, processor: Mapping | None = None) -> Qwen3VisionConfig:
    """A `Qwen3VLForConditionalGeneration` config.json's vision side (and its processor's settings)."""
    v = dict(cfg.get("vision_config") or {})
    p = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, **(processor or {})}
    base = vision_config({**cfg, "vision_config": {"patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                                                   "fullatt_block_indexes": (), "window_size": 0, **v}}, p)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(QwenVisionConfig)}
    return Qwen3VisionConfig(**fields, grid_side=int(round(int(v.get("num_position_embeddings", 2304)) ** 0.5)),
                             deepstack=tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))))


def position_taps(rows_cols: np.ndarray, sizes: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices i32[P, 4], weights f32[P, 4]) into the flat learned grid for patches at
    rows_cols i32[P, 2] of images of sizes i32[P, 2] (rows, cols): bilinear, align_corners, as
    HF's `get_vision_interpolation_indices_and_weights`."""
    taps, weights = [], []
    for axis in (0, 1):
        index = rows_cols[:, axis].astype(np.float32)
        size = np.maximum(sizes[:, axis] - 1, 1).astype(np.float32)
        src = index * np.float32(side - 1) / size
        floor = np.floor(src)
        offsets = np.arange(2, dtype=np.float32)
        taps.append(np.clip(floor[:, None].astype(np.int64) + offsets.astype(np.int64), 0, side - 1))
        weights.append(np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None).astype(np.float32))
    indices = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4)
    return indices.astype(np.int32), (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)


def _ln(x: jax.Array, w: jax.Array, b: jax.Array, eps: float = 1e-6) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _merge(params: Mapping[str, jax.Array], prefix: str, x: jax.Array, unit: int, post_shuffle: bool) -> jax.Array:
    n = x.shape[0] // unit
    if post_shuffle:
        x = _ln(x.reshape(n, -1), params[f"{prefix}.norm_w"], params[f"{prefix}.norm_b"])
    else:
        x = _ln(x, params[f"{prefix}.norm_w"], params[f"{prefix}.norm_b"]).reshape(n, -1)
    x = jax.nn.gelu(x @ params[f"{prefix}.fc1_w"] + params[f"{prefix}.fc1_b"], approximate=False)
    return x @ params[f"{prefix}.fc2_w"] + params[f"{prefix}.fc2_b"]


@functools.partial(jax.jit, static_argnames=("cfg",))
def qwen3_image_tokens(params: Mapping[str, jax.Array], patches: jax.Array, rows_cols: jax.Array, image: jax.Array,
                       taps: jax.Array, weights: jax.Array, cfg: Qwen3VisionConfig) -> jax.Array:
    """A packed call's P patches -> f32[P / 4, token_width] (main tokens, then each deepstack's)."""
    hd = cfg.hidden // cfg.heads
    spatial = hd // 2
    inv = 1.0 / (cfg.theta ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)))
    freqs = (rows_cols.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)).reshape(rows_cols.shape[0], -1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    mask = (image[:, None] == image[None, :])[None]
    x = patches @ params["patch_embed"] + params["patch_bias"]
    x = x + jnp.sum(params["pos_embed"][taps] * weights[..., None], axis=1)
    n, unit = x.shape[0], cfg.merge ** 2
    deep = []
    for i in range(cfg.depth):
        p = {k: params[f"blocks.{i}.{k}"] for k in ("norm1_w", "norm1_b", "norm2_w", "norm2_b", "qkv_w", "qkv_b",
                                                     "proj_w", "proj_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b")}
        qkv = (_ln(x, p["norm1_w"], p["norm1_b"]) @ p["qkv_w"] + p["qkv_b"]).reshape(n, 3, cfg.heads, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        scores = jnp.where(mask, jnp.einsum("qhd,khd->hqk", q, k) * (hd ** -0.5), -jnp.inf)
        attn = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, cfg.hidden)
        x = x + attn @ p["proj_w"] + p["proj_b"]
        h = _ln(x, p["norm2_w"], p["norm2_b"])
        x = x + jax.nn.gelu(h @ p["fc1_w"] + p["fc1_b"], approximate=True) @ p["fc2_w"] + p["fc2_b"]
        if i in cfg.deepstack:
            deep.append(_merge(params, f"deepstack.{cfg.deepstack.index(i)}", x, unit, True))
    return jnp.concatenate([_merge(params, "merger", x, unit, False), *deep], axis=-1)


# -- weights -------------------------------------------------------------------------------------

_BLOCK = {"norm1_w": "norm1.weight", "norm1_b": "norm1.bias", "norm2_w": "norm2.weight", "norm2_b": "norm2.bias",
          "qkv_w": "attn.qkv.weight", "qkv_b": "attn.qkv.bias", "proj_w": "attn.proj.weight",
          "proj_b": "attn.proj.bias", "fc1_w": "mlp.linear_fc1.weight", "fc1_b": "mlp.linear_fc1.bias",
          "fc2_w": "mlp.linear_fc2.weight", "fc2_b": "mlp.linear_fc2.bias"}
_MERGER = {"norm_w": "norm.weight", "norm_b": "norm.bias", "fc1_w": "linear_fc1.weight", "fc1_b": "linear_fc1.bias",
           "fc2_w": "linear_fc2.weight", "fc2_b": "linear_fc2.bias"}


def expected_shapes(cfg: Qwen3VisionConfig) -> dict[str, tuple[int, ...]]:
    d, f, u, o = cfg.hidden, cfg.intermediate, cfg.hidden * cfg.merge ** 2, cfg.out_hidden
    shapes = {"patch_embed": (cfg.patch_dim, d), "patch_bias": (d,), "pos_embed": (cfg.grid_side ** 2, d)}
    block = {"norm1_w": (d,), "norm1_b": (d,), "norm2_w": (d,), "norm2_b": (d,), "qkv_w": (d, 3 * d),
             "qkv_b": (3 * d,), "proj_w": (d, d), "proj_b": (d,), "fc1_w": (d, f), "fc1_b": (f,), "fc2_w": (f, d),
             "fc2_b": (d,)}
    for i in range(cfg.depth):
        shapes.update({f"blocks.{i}.{k}": s for k, s in block.items()})
    for prefix, norm in [("merger", d)] + [(f"deepstack.{j}", u) for j in range(len(cfg.deepstack))]:
        shapes.update({f"{prefix}.norm_w": (norm,), f"{prefix}.norm_b": (norm,), f"{prefix}.fc1_w": (u, u),
                       f"{prefix}.fc1_b": (u,), f"{prefix}.fc2_w": (u, o), f"{prefix}.fc2_b": (o,)})
    return shapes


def vision_tensor_names(cfg: Qwen3VisionConfig) -> dict[str, str]:
    names = {"patch_embed": "patch_embed.proj.weight", "patch_bias": "patch_embed.proj.bias",
             "pos_embed": "pos_embed.weight"}
    for i in range(cfg.depth):
        names.update({f"blocks.{i}.{ours}": f"blocks.{i}.{hf}" for ours, hf in _BLOCK.items()})
    for prefix, hf_prefix in [("merger", "merger")] + [(f"deepstack.{j}", f"deepstack_merger_list.{j}")
                                                       for j in range(len(cfg.deepstack))]:
        names.update({f"{prefix}.{ours}": f"{hf_prefix}.{hf}" for ours, hf in _MERGER.items()})
    return names


def read_qwen3_vision(folder: str | Path) -> tuple[Qwen3VisionConfig, dict[str, jax.Array]]:
    """The vision transformer, merger and deepstack mergers of a Qwen3-VL folder, float32.
    Raises CheckpointFileError naming the first missing tensor or wrong shape."""
    folder = Path(folder)
    cfg = qwen3_vision_config(json.loads((folder / "config.json").read_text()), read_processor(folder))
    tensors = read_tower(folder, vision_tensor_names(cfg), expected_shapes(cfg), _qwen3_layout, _TOWERS)
    return cfg, {ours: jnp.asarray(value) for ours, value in tensors.items()}


def _qwen3_layout(ours: str, raw: np.ndarray) -> np.ndarray:
    """An HF tensor in our layout: the patch conv flattened to a matrix, 2-D weights transposed."""
    if ours == "patch_embed":
        return raw.reshape(raw.shape[0], -1).T
    return raw.T if raw.ndim == 2 and ours != "pos_embed" else raw
