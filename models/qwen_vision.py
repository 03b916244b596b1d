"""Qwen2.5-VL's vision side: an image to patches (its processor), patches to the language model's
image tokens (its vision transformer and patch merger). Pure functions over a flat dict of
float32 arrays, no torch; how the tokens enter a prompt (and their 3-D M-RoPE positions) is the
engine's (`ferrox_jax/image_layout.py`, `ferrox_jax/images.py`).

Preprocessing (transformers' `Qwen2VLImageProcessorPil`, the same integers through PIL):

    smart_resize   each side to a multiple of patch x merge (28), the area kept within
                   [min_pixels, max_pixels] at about the image's aspect ratio
    resize         PIL BICUBIC on the uint8 image; x / 255, (x - mean) / std (CLIP's)
    patchify       [C, H, W] -> [gh * gw, C * T * p * p], patches laid out merge unit by merge
                   unit (2 x 2 neighbours together, units row-major), each patch repeated over
                   the temporal patch T = 2 (a still image is one frame twice)

An image is a grid (t, gh, gw) = (1, H / 14, W / 14) of patches and (t, gh / 2, gw / 2) of image
tokens: `<|image_pad|>` x gh gw / 4 between `<|vision_start|>` and `<|vision_end|>`.

The encoder (`Qwen2_5_VisionTransformerPretrainedModel`), over every patch of a call's images:

    x        = patches @ W_patch                           (the Conv3d with stride = kernel)
    order    merge units regrouped window by window (windows of window_size / patch / merge units
             per side, row-major; edge windows smaller); rotary angles follow the patches
    block i: x += proj(attn(RMS(x)))   full attention within the image on `fullatt_block_indexes`,
                                       within the window on the others; 2-D RoPE: head_dim / 4
                                       frequencies, the first half of the angles from the patch's
                                       row, the second from its column (rotate-half over head_dim)
             x += down(silu(gate(RMS(x))) * up(RMS(x)))  (biases; `hidden_act`)
    merger   RMS(x) (eps 1e-6), 4 patches of a unit concatenated, Linear -> GELU (erf) -> Linear
             to the text model's width; the units back in the image's order

A call packs several images (patches one after another; attention never crosses images) and is
padded to a bucket of patch counts (`patch_buckets`), so warm-up compiles each bucket once. The
attention is dense over the bucket with a segment mask: memory grows with the square of the
patches, so the served `max_pixels` is capped at `MAX_IMAGE_TOKENS` (1280) image tokens' worth (Qwen2.5-VL:
28 x 28 x 1280 pixels, the processor's own default); a checkpoint asking for more is served at the
cap, and says so in the log.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.config import UnsupportedModelError
from models.loaders.shards import read_tower

log = logging.getLogger(__name__)

MAX_IMAGE_TOKENS = 1280  # per image: 5120 patches (Qwen2.5-VL's processor's default max_pixels, 28 x 28 x 1280)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_ACTS = {"silu": jax.nn.silu, "gelu": functools.partial(jax.nn.gelu, approximate=False),
         "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
         "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """The encoder's and merger's shape, the image tokens, and the image processor's settings."""

    hidden: int
    depth: int
    heads: int
    intermediate: int
    out_hidden: int  # the text model's width
    fullatt_blocks: tuple[int, ...]
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int = 14
    temporal_patch: int = 2
    merge: int = 2
    window_size: int = 112
    act: str = "silu"
    theta: float = 10000.0
    channels: int = 3
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * MAX_IMAGE_TOKENS
    mean: tuple[float, ...] = _CLIP_MEAN
    std: tuple[float, ...] = _CLIP_STD
    rescale: float = 1 / 255

    def __post_init__(self) -> None:
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise UnsupportedModelError(f"vision hidden_size {self.hidden} over num_heads {self.heads} must be a "
                                        "head size divisible by 4 (2-D rotary angles)")
        if self.act not in _ACTS:
            raise UnsupportedModelError(f"vision hidden_act {self.act!r} is not supported (supported: {sorted(_ACTS)})")
        if self.window_size % (self.patch_size * self.merge):
            raise UnsupportedModelError(f"vision window_size {self.window_size} is not a multiple of patch_size x "
                                        f"spatial_merge_size ({self.patch_size * self.merge})")

    @property
    def factor(self) -> int:
        """Pixels per image token side (patch x merge: 28)."""
        return self.patch_size * self.merge

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch * self.patch_size ** 2

    @property
    def max_patches(self) -> int:
        return self.max_pixels // self.patch_size ** 2

    @property
    def bidirectional(self) -> bool:
        return False  # the text model attends causally over image tokens


def vision_config(cfg: Mapping, processor: Mapping | None = None) -> QwenVisionConfig:
    """A `Qwen2_5_VLForConditionalGeneration` config.json's vision side (and its
    preprocessor_config.json's settings, when given)."""
    v = dict(cfg.get("vision_config") or {})
    p = dict(processor or {})
    if p.get("do_resize", True) is False or p.get("do_rescale", True) is False or p.get("do_normalize", True) is False:
        raise UnsupportedModelError("an image processor without resize, rescale or normalize is not supported")
    if int(p.get("resample", 3)) != 3:
        raise UnsupportedModelError(f"image processor resample {p.get('resample')} is not supported (BICUBIC: 3)")
    size = p.get("size") or {}
    min_pixels = int(p.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    patch = int(v.get("patch_size", 14))
    merge = int(v.get("spatial_merge_size", 2))
    cap = MAX_IMAGE_TOKENS * (patch * merge) ** 2
    max_pixels = int(p.get("max_pixels") or size.get("longest_edge") or cap)
    if max_pixels > cap:
        log.info("images up to %d pixels (the processor allows %d): the encoder's attention is dense over an "
                 "image's patches", cap, max_pixels)
        max_pixels = cap
    for key, want in (("patch_size", patch), ("merge_size", merge), ("temporal_patch_size",
                                                                     int(v.get("temporal_patch_size", 2)))):
        if key in p and int(p[key]) != want:
            raise UnsupportedModelError(f"image processor {key} {p[key]} differs from the vision encoder's {want}")
    rope = v.get("rope_parameters") or {}
    return QwenVisionConfig(
        hidden=int(v.get("hidden_size", 1280)), depth=int(v.get("depth", 32)), heads=int(v.get("num_heads", 16)),
        intermediate=int(v.get("intermediate_size", 3420)), out_hidden=int(v.get("out_hidden_size", 3584)),
        fullatt_blocks=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        image_token_id=int(cfg.get("image_token_id", 151655)),
        vision_start_id=int(cfg.get("vision_start_token_id", 151652)),
        vision_end_id=int(cfg.get("vision_end_token_id", 151653)), patch_size=patch,
        temporal_patch=int(v.get("temporal_patch_size", 2)), merge=merge, window_size=int(v.get("window_size", 112)),
        act=v.get("hidden_act", "silu"), theta=float(rope.get("rope_theta", 10000.0)),
        channels=int(v.get("in_channels", 3)), min_pixels=min_pixels, max_pixels=max(max_pixels, min_pixels),
        mean=tuple(float(x) for x in p.get("image_mean", _CLIP_MEAN)),
        std=tuple(float(x) for x in p.get("image_std", _CLIP_STD)), rescale=float(p.get("rescale_factor", 1 / 255)))


# -- preprocessing (numpy + PIL, no torch) -------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """HF's `smart_resize`: each side a multiple of `factor`, the area within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio is {max(height, width) / min(height, width):.0f}; the limit is 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify_image(image, cfg: QwenVisionConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An RGB PIL image -> (patches f32[gh * gw, C * T * p * p], grid (1, gh, gw)), as HF's PIL
    processor. Raises ValueError for an aspect ratio past 200."""
    from PIL import Image

    height, width = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    x = np.asarray(image, np.float64) * cfg.rescale
    x = ((x - np.asarray(cfg.mean, np.float64)) / np.asarray(cfg.std, np.float64)).transpose(2, 0, 1)
    x = x.astype(np.float32)
    p, m, c = cfg.patch_size, cfg.merge, cfg.channels
    gh, gw = height // p, width // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh', gw', m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], cfg.temporal_patch, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, cfg.patch_dim), np.float32), (1, gh, gw)


def window_order(grid: tuple[int, int, int], cfg: QwenVisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(units i64[U], window i64[U]): the image's merge units in window order, and each one's
    window (HF's `get_vision_window_index`, empty windows dropped; `window_size` 0: one window)."""
    t, gh, gw = grid
    lh, lw, win = gh // cfg.merge, gw // cfg.merge, cfg.window_size // cfg.factor
    if not win:  # no window attention (Qwen3-VL): the units in their order, one window
        return np.arange(t * lh * lw), np.zeros(t * lh * lw, np.int64)
    ph, pw = lh + win - lh % win, lw + win - lw % win
    padded = np.full((t, ph, pw), -1, np.int64)
    padded[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw)
    nh, nw = ph // win, pw // win
    padded = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(-1)
    windows = np.repeat(np.arange(t * nh * nw), win * win)
    keep = padded >= 0
    return padded[keep], windows[keep]


def patch_buckets(cfg: QwenVisionConfig) -> tuple[int, ...]:
    """Patch counts one encoder call is padded to: 16 x 4^k under the most an image may have,
    then that (a multiple of 4)."""
    top = -(-cfg.max_patches // 4) * 4
    out = [16]
    while out[-1] * 4 < top:
        out.append(out[-1] * 4)
    return tuple(b for b in out if b < top) + (top,)


@dataclasses.dataclass(frozen=True)
class PackedCall:
    """One encoder call's inputs over some images (host arrays, padded to `bucket` patches)."""

    patches: np.ndarray  # f32[bucket, patch_dim] in window order
    rows_cols: np.ndarray  # i32[bucket, 2]: each patch's row and column in its image
    window: np.ndarray  # i32[bucket]: the window each patch attends within (-1: padding)
    image: np.ndarray  # i32[bucket]: the image each patch attends within (-1: padding)
    units: np.ndarray  # i64[U]: the call's merge units (over its images, in their order) in window order
    tokens: tuple[int, ...]  # image tokens per image


def pack(pictures: list[tuple[np.ndarray, tuple[int, int, int]]], bucket: int, cfg: QwenVisionConfig) -> PackedCall:
    """The encoder's inputs for (patches, grid) pictures whose patches fit in `bucket`."""
    unit = cfg.merge ** 2
    patches = np.zeros((bucket, cfg.patch_dim), np.float32)
    rows_cols = np.zeros((bucket, 2), np.int32)
    window = np.full(bucket, -1, np.int32)
    image = np.full(bucket, -1, np.int32)
    units, tokens, at, unit_base, window_base = [], [], 0, 0, 0
    for i, (pix, grid) in enumerate(pictures):
        t, gh, gw = grid
        order, windows = window_order(grid, cfg)
        # each patch's row / column, in the processor's (merge-unit-major) order
        hh, ww = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        shape = (gh // cfg.merge, cfg.merge, gw // cfg.merge, cfg.merge)
        rc = np.stack([hh.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
                       ww.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)], -1)
        rc = np.tile(rc, (t, 1))
        take = (order[:, None] * unit + np.arange(unit)).reshape(-1)  # patches of the units in window order
        n = len(take)
        patches[at:at + n] = pix[take]
        rows_cols[at:at + n] = rc[take]
        window[at:at + n] = np.repeat(windows, unit) + window_base
        image[at:at + n] = i
        units.append(order + unit_base)
        tokens.append(len(order))
        at, unit_base, window_base = at + n, unit_base + len(order), window_base + int(windows.max()) + 1
    return PackedCall(patches, rows_cols, window, image,
                      np.concatenate(units) if units else np.zeros(0, np.int64), tuple(tokens))


def unpack(call: PackedCall, out: np.ndarray) -> list[np.ndarray]:
    """The call's output f32[bucket / 4, D] -> one f32[tokens, D] per image, in its own order."""
    merged = np.empty((len(call.units), out.shape[-1]), np.float32)
    merged[call.units] = out[:len(call.units)]
    return np.split(merged, np.cumsum(call.tokens)[:-1])


# -- the encoder ---------------------------------------------------------------------------------

def _rms(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def qwen_image_tokens(params: Mapping[str, jax.Array], patches: jax.Array, rows_cols: jax.Array, window: jax.Array,
                      image: jax.Array, cfg: QwenVisionConfig) -> jax.Array:
    """A packed call (`PackedCall`'s arrays, P patches) -> f32[P / 4, out_hidden] in window order;
    one compile per P."""
    hd = cfg.hidden // cfg.heads
    spatial = hd // 2
    inv = 1.0 / (cfg.theta ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)))
    freqs = rows_cols.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)  # [P, 2, hd / 4]
    freqs = freqs.reshape(freqs.shape[0], -1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [P, 1, hd]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    masks = {True: image[:, None] == image[None, :], False: window[:, None] == window[None, :]}
    act = _ACTS[cfg.act]
    x = patches @ params["patch_embed"]
    n = x.shape[0]
    for i in range(cfg.depth):
        p = {k: params[f"blocks.{i}.{k}"] for k in ("norm1", "norm2", "qkv_w", "qkv_b", "proj_w", "proj_b", "gate_w",
                                                     "gate_b", "up_w", "up_b", "down_w", "down_b")}
        qkv = (_rms(x, p["norm1"]) @ p["qkv_w"] + p["qkv_b"]).reshape(n, 3, cfg.heads, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        scores = jnp.einsum("qhd,khd->hqk", q, k) * (hd ** -0.5)
        scores = jnp.where(masks[i in cfg.fullatt_blocks][None], scores, -jnp.inf)
        attn = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, cfg.hidden)
        x = x + attn @ p["proj_w"] + p["proj_b"]
        h = _rms(x, p["norm2"])
        x = x + (act(h @ p["gate_w"] + p["gate_b"]) * (h @ p["up_w"] + p["up_b"])) @ p["down_w"] + p["down_b"]
    m = _rms(x, params["merger_norm"]).reshape(n // cfg.merge ** 2, -1)
    m = jax.nn.gelu(m @ params["merger_w0"] + params["merger_b0"], approximate=False)
    return m @ params["merger_w2"] + params["merger_b2"]


# -- weights -------------------------------------------------------------------------------------

_BLOCK_NAMES = {  # ours -> HF suffix after blocks.{i}.; linears transposed to [in, out]
    "norm1": "norm1.weight", "norm2": "norm2.weight", "qkv_w": "attn.qkv.weight", "qkv_b": "attn.qkv.bias",
    "proj_w": "attn.proj.weight", "proj_b": "attn.proj.bias", "gate_w": "mlp.gate_proj.weight",
    "gate_b": "mlp.gate_proj.bias", "up_w": "mlp.up_proj.weight", "up_b": "mlp.up_proj.bias",
    "down_w": "mlp.down_proj.weight", "down_b": "mlp.down_proj.bias"}
_TOWERS = ("visual.", "model.visual.")  # the Hub's checkpoints; transformers 5's own layout


def expected_shapes(cfg: QwenVisionConfig) -> dict[str, tuple[int, ...]]:
    d, f, u = cfg.hidden, cfg.intermediate, cfg.hidden * cfg.merge ** 2
    shapes = {"patch_embed": (cfg.patch_dim, d), "merger_norm": (d,), "merger_w0": (u, u), "merger_b0": (u,),
              "merger_w2": (u, cfg.out_hidden), "merger_b2": (cfg.out_hidden,)}
    block = {"norm1": (d,), "norm2": (d,), "qkv_w": (d, 3 * d), "qkv_b": (3 * d,), "proj_w": (d, d), "proj_b": (d,),
             "gate_w": (d, f), "gate_b": (f,), "up_w": (d, f), "up_b": (f,), "down_w": (f, d), "down_b": (d,)}
    for i in range(cfg.depth):
        shapes.update({f"blocks.{i}.{k}": s for k, s in block.items()})
    return shapes


def vision_tensor_names(cfg: QwenVisionConfig) -> dict[str, str]:
    """ours -> the HF suffix after the tower's prefix."""
    names = {"patch_embed": "patch_embed.proj.weight", "merger_norm": "merger.ln_q.weight",
             "merger_w0": "merger.mlp.0.weight", "merger_b0": "merger.mlp.0.bias",
             "merger_w2": "merger.mlp.2.weight", "merger_b2": "merger.mlp.2.bias"}
    for i in range(cfg.depth):
        names.update({f"blocks.{i}.{ours}": f"blocks.{i}.{hf}" for ours, hf in _BLOCK_NAMES.items()})
    return names


def _to_ours(name: str, raw: np.ndarray) -> np.ndarray:
    if name == "patch_embed":  # Conv3d [D, C, T, p, p] -> [C T p p, D]
        return raw.reshape(raw.shape[0], -1).T
    return raw.T if raw.ndim == 2 else raw


def read_processor(folder: str | Path) -> dict | None:
    """The folder's preprocessor_config.json, None when it has none (the defaults apply)."""
    path = Path(folder) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def read_qwen_vision(folder: str | Path) -> tuple[QwenVisionConfig, dict[str, jax.Array]]:
    """The vision transformer and merger of a Qwen2.5-VL folder, as float32 arrays. Raises
    CheckpointFileError naming the first missing tensor or wrong shape."""
    folder = Path(folder)
    cfg = vision_config(json.loads((folder / "config.json").read_text()), read_processor(folder))
    tensors = read_tower(folder, vision_tensor_names(cfg), expected_shapes(cfg), _to_ours, _TOWERS)
    return cfg, {ours: jnp.asarray(value) for ours, value in tensors.items()}
