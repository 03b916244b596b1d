"""A model family's image layout: how an image file becomes pixels, how its placeholder tokens are
laid into a rendered prompt, and which prompt positions (`ImageSpan`s) its embeddings fill. The
engine asks the layout of the model it serves (`layout_for`); the rest of the image path
(`ferrox_jax/images.py`: naming, chunking, the encoder cache, the step's columns) is the same for
every family.

- `Gemma3Layout`: an image is one square of `image_size` pixels and one run of
  `tokens_per_image` soft tokens, between `<start_of_image>` and `<end_of_image>`; its tokens
  attend to each other both ways (`ImageSpan.bidirectional`).
- `TiledLayout` (Idefics3 / SmolVLM, `models/idefics3.py`): an image is rows x cols tiles plus a
  global view, each tile a run of `tokens_per_image` `<image>` tokens behind its own markers, so an
  image is several spans: each tile's span is named by the image's digest and the tile's index
  (the encoder cache and the block names tell tiles apart, and the same image's tiles hit again).
  The text model attends causally over them, so the spans are not bidirectional.
- `QwenLayout` (Qwen2.5-VL, `models/qwen_vision.py`): an image keeps about its own size and aspect
  (each side a multiple of 28 pixels within the processor's pixel bounds), so its run of
  `<|image_pad|>` tokens is as long as its grid (rows x columns of merged patches); the chat template
  puts one `<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>` per image and `expand`
  repeats it. The spans are causal and carry their grid: the text model's M-RoPE positions follow
  from it (`ferrox_jax/images.py:mrope_positions`).

A picture (what `preprocess` gives and `expand` / `spans` take) is the layout's own: Gemma 3's
`(pixels f32[C, S, S], digest)`, a tiled one's `TiledPicture`, Qwen's `QwenPicture`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrox_jax.images import ImageSpan, expand_markers, find_spans, preprocess, replace_markers
from models.image_input import ImageError, ImageLimits, decode_image


class Gemma3Layout:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def preprocess(self, blobs: Sequence[bytes], limits: ImageLimits) -> list[tuple[np.ndarray, bytes]]:
        return preprocess(blobs, self.cfg.image_size, limits)

    def expand(self, text: str, tokenizer: Any, pictures: Sequence) -> str:
        return expand_markers(text, self.cfg, tokenizer, len(pictures))

    def spans(self, ids: Sequence[int], pictures: Sequence) -> tuple[ImageSpan, ...]:
        return find_spans(ids, self.cfg, pictures)


@dataclasses.dataclass(frozen=True)
class TiledPicture:
    """One image split as its processor splits it: rows x cols tiles then the global view
    (rows = cols = 0: the image alone), and the digest of the whole."""

    tiles: np.ndarray = dataclasses.field(repr=False)  # f32[n, C, S, S]
    digest: bytes
    rows: int
    cols: int

    def tile_digest(self, index: int) -> bytes:
        return hashlib.sha256(self.digest + b"|tile %d" % index).digest()


class TiledLayout:
    """Idefics3 / SmolVLM (module docstring); `cfg` is `models/idefics3.py:Idefics3VisionConfig`."""

    IMAGE = "<image>"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def preprocess(self, blobs: Sequence[bytes], limits: ImageLimits) -> list[TiledPicture]:
        from models.idefics3 import tile_image

        out = []
        for i, data in enumerate(blobs):
            try:
                tiles, rows, cols = tile_image(decode_image(data, limits), self.cfg)
            except ImageError as e:
                raise ImageError(f"image {i + 1}: {e}") from None
            digest = hashlib.sha256(b"tiled %d|%d|%d|" % (self.cfg.image_size, rows, cols) + tiles.tobytes()).digest()
            out.append(TiledPicture(tiles, digest, rows, cols))
        return out

    def expand(self, text: str, tokenizer: Any, pictures: Sequence[TiledPicture]) -> str:
        """Each `<image>` of the rendered prompt replaced, in order, by its picture's tiles' tokens
        as HF's processor lays them. Raises ValueError when the markers are not one per image or
        the tokenizer lacks a token the layout needs."""
        from models.idefics3 import image_text

        if not pictures:
            return text
        marker = tokenizer.id_to_token(self.cfg.image_token_id)
        if marker != self.IMAGE:
            raise ValueError(f"this model's image token is {marker!r}, not {self.IMAGE!r}; it cannot take images")
        needed = ["<fake_token_around_image>", "<global-img>"] + [
            f"<row_{r + 1}_col_{c + 1}>" for p in pictures for r in range(p.rows) for c in range(p.cols)]
        missing = [t for t in dict.fromkeys(needed) if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"this model's tokenizer lacks the image layout token {missing[0]}; send a smaller "
                             "image, or fewer tiles" if missing[0].startswith("<row_") else
                             f"this model's tokenizer lacks the image layout token {missing[0]}; it cannot take images")
        return replace_markers(text, marker, [image_text(p.rows, p.cols, self.cfg.tokens_per_image)
                                              for p in pictures])

    def spans(self, ids: Sequence[int], pictures: Sequence[TiledPicture]) -> tuple[ImageSpan, ...]:
        """One causal span per tile, in prompt order (each image's tiles, then its global view).
        Raises ValueError when the runs of `<image>` tokens are not one whole run per tile."""
        if not pictures:
            return ()
        token, length = self.cfg.image_token_id, self.cfg.tokens_per_image
        tiles = [(p, k) for p in pictures for k in range(len(p.tiles))]
        starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
        runs = [(s, next((j for j in range(s, len(ids)) if ids[j] != token), len(ids)) - s) for s in starts]
        if len(runs) != len(tiles) or any(n != length for _, n in runs):
            raise ValueError("the prompt's image placeholders do not match its images (an image token in the "
                             "text?); give images as image inputs only")
        return tuple(ImageSpan(start, length, p.tile_digest(k), p.tiles[k], bidirectional=False)
                     for (start, _), (p, k) in zip(runs, tiles))


@dataclasses.dataclass(frozen=True)
class QwenPicture:
    """One image as Qwen's processor gives it: its patches, its grid of patches (t, rows, cols)
    and the digest of both."""

    patches: np.ndarray = dataclasses.field(repr=False)  # f32[t * rows * cols, C * T * p * p]
    grid: tuple[int, int, int]
    digest: bytes
    merge: int = 2

    @property
    def tokens(self) -> int:
        return len(self.patches) // self.merge ** 2

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """The image tokens' grid (t, rows / merge, cols / merge): their M-RoPE positions."""
        t, rows, cols = self.grid
        return t, rows // self.merge, cols // self.merge


class QwenLayout:
    """Qwen2.5-VL (module docstring); `cfg` is `models/qwen_vision.py:QwenVisionConfig`."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def preprocess(self, blobs: Sequence[bytes], limits: ImageLimits) -> list[QwenPicture]:
        """Raises ImageError naming the image: unreadable, past the limits, an aspect ratio past
        200, or so elongated that `smart_resize`'s floor of `min_pixels` passes `max_pixels` (its
        patches would not fit the encoder's largest call)."""
        from models.qwen_vision import patch_buckets, patchify_image

        out = []
        for i, data in enumerate(blobs):
            try:
                patches, grid = patchify_image(decode_image(data, limits), self.cfg)
                if len(patches) > patch_buckets(self.cfg)[-1]:
                    raise ImageError(f"the image resizes to {grid[1] * self.cfg.patch_size} x "
                                     f"{grid[2] * self.cfg.patch_size} pixels, past this model's {self.cfg.max_pixels}; "
                                     "send a less elongated image")
            except (ImageError, ValueError) as e:  # ValueError: an aspect ratio past the processor's 200
                raise ImageError(f"image {i + 1}: {e}") from None
            digest = hashlib.sha256(b"qwen %d|%d|%d|" % grid + patches.tobytes()).digest()
            out.append(QwenPicture(patches, grid, digest, self.cfg.merge))
        return out

    def expand(self, text: str, tokenizer: Any, pictures: Sequence[QwenPicture]) -> str:
        """Each `<|image_pad|>` of the rendered prompt repeated, in order, once per image token of its
        picture, as HF's processor does. Raises ValueError when the markers are not one per image."""
        if not pictures:
            return text
        marker = tokenizer.id_to_token(self.cfg.image_token_id)
        if not marker:
            raise ValueError("this model's tokenizer lacks its image token; it cannot take images")
        return replace_markers(text, marker, [marker * p.tokens for p in pictures])

    def spans(self, ids: Sequence[int], pictures: Sequence[QwenPicture]) -> tuple[ImageSpan, ...]:
        """One causal span per image, with its token grid. Raises ValueError when the runs of image
        tokens are not one whole run per picture."""
        if not pictures:
            return ()
        token = self.cfg.image_token_id
        starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
        runs = [(s, next((j for j in range(s, len(ids)) if ids[j] != token), len(ids)) - s) for s in starts]
        if len(runs) != len(pictures) or any(n != p.tokens for (_, n), p in zip(runs, pictures)):
            raise ValueError("the prompt's image placeholders do not match its images (an image token in the "
                             "text?); give images as image inputs only")
        return tuple(ImageSpan(start, p.tokens, p.digest, p, bidirectional=False, grid=p.token_grid)
                     for (start, _), p in zip(runs, pictures))


def layout_for(cfg: Any):
    """The image layout of a vision config (`models/siglip.py`, `models/idefics3.py` or
    `models/qwen_vision.py`)."""
    from models.idefics3 import Idefics3VisionConfig
    from models.qwen_vision import QwenVisionConfig

    if isinstance(cfg, QwenVisionConfig):
        return QwenLayout(cfg)
    return TiledLayout(cfg) if isinstance(cfg, Idefics3VisionConfig) else Gemma3Layout(cfg)
