"""Images in: bytes to a checked RGB image, and an RGB image to a model's pixel values, without torch.

Two steps, each equal to what the HF image processors do, so an image reaches the vision
encoder as the reference's `pixel_values`:

- `decode_image(data, limits)`: the bytes of a PNG, JPEG, WebP or GIF (first frame) to an
  RGB PIL image. The header is read first and the size checked against `ImageLimits` before
  any pixel is decoded, so a decompression bomb (a small file claiming a huge canvas) costs
  nothing; a truncated or unreadable file, an unsupported format, too many bytes or too many
  pixels raise `ImageError` with a message naming the limit (the API turns it into a 400).
- `resize_normalize(image, size, mean, std)`: Gemma 3's and SigLIP's preprocessing (the PIL
  backend of transformers' image processors): a square resize with PIL's bilinear filter on
  the uint8 image, x / 255, then (x - mean) / std, channels first, float32.

Pillow is the only decoder: it is what the HF processors' PIL backend uses, so the resize is
the same filter on the same integers.
"""

from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np

_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """An image the server refuses; the message says which limit or what is wrong."""


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # width x height of the decoded canvas
    max_side: int = 16_384


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()):
    """Checked bytes -> an RGB `PIL.Image.Image`. Raises ImageError."""
    from PIL import Image

    if not data:
        raise ImageError("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=_FORMATS)  # reads the header only
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image's canvas is too large ({e})") from None
    except (Image.UnidentifiedImageError, OSError, ValueError, Warning):
        raise ImageError("the image could not be read: send a PNG, JPEG, WebP or GIF file") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError("the image has no pixels")
    if max(width, height) > limits.max_side:
        raise ImageError(f"the image is {width}x{height}; the limit is {limits.max_side} pixels per side")
    if width * height > limits.max_pixels:
        raise ImageError(f"the image has {width * height} pixels; the limit is {limits.max_pixels}")
    try:
        image.seek(0)
        image.load()
    except (OSError, ValueError, EOFError):
        raise ImageError("the image is truncated or corrupt: send the whole file") from None
    return image.convert("RGB")


def resize_normalize(image, size: int, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> np.ndarray:
    """An RGB PIL image -> f32[3, size, size]: bilinear resize, / 255, (x - mean) / std."""
    from PIL import Image

    resized = image.resize((size, size), resample=Image.Resampling.BILINEAR)
    x = np.asarray(resized, dtype=np.float64) * (1.0 / 255.0)
    x = (x - np.asarray(mean, np.float64)) / np.asarray(std, np.float64)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)
