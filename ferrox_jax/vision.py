"""The vision encoder on the runner's device: a model's image encoder and projector
(`models/siglip.py` for Gemma 3, `models/idefics3.py` for Idefics3 / SmolVLM, whose "images"
here are tiles), compiled per image-count bucket at warm-up like every step shape. The
encoder also carries the family's image layout (`ferrox_jax/image_layout.py`), read with its
weights (Idefics3's needs the folder's image processor settings).

`ModelRunner.encode_images(pixels)` splits a step's new images into calls of 1, 2, 4 or 8
images (the last call padded with blank images, whose outputs are dropped), so four
executables serve every count with 0 compiles after warm-up; each call's soft tokens come
back to the host (the owner thread puts them in the encoder cache and the step's host batch,
`ferrox_jax/images.py`). The encoder's weights are float32 and replicated: it is small beside
the language model (SigLIP-So400m: 0.4B parameters against Gemma 3's 4B-27B).

Qwen2.5-VL's and Qwen3-VL's images differ in size (`QwenVisionEncoder`, `models/qwen_vision.py`,
`models/qwen3_vl_vision.py`): a step's new
images are packed into calls of at most the largest patch bucket, each call padded to the smallest
bucket holding its patches (attention never crosses images), one executable per bucket.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ferrox_jax.image_layout import layout_for
from models.idefics3 import Idefics3VisionConfig, idefics3_image_tokens, read_idefics3_vision
from models.qwen3_vl_vision import Qwen3VisionConfig, position_taps, qwen3_image_tokens, read_qwen3_vision
from models.qwen_vision import QwenVisionConfig, pack, patch_buckets, qwen_image_tokens, read_qwen_vision, unpack
from models.siglip import VisionConfig, gemma3_image_tokens, read_gemma3_mmproj, read_gemma3_vision

log = logging.getLogger(__name__)

IMAGE_BUCKETS = (1, 2, 4, 8)


@dataclasses.dataclass
class VisionEncoder:
    """A model's vision encoder: its shape, its weights on the device."""

    cfg: VisionConfig | Idefics3VisionConfig
    params: dict[str, Any]

    @property
    def layout(self):
        """The family's image layout (`ferrox_jax/image_layout.py`)."""
        return layout_for(self.cfg)

    @property
    def _image_tokens(self):
        return idefics3_image_tokens if isinstance(self.cfg, Idefics3VisionConfig) else gemma3_image_tokens

    @property
    def tokens_per_image(self) -> int:
        return self.cfg.tokens_per_image

    def compile_keys(self) -> list[tuple]:
        return [("vision", b) for b in IMAGE_BUCKETS]

    def lower(self, key: tuple) -> jax.stages.Lowered:
        c, s = self.cfg.channels, self.cfg.image_size
        pixels = jnp.zeros((key[1], c, s, s), jnp.float32)
        return self._image_tokens.lower(self.params, pixels, self.cfg)

    def calls(self, count: int) -> list[tuple[int, int, int]]:
        """(start, images, bucket) of the calls over `count` images, largest buckets first."""
        out, start = [], 0
        while start < count:
            left = count - start
            bucket = next((b for b in IMAGE_BUCKETS if b >= left), IMAGE_BUCKETS[-1])
            take = min(left, bucket)
            out.append((start, take, bucket))
            start += take
        return out

    def run(self, executable, pixels: np.ndarray, bucket: int) -> np.ndarray:
        """One call of `executable` (the bucket's) over `pixels` f32[b, C, S, S], b <= bucket."""
        padded = np.zeros((bucket, *pixels.shape[1:]), np.float32)
        padded[:len(pixels)] = pixels
        return np.asarray(jax.device_get(executable(self.params, padded)))[:len(pixels)]

    def encode(self, pixels: np.ndarray, executable) -> np.ndarray:
        """f32[B, C, S, S] -> f32[B, T, D] in bucketed calls (`executable(bucket)`: its compile)."""
        return np.concatenate([self.run(executable(bucket), pixels[start:start + count], bucket)
                               for start, count, bucket in self.calls(len(pixels))])


@dataclasses.dataclass
class QwenVisionEncoder:
    """Qwen2.5-VL's (or Qwen3-VL's) vision transformer and merger: its shape, its weights on the device."""

    cfg: QwenVisionConfig
    params: dict[str, Any]

    @property
    def layout(self):
        return layout_for(self.cfg)

    @property
    def buckets(self) -> tuple[int, ...]:
        return patch_buckets(self.cfg)

    def compile_keys(self) -> list[tuple]:
        return [("vision", b) for b in self.buckets]

    def _inputs(self, call, grids: list) -> tuple:
        """The executable's arrays for a packed call of images of `grids`."""
        if not isinstance(self.cfg, Qwen3VisionConfig):
            return call.patches, call.rows_cols, call.window, call.image
        sizes = np.asarray([g[1:] for g in grids] or [(1, 1)], np.int64)[np.maximum(call.image, 0)]
        return (call.patches, call.rows_cols, call.image, *position_taps(call.rows_cols, sizes, self.cfg.grid_side))

    def lower(self, key: tuple) -> jax.stages.Lowered:
        fn = qwen3_image_tokens if isinstance(self.cfg, Qwen3VisionConfig) else qwen_image_tokens
        return fn.lower(self.params, *self._inputs(pack([], key[1], self.cfg), []), self.cfg)

    def calls(self, sizes: list[int]) -> list[tuple[int, int, int]]:
        """(start, images, bucket) of the calls over images of `sizes` patches: consecutive images
        packed while they fit the largest bucket."""
        out, start, top = [], 0, self.buckets[-1]
        while start < len(sizes):
            end, total = start, 0
            while end < len(sizes) and total + sizes[end] <= top:
                total, end = total + sizes[end], end + 1
            if end == start:
                raise ValueError(f"an image of {sizes[start]} patches is past the encoder's {top}")
            out.append((start, end - start, next(b for b in self.buckets if b >= total)))
            start = end
        return out

    def encode(self, pictures: list, executable) -> list[np.ndarray]:
        """`QwenPicture`s -> their image tokens, f32[T_i, D] each (`executable(bucket)`: its compile)."""
        out = []
        for start, count, bucket in self.calls([len(p.patches) for p in pictures]):
            part = pictures[start:start + count]
            call = pack([(p.patches, p.grid) for p in part], bucket, self.cfg)
            tokens = executable(bucket)(self.params, *self._inputs(call, [p.grid for p in part]))
            out += unpack(call, np.asarray(jax.device_get(tokens)))
        return out


def place_vision(cfg: VisionConfig | Idefics3VisionConfig | QwenVisionConfig,
                 params: dict[str, Any]) -> VisionEncoder | QwenVisionEncoder:
    """The encoder with its weights on the default device."""
    placed = {name: jax.device_put(jnp.asarray(v, jnp.float32)) for name, v in params.items()}
    return QwenVisionEncoder(cfg, placed) if isinstance(cfg, QwenVisionConfig) else VisionEncoder(cfg, placed)


def open_vision(source: Any, config: Any) -> tuple[VisionEncoder | QwenVisionEncoder | None, Any, Any]:
    """A checkpoint's vision encoder (None for a text model), the engine config it needs (prompt
    chunks of at least one image's tokens: an image is computed in one forward, so a smaller
    configured size is raised), and the source (with `--mmproj`, its config now naming the
    encoder). The encoder comes from a vision-language folder's own tensors, or from llama.cpp's
    projector GGUF (`config.mmproj`) beside a Gemma 3 GGUF. Raises ValueError for what a model
    taking images cannot do yet: a multi-process mesh, synthetic weights, `--mmproj` on
    another family."""
    if config.mmproj is not None:
        own = getattr(source.config, "vision", None)  # a vision-language folder's own encoder: no projector file
        if not hasattr(source.config, "vision") or isinstance(own, (Idefics3VisionConfig, QwenVisionConfig)):
            raise ValueError(f"--mmproj is supported for Gemma 3 models; {source.config.architecture} takes no "
                             "projector")
        cfg, params = read_gemma3_mmproj(config.mmproj, source.tokenizer)
        source = dataclasses.replace(source, config=dataclasses.replace(source.config, vision=cfg))
    elif getattr(source.config, "vision", None) is None:
        return None, config, source
    elif source.is_synthetic:
        raise ValueError("--load-format dummy does not make a vision encoder's weights; serve the checkpoint's own")
    else:
        vision_cfg = source.config.vision
        read = (read_idefics3_vision if isinstance(vision_cfg, Idefics3VisionConfig) else
                read_qwen3_vision if isinstance(vision_cfg, Qwen3VisionConfig) else
                read_qwen_vision if isinstance(vision_cfg, QwenVisionConfig) else read_gemma3_vision)
        cfg, params = read(source.path)  # the encoder's tensors of the checkpoint folder
    if jax.process_count() > 1:
        raise ValueError("multi-host serving of a model taking images is not supported yet; serve it on one host")
    if isinstance(cfg, QwenVisionConfig):  # causal image tokens of any count: chunks cut them as text
        return place_vision(cfg, params), config, source
    if config.prefill_chunk < cfg.tokens_per_image:
        log.info("prompt chunks of %d tokens (was %d): an image's %d tokens are computed in one forward",
                 cfg.tokens_per_image, config.prefill_chunk, cfg.tokens_per_image)
        config = dataclasses.replace(config, prefill_chunk=cfg.tokens_per_image)
    return place_vision(cfg, params), config, source
