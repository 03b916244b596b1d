"""Gemma 3's vision encoder and projector (models/siglip.py) and the image preprocessing
(models/image_input.py) against transformers 5.25 on a tiny random checkpoint and real images.

- pixel values: our decode + resize + normalise of a PNG and a JPEG equal HF's Gemma 3 image
  processor's (PIL backend) output;
- soft tokens: `gemma3_image_tokens` equals HF's `get_image_features(...).pooler_output` in
  float32 (atol 1e-5), for one image and for two images in one call;
- negative controls: a projector read without its (1 + w) norm, and patches taken in column
  order instead of row order, both fail the comparison;
- bad images: truncated, a decompression bomb, not an image, too many bytes: each an
  ImageError naming what is wrong, without decoding the pixels.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from models import image_input, siglip  # noqa: E402

IMAGE_SIZE = 32
PATCH = 4  # 8 x 8 patches
TOKENS = 16  # pooled 2 x 2 down to 4 x 4


def _config():
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, layer_norm_eps=1e-6, vision_use_head=False)
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=24, sliding_window=16, max_position_embeddings=512)
    return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     mm_tokens_per_image=TOKENS, image_token_index=299, boi_token_index=297,
                                     eoi_token_index=298)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-vision")
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(_config()).to(torch.float32)
    with torch.no_grad():  # the default init leaves the projection at zero: widen everything
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _image(seed: int, size=(45, 37)) -> "PIL.Image":
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size[1], 0:size[0]]
    pixels = np.stack([(xx * 5 + seed * 17) % 256, (yy * 7) % 256, rng.integers(0, 256, size[::-1])], -1)
    return PIL.fromarray(pixels.astype(np.uint8), "RGB")


def _encoded(image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _hf_pixels(image) -> np.ndarray:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return np.asarray(proc(images=[image], return_tensors="np")["pixel_values"][0], np.float32)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_pixels_equal_hf_image_processor(fmt):
    data = _encoded(_image(1), fmt)
    ours = image_input.resize_normalize(image_input.decode_image(data), IMAGE_SIZE)
    theirs = _hf_pixels(PIL.open(io.BytesIO(data)).convert("RGB"))
    assert ours.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)


def _hf_tokens(model, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels))
    return out.pooler_output.numpy()


def test_soft_tokens_equal_hf(checkpoint):
    folder, model = checkpoint
    cfg, params = siglip.read_gemma3_vision(folder)
    assert (cfg.num_patches, cfg.tokens_per_image, cfg.text_hidden) == (64, TOKENS, 48)
    pixels = np.stack([image_input.resize_normalize(_image(s), IMAGE_SIZE) for s in (2, 3)])
    theirs = _hf_tokens(model, pixels)
    for batch in (pixels[:1], pixels):  # one image, and two in one call
        ours = np.asarray(siglip.gemma3_image_tokens(params, batch, cfg))
        assert ours.shape == (len(batch), TOKENS, 48)
        np.testing.assert_allclose(ours, theirs[:len(batch)], atol=1e-5, rtol=0)
    assert np.abs(theirs).max() > 0.1  # not a near-zero output that anything would match


def test_negative_controls_fail(checkpoint):
    folder, model = checkpoint
    cfg, params = siglip.read_gemma3_vision(folder)
    pixels = image_input.resize_normalize(_image(4), IMAGE_SIZE)[None]
    theirs = _hf_tokens(model, pixels)

    without_plus_one = dict(params, mm_norm=params["mm_norm"] - 1.0)  # norm times w, not (1 + w)
    wrong = np.asarray(siglip.gemma3_image_tokens(without_plus_one, pixels, cfg))
    assert np.abs(wrong - theirs).max() > 1e-2

    transposed = np.ascontiguousarray(pixels.transpose(0, 1, 3, 2))  # patches in column order
    wrong = np.asarray(siglip.gemma3_image_tokens(params, transposed, cfg))
    assert np.abs(wrong - theirs).max() > 1e-2


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data, words", [
    (_encoded(_image(5), "PNG")[:200], "truncated"),
    (_png_header_only(100_000, 100_000), "limit"),
    (b"GIF89a-not-really" + b"\0" * 40, "could not be read"),
    (b"%PDF-1.4 a document", "could not be read"),
    (b"", "empty"),
])
def test_bad_images_are_refused(data, words):
    with pytest.raises(image_input.ImageError, match=words):
        image_input.decode_image(data)


def test_limits_name_the_limit():
    data = _encoded(_image(6, size=(64, 64)), "PNG")
    with pytest.raises(image_input.ImageError, match="limit is 100 bytes"):
        image_input.decode_image(data, image_input.ImageLimits(max_bytes=100))
    with pytest.raises(image_input.ImageError, match="limit is 1000"):
        image_input.decode_image(data, image_input.ImageLimits(max_pixels=1000))
    assert image_input.decode_image(data).size == (64, 64)
