"""Idefics3 / SmolVLM: a Llama text model behind a SigLIP-like vision transformer, a pixel
shuffle and one linear connector; an image is split into tiles plus a global view.

The checkpoints (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`) load as
their text model, a Llama (`models/llama.py`: `config_from_hf` reads `text_config`, the loader
reads `model.text_model.*` and leaves `model.vision_model.*` / `model.connector.*`), and
`Idefics3Config.vision` keeps the encoder's shape, the image token and the image processor's
settings (the folder's `preprocessor_config.json`).

Preprocessing (transformers' `Idefics3ImageProcessorPil`, the same integers through PIL):

    resize so the longest edge is `size.longest_edge` (LANCZOS, even short edge)
    resize up to multiples of the tile `max_image_size` (each side rounded up)
    larger than one tile: rows x cols tiles cut from it, row-major, then the global view (the
    whole image resized to one tile); one tile: the image alone, rows = cols = 0
    x / 255, (x - mean) / std, channels first, float32

The encoder is SigLIP's (`models/siglip.py:encode`): every tile is a whole `image_size` square,
so each patch's position is its own index (Idefics3's fractional positions reduce to that when
the tile is the encoder's size; another tile size is refused at load). Then the connector:

    pixel shuffle by s: [P, Dv] on its sqrt(P) grid -> [P / s^2, Dv s^2], each output token the
                        s x s neighbourhood's features (HF's `Idefics3Connector.pixel_shuffle`)
    proj:               @ W [Dv s^2, D_text], no bias

The prompt layout (HF's processor): each `<image>` of the rendered prompt becomes, for a split
image, per tile `<fake_token_around_image><row_r_col_c>` + `<image>` x T, a "\\n" after each row,
then "\\n<fake_token_around_image><global-img>" + `<image>` x T + `<fake_token_around_image>`; an
unsplit image only the global part (without the leading "\\n"). T = (image_size / patch)^2 / s^2.
The text model attends causally over image tokens (plain Llama masking, unlike Gemma 3).
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

from models import llama
from models.config import ModelConfig, UnsupportedModelError
from models.family import Family
from models.loaders.shards import read_tower
from models.siglip import LAYER_NAMES, encode, to_ours

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
_RESAMPLE = {1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC"}  # PILImageResampling values


@dataclasses.dataclass(frozen=True)
class Idefics3VisionConfig:
    """The encoder's and connector's shape, the image token, and the image processor's settings."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    image_size: int  # the encoder's square input: one tile
    patch_size: int
    scale_factor: int
    text_hidden: int
    image_token_id: int
    eps: float = 1e-6
    channels: int = 3
    longest_edge: int = 4 * 364  # the processor's first resize
    splitting: bool = True
    resample: int = 1  # LANCZOS
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise UnsupportedModelError(f"vision hidden_size {self.hidden} is not a multiple of "
                                        f"num_attention_heads {self.heads}")
        if self.image_size % self.patch_size or self.patches_per_side % self.scale_factor:
            raise UnsupportedModelError(f"vision image_size {self.image_size} / patch_size {self.patch_size} "
                                        f"must be a whole number of patches divisible by scale_factor "
                                        f"{self.scale_factor}")
        if self.resample not in _RESAMPLE:
            raise UnsupportedModelError(f"image processor resample {self.resample} is not supported "
                                        f"(supported: {sorted(_RESAMPLE)})")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """Image tokens per tile (and per global view)."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2


@dataclasses.dataclass(frozen=True)
class Idefics3Config(ModelConfig):
    vision: Idefics3VisionConfig | None = None


def config_from_hf(cfg: dict[str, Any], processor: Mapping | None = None) -> Idefics3Config:
    """A `Idefics3ForConditionalGeneration` / `SmolVLMForConditionalGeneration` config.json (and
    its preprocessor_config.json, when given): the Llama text model plus the vision config."""
    arch = (cfg.get("architectures") or [ARCHITECTURES[0]])[0]
    text = dict(cfg.get("text_config") or {})
    text["architectures"] = ["LlamaForCausalLM"]
    text.setdefault("model_type", "llama")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    text_cfg = llama.config_from_hf(text)
    fields = {f.name: getattr(text_cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    fields["architecture"] = arch
    vision = vision_config(cfg, processor) if cfg.get("vision_config") is not None else None
    return Idefics3Config(**fields, vision=vision)


def vision_config(cfg: Mapping, processor: Mapping | None) -> Idefics3VisionConfig:
    v = cfg.get("vision_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported (SigLIP uses gelu_pytorch_tanh)")
    size = int(v.get("image_size", 224))
    p = dict(processor or {})
    tile = int((p.get("max_image_size") or {}).get("longest_edge", size))
    if tile != size:
        raise UnsupportedModelError(f"image processor max_image_size {tile} differs from the vision encoder's "
                                    f"image_size {size}; only tiles of the encoder's size are supported")
    if p.get("do_resize", True) is False or p.get("do_rescale", True) is False or p.get("do_normalize", True) is False:
        raise UnsupportedModelError("an image processor without resize, rescale or normalize is not supported")
    return Idefics3VisionConfig(
        hidden=int(v.get("hidden_size", 768)), layers=int(v.get("num_hidden_layers", 12)),
        heads=int(v.get("num_attention_heads", 12)), intermediate=int(v.get("intermediate_size", 3072)),
        image_size=size, patch_size=int(v.get("patch_size", 32)), eps=float(v.get("layer_norm_eps", 1e-6)),
        channels=int(v.get("num_channels", 3)), scale_factor=int(cfg.get("scale_factor", 2)),
        text_hidden=int((cfg.get("text_config") or {}).get("hidden_size", 4096)),
        image_token_id=int(cfg.get("image_token_id", cfg.get("image_token_index", 128257))),
        longest_edge=int((p.get("size") or {}).get("longest_edge", 4 * size)),
        splitting=bool(p.get("do_image_splitting", True)), resample=int(p.get("resample", 1)),
        mean=tuple(float(x) for x in p.get("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(float(x) for x in p.get("image_std", (0.5, 0.5, 0.5))),
        rescale=float(p.get("rescale_factor", 1 / 255)))


def read_processor(folder: str | Path) -> dict | None:
    """The folder's image processor settings (preprocessor_config.json, or processor_config.json's
    `image_processor`), None when it has neither (the processor's defaults apply)."""
    folder = Path(folder)
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text())
            data = data.get(key) if key else data
            if isinstance(data, dict):
                return data
    return None


# -- preprocessing (numpy + PIL, no torch) -------------------------------------------------------

def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """HF's `get_resize_output_image_size`: the longest edge to `longest`, the other even, then
    under 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > 4096:
        width, height = 4096, int(4096 / aspect)
    elif height > width and height > 4096:
        height, width = 4096, int(4096 * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """HF's `resize_for_vision_encoder`: each side rounded up to a multiple of the tile."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def tile_image(image, cfg: Idefics3VisionConfig) -> tuple[np.ndarray, int, int]:
    """An RGB PIL image -> (tiles f32[n, C, S, S], rows, cols): rows x cols tiles then the global
    view (n = rows cols + 1), or the image alone (rows = cols = 0), as HF's PIL processor."""
    from PIL import Image

    resample = getattr(Image.Resampling, _RESAMPLE[cfg.resample])

    def resize(img, height, width):
        return img if img.size == (width, height) else img.resize((width, height), resample=resample)

    tile = cfg.image_size
    image = resize(image, *_longest_edge_size(image.height, image.width, cfg.longest_edge))
    if cfg.splitting:
        image = resize(image, *_tile_multiple_size(image.height, image.width, tile))
    rows = cols = 0
    if cfg.splitting and (image.height > tile or image.width > tile):
        rows, cols = (image.height - tile) // tile + 1, (image.width - tile) // tile + 1
        frames = [image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                  for r in range(rows) for c in range(cols)]
        frames.append(resize(image, tile, tile))
    else:
        frames = [resize(image, tile, tile)]
    x = np.stack([np.asarray(f, np.float64) for f in frames]) * cfg.rescale
    x = (x - np.asarray(cfg.mean, np.float64)) / np.asarray(cfg.std, np.float64)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32), rows, cols


def image_text(rows: int, cols: int, tokens: int) -> str:
    """What HF's processor puts where one `<image>` was (module docstring)."""
    run = "<image>" * tokens
    glob = f"<fake_token_around_image><global-img>{run}<fake_token_around_image>"
    if rows == 0 and cols == 0:
        return glob
    out = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                  for r in range(rows))
    return out + "\n" + glob


# -- encoder + connector -------------------------------------------------------------------------

def pixel_shuffle(x: jax.Array, scale: int) -> jax.Array:
    """[B, P, D] -> [B, P / s^2, D s^2], as HF's `Idefics3Connector.pixel_shuffle`."""
    b, p, d = x.shape
    side = math.isqrt(p)
    x = x.reshape(b, side, side // scale, d * scale)
    x = x.transpose(0, 2, 1, 3)
    x = x.reshape(b, side // scale, side // scale, d * scale * scale)
    x = x.transpose(0, 2, 1, 3)
    return x.reshape(b, p // (scale * scale), d * scale * scale)


@functools.partial(jax.jit, static_argnames=("cfg",))
def idefics3_image_tokens(params: Mapping[str, jax.Array], pixels: jax.Array,
                          cfg: Idefics3VisionConfig) -> jax.Array:
    """pixels f32[B, C, S, S] (B tiles) -> f32[B, tokens_per_image, D_text]; one compile per B."""
    return pixel_shuffle(encode(params, pixels, cfg), cfg.scale_factor) @ params["connector"]


# -- weights -------------------------------------------------------------------------------------

_TOWER = "model.vision_model."


def vision_tensor_names(cfg: Idefics3VisionConfig) -> dict[str, str]:
    names = {
        "patch_embedding": _TOWER + "embeddings.patch_embedding.weight",
        "patch_bias": _TOWER + "embeddings.patch_embedding.bias",
        "position_embedding": _TOWER + "embeddings.position_embedding.weight",
        "post_ln_w": _TOWER + "post_layernorm.weight",
        "post_ln_b": _TOWER + "post_layernorm.bias",
        "connector": "model.connector.modality_projection.proj.weight",
    }
    for i in range(cfg.layers):
        for ours, hf in LAYER_NAMES.items():
            names[f"layers.{i}.{ours}"] = f"{_TOWER}encoder.layers.{i}.{hf}"
    return names


def expected_shapes(cfg: Idefics3VisionConfig) -> dict[str, tuple[int, ...]]:
    d, f = cfg.hidden, cfg.intermediate
    shapes = {"patch_embedding": (cfg.channels * cfg.patch_size ** 2, d), "patch_bias": (d,),
              "position_embedding": (cfg.patches_per_side ** 2, d), "post_ln_w": (d,), "post_ln_b": (d,),
              "connector": (d * cfg.scale_factor ** 2, cfg.text_hidden)}
    per_layer = {"ln1_w": (d,), "ln1_b": (d,), "ln2_w": (d,), "ln2_b": (d,), "fc1_w": (d, f), "fc1_b": (f,),
                 "fc2_w": (f, d), "fc2_b": (d,)}
    per_layer.update({f"{p}_w": (d, d) for p in "qkvo"})
    per_layer.update({f"{p}_b": (d,) for p in "qkvo"})
    for i in range(cfg.layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def read_idefics3_vision(folder: str | Path) -> tuple[Idefics3VisionConfig, dict[str, jax.Array]]:
    """The encoder and connector of an Idefics3 / SmolVLM folder, as float32 arrays. Raises
    CheckpointFileError naming the first missing tensor or wrong shape."""
    folder = Path(folder)
    cfg = vision_config(json.loads((folder / "config.json").read_text()), read_processor(folder))
    tensors = read_tower(folder, vision_tensor_names(cfg), expected_shapes(cfg),
                         lambda ours, raw: raw.T if ours == "connector" else to_ours(ours, raw))
    return cfg, {ours: jnp.asarray(value) for ours, value in tensors.items()}


FAMILY = Family(
    name="idefics3",
    model=llama.LlamaModel,
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    hf_layer_weights=llama.HF_LAYER_WEIGHTS,
)
