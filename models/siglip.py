"""The SigLIP vision encoder and Gemma 3's projector: pixels in, the language model's soft tokens out.

Gemma 3's vision-language checkpoints (`Gemma3ForConditionalGeneration`) put a SigLIP
vision transformer and a small projector before the text model; SmolVLM / Idefics3 use the
same encoder (`models/idefics3.py` reuses `encode`, `LAYER_NAMES` and `to_ours`). This module
is the encoder and the projector as pure functions over a flat dict of arrays, jitted per
image count; how their output enters a prompt (the image's soft tokens replace its placeholder
tokens; attention is bidirectional within an image for Gemma 3, causal for Idefics3) is the
engine's business, not this module's.

The encoder, as transformers' `SiglipVisionModel` computes it (no pooling head):

    patches  = conv(pixels, patch x patch, stride patch)   = unfold(pixels) @ W_patch + b
    h        = patches + position_embedding                 [B, P, Dv], P = (image / patch)^2
    layer:   h += out(attn(LN1(h)))                         full (bidirectional) attention, biases
             h += fc2(gelu_tanh(fc1(LN2(h))))
    out      = LN_post(h)

Gemma 3's projector (`Gemma3MultiModalProjector`): average-pool the P patches on their
square grid down to `mm_tokens_per_image` (256: a 64 x 64 grid pooled by 4), an RMSNorm
times (1 + w), then `@ mm_input_projection_weight` [Dv, D_text]. The features are *not*
scaled by sqrt(hidden) as Gemma's text embeddings are.

Everything is float32 (the CPU's fast type; on accelerators the caller may cast the params).
Weights are read from the checkpoint's own names (`read_gemma3_vision`), HF's
`[out, in]` linears transposed to `[in, out]` once at load. Tensor parallelism: the
encoder is small beside the text model and runs replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.config import CheckpointFileError, UnsupportedModelError
from models.loaders.shards import read_tower


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A SigLIP encoder's shape (HF `SiglipVisionConfig`) and Gemma 3's projector's."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    image_size: int
    patch_size: int
    eps: float = 1e-6
    channels: int = 3
    tokens_per_image: int = 256  # Gemma 3's mm_tokens_per_image
    text_hidden: int = 0  # the projector's output width
    image_token_id: int = -1  # the soft token an image's features replace (Gemma 3: <image_soft_token>)
    boi_token_id: int = -1  # <start_of_image>, which the processor expands into the image's tokens
    eoi_token_id: int = -1  # <end_of_image>

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise UnsupportedModelError(f"vision hidden_size {self.hidden} is not a multiple of "
                                        f"num_attention_heads {self.heads}")
        if self.image_size % self.patch_size:
            raise UnsupportedModelError(f"vision image_size {self.image_size} is not a multiple of "
                                        f"patch_size {self.patch_size}")
        side = math.isqrt(self.tokens_per_image)
        if side * side != self.tokens_per_image or self.patches_per_side % max(side, 1):
            raise UnsupportedModelError(f"mm_tokens_per_image {self.tokens_per_image} must be a square whose "
                                        f"side divides the {self.patches_per_side} patches per side")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @classmethod
    def from_gemma3(cls, config: Mapping) -> "VisionConfig":
        """From a `Gemma3ForConditionalGeneration` config.json (its vision_config and text_config)."""
        v = config.get("vision_config") or {}
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported "
                                        "(SigLIP uses gelu_pytorch_tanh)")
        # A SigLIP pooling head (vision_use_head) may be in the checkpoint; Gemma 3 reads the last
        # hidden state, never the head, so its weights are left unread.
        text = config.get("text_config") or {}
        return cls(hidden=int(v.get("hidden_size", 1152)), layers=int(v.get("num_hidden_layers", 27)),
                   heads=int(v.get("num_attention_heads", 16)), intermediate=int(v.get("intermediate_size", 4304)),
                   image_size=int(v.get("image_size", 896)), patch_size=int(v.get("patch_size", 14)),
                   eps=float(v.get("layer_norm_eps", 1e-6)), channels=int(v.get("num_channels", 3)),
                   tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
                   text_hidden=int(text.get("hidden_size", 2560)),
                   image_token_id=int(config.get("image_token_id", config.get("image_token_index", 262144))),
                   boi_token_id=int(config.get("boi_token_id", config.get("boi_token_index", 255999))),
                   eoi_token_id=int(config.get("eoi_token_id", config.get("eoi_token_index", 256000))))


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _gelu_tanh(x: jax.Array) -> jax.Array:
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[B, C, H, W] -> [B, (H/p)(W/p), C p p]: the patches in row-major grid order, each flattened
    in the conv weight's (C, kh, kw) order, so `patchify(x) @ W.reshape(D, -1).T` is the conv."""
    b, c, h, w = pixels.shape
    x = pixels.reshape(b, c, h // patch, patch, w // patch, patch)
    x = x.transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)


def encode(params: Mapping[str, jax.Array], pixels: jax.Array, cfg: VisionConfig) -> jax.Array:
    """SigLIP's last hidden state: pixels f32[B, C, S, S] (normalised) -> f32[B, P, Dv]."""
    h = patchify(pixels, cfg.patch_size) @ params["patch_embedding"] + params["patch_bias"]
    h = h + params["position_embedding"][None]
    b, p, d = h.shape
    hd = d // cfg.heads
    for i in range(cfg.layers):
        get = functools.partial(_layer_param, params, i)
        x = _layer_norm(h, get("ln1_w"), get("ln1_b"), cfg.eps)
        q = (x @ get("q_w") + get("q_b")).reshape(b, p, cfg.heads, hd)
        k = (x @ get("k_w") + get("k_b")).reshape(b, p, cfg.heads, hd)
        v = (x @ get("v_w") + get("v_b")).reshape(b, p, cfg.heads, hd)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (hd ** -0.5)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(b, p, d)
        h = h + attn @ get("o_w") + get("o_b")
        x = _layer_norm(h, get("ln2_w"), get("ln2_b"), cfg.eps)
        h = h + _gelu_tanh(x @ get("fc1_w") + get("fc1_b")) @ get("fc2_w") + get("fc2_b")
    return _layer_norm(h, params["post_ln_w"], params["post_ln_b"], cfg.eps)


def _layer_param(params: Mapping[str, jax.Array], layer: int, name: str) -> jax.Array:
    return params[f"layers.{layer}.{name}"]


def gemma3_project(params: Mapping[str, jax.Array], features: jax.Array, cfg: VisionConfig) -> jax.Array:
    """Gemma 3's projector: f32[B, P, Dv] -> the soft tokens f32[B, tokens_per_image, D_text]."""
    b, _, d = features.shape
    s = cfg.patches_per_side
    t = math.isqrt(cfg.tokens_per_image)
    k = s // t
    pooled = features.reshape(b, t, k, t, k, d).mean(axis=(2, 4)).reshape(b, t * t, d)
    normed = pooled * jax.lax.rsqrt(jnp.mean(jnp.square(pooled), axis=-1, keepdims=True) + cfg.eps)
    normed = normed * (1.0 + params["mm_norm"])
    return normed @ params["mm_projection"]


@functools.partial(jax.jit, static_argnames=("cfg",))
def gemma3_image_tokens(params: Mapping[str, jax.Array], pixels: jax.Array, cfg: VisionConfig) -> jax.Array:
    """pixels f32[B, C, S, S] -> the soft tokens of B images, f32[B, tokens_per_image, D_text].
    One compile per image count B: callers bucket B."""
    return gemma3_project(params, encode(params, pixels, cfg), cfg)


# -- weights -------------------------------------------------------------------------------------

_TOWER = "vision_tower."
_PROJECTOR = "multi_modal_projector."
LAYER_NAMES = {  # ours -> HF suffix after encoder.layers.{i}. (SigLIP and Idefics3 alike); linears are transposed
    "ln1_w": "layer_norm1.weight", "ln1_b": "layer_norm1.bias",
    "ln2_w": "layer_norm2.weight", "ln2_b": "layer_norm2.bias",
    "q_w": "self_attn.q_proj.weight", "q_b": "self_attn.q_proj.bias",
    "k_w": "self_attn.k_proj.weight", "k_b": "self_attn.k_proj.bias",
    "v_w": "self_attn.v_proj.weight", "v_b": "self_attn.v_proj.bias",
    "o_w": "self_attn.out_proj.weight", "o_b": "self_attn.out_proj.bias",
    "fc1_w": "mlp.fc1.weight", "fc1_b": "mlp.fc1.bias",
    "fc2_w": "mlp.fc2.weight", "fc2_b": "mlp.fc2.bias",
}


def vision_tensor_names(cfg: VisionConfig) -> dict[str, str]:
    """Ours -> the checkpoint's tensor name, for every parameter the encoder and projector read."""
    names = {
        "patch_embedding": _TOWER + "embeddings.patch_embedding.weight",
        "patch_bias": _TOWER + "embeddings.patch_embedding.bias",
        "position_embedding": _TOWER + "embeddings.position_embedding.weight",
        "post_ln_w": _TOWER + "post_layernorm.weight",
        "post_ln_b": _TOWER + "post_layernorm.bias",
        "mm_norm": _PROJECTOR + "mm_soft_emb_norm.weight",
        "mm_projection": _PROJECTOR + "mm_input_projection_weight",
    }
    for i in range(cfg.layers):
        for ours, hf in LAYER_NAMES.items():
            names[f"layers.{i}.{ours}"] = f"{_TOWER}encoder.layers.{i}.{hf}"
    return names


def expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes (after the load-time transposes)."""
    d, f = cfg.hidden, cfg.intermediate
    shapes = {
        "patch_embedding": (cfg.channels * cfg.patch_size ** 2, d), "patch_bias": (d,),
        "position_embedding": (cfg.num_patches, d), "post_ln_w": (d,), "post_ln_b": (d,),
        "mm_norm": (d,), "mm_projection": (d, cfg.text_hidden),
    }
    per_layer = {"ln1_w": (d,), "ln1_b": (d,), "ln2_w": (d,), "ln2_b": (d,), "fc1_w": (d, f), "fc1_b": (f,),
                 "fc2_w": (f, d), "fc2_b": (d,)}
    per_layer.update({f"{p}_w": (d, d) for p in "qkvo"})
    per_layer.update({f"{p}_b": (d,) for p in "qkvo"})
    for i in range(cfg.layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def canonical_name(key: str) -> str:
    """A checkpoint's tensor name as `vision_tensor_names` spells it. The same tensor is saved under
    several names: `vision_tower.embeddings...` (transformers 5), `vision_tower.vision_model.
    embeddings...` (the released Hub checkpoints), either under `model.`."""
    key = key.removeprefix("model.")
    if key.startswith("vision_tower.vision_model."):
        key = "vision_tower." + key.removeprefix("vision_tower.vision_model.")
    return key


def to_ours(name: str, raw: np.ndarray) -> np.ndarray:
    """A checkpoint's encoder tensor in our layout (the conv and the linears transposed)."""
    if name == "patch_embedding":  # conv [Dv, C, p, p] -> [C p p, Dv]
        return raw.reshape(raw.shape[0], -1).T
    if name.endswith("_w") and raw.ndim == 2:  # HF Linear [out, in] -> [in, out]
        return raw.T
    return raw


def read_gemma3_vision(folder: str | Path) -> tuple[VisionConfig, dict[str, jax.Array]]:
    """The encoder and projector of a `Gemma3ForConditionalGeneration` folder, as float32 arrays.

    Raises CheckpointFileError naming the first missing tensor or wrong shape."""
    folder = Path(folder)
    cfg = VisionConfig.from_gemma3(json.loads((folder / "config.json").read_text()))
    tensors = read_tower(folder, vision_tensor_names(cfg), expected_shapes(cfg), to_ours)
    return cfg, {ours: jnp.asarray(value) for ours, value in tensors.items()}


# -- llama.cpp's projector files (`--mmproj`) ------------------------------------------------------

_MMPROJ_GLOBAL = {  # ours -> the tensor's name in llama.cpp's mmproj GGUF (its converter's names)
    "patch_embedding": "v.patch_embd.weight", "patch_bias": "v.patch_embd.bias",
    "position_embedding": "v.position_embd.weight", "post_ln_w": "v.post_ln.weight", "post_ln_b": "v.post_ln.bias",
    "mm_norm": "mm.soft_emb_norm.weight", "mm_projection": "mm.input_projection.weight",
}
_MMPROJ_LAYER = {  # ours -> the suffix after v.blk.{i}.
    "ln1_w": "ln1.weight", "ln1_b": "ln1.bias", "ln2_w": "ln2.weight", "ln2_b": "ln2.bias",
    "q_w": "attn_q.weight", "q_b": "attn_q.bias", "k_w": "attn_k.weight", "k_b": "attn_k.bias",
    "v_w": "attn_v.weight", "v_b": "attn_v.bias", "o_w": "attn_out.weight", "o_b": "attn_out.bias",
    "fc1_w": "ffn_up.weight", "fc1_b": "ffn_up.bias", "fc2_w": "ffn_down.weight", "fc2_b": "ffn_down.bias",
}
IMAGE_TOKENS = ("<image_soft_token>", "<start_of_image>", "<end_of_image>")  # Gemma 3's, by text


def _f32_value(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def read_gemma3_mmproj(path: str | Path, tokenizer: Any) -> tuple[VisionConfig, dict[str, jax.Array]]:
    """The encoder and projector of a llama.cpp `mmproj` GGUF of Gemma 3 (`clip.projector_type`
    gemma3), as float32 arrays; the image token ids from the text model's `tokenizer`.

    llama.cpp's converter keeps HF's tensors (its own names, F16/F32 or a block format: dequantized
    here) and stores the projector's norm as 1 + w (undone here). Raises CheckpointFileError naming
    the file and what is missing; UnsupportedModelError for another projector."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointFileError(f"--mmproj {path} is not a readable GGUF file ({e})") from None
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.")}
    kind = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if kind != "gemma3":
        raise UnsupportedModelError(f"--mmproj {path.name}: projector type {kind!r} is not supported (gemma3 only)")
    for key in ("clip.vision.image_mean", "clip.vision.image_std"):
        if key in meta and [round(float(v), 6) for v in meta[key]] != [0.5, 0.5, 0.5]:
            raise UnsupportedModelError(f"--mmproj {path.name}: {key} {meta[key]} is not Gemma 3's 0.5")
    ids = [tokenizer.token_to_id(t) for t in IMAGE_TOKENS]
    if any(i is None for i in ids):
        raise CheckpointFileError(f"the text model's vocabulary lacks Gemma 3's image tokens {IMAGE_TOKENS}; "
                                  f"--mmproj {path.name} needs a Gemma 3 model")
    image_size, patch = int(meta["clip.vision.image_size"]), int(meta["clip.vision.patch_size"])
    scale = int(meta.get("clip.vision.projector.scale_factor", 4))
    side = image_size // patch // scale
    cfg = VisionConfig(hidden=int(meta["clip.vision.embedding_length"]), layers=int(meta["clip.vision.block_count"]),
                       heads=int(meta["clip.vision.attention.head_count"]),
                       intermediate=int(meta["clip.vision.feed_forward_length"]), image_size=image_size,
                       patch_size=patch, eps=_f32_value(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                       tokens_per_image=side * side, text_hidden=int(meta["clip.vision.projection_dim"]),
                       image_token_id=ids[0], boi_token_id=ids[1], eoi_token_id=ids[2])
    names = dict(_MMPROJ_GLOBAL)
    for i in range(cfg.layers):
        names.update({f"layers.{i}.{ours}": f"v.blk.{i}.{suffix}" for ours, suffix in _MMPROJ_LAYER.items()})
    tensors = {t.name: t for t in reader.tensors}
    shapes = expected_shapes(cfg)
    params = {}
    for ours, name in names.items():
        t = tensors.get(name)
        if t is None:
            raise CheckpointFileError(f"--mmproj {path.name} has no tensor {name}")
        raw = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(
            tuple(int(d) for d in reversed(t.shape)))
        if ours == "mm_norm":
            raw = raw - 1.0  # the converter wrote 1 + w
        value = to_ours(ours, raw)
        if value.shape != shapes[ours]:
            raise CheckpointFileError(f"--mmproj {path.name}: {name} has shape {raw.shape}; "
                                      f"the file's metadata implies {shapes[ours]}")
        params[ours] = jnp.asarray(value)
    return cfg, params
