"""Qwen2.5-VL images with M-RoPE positions: a tiny random `Qwen2_5_VLForConditionalGeneration`
(transformers 5.25, tests/support/tiny_qwen_vl.py) served by the real engine, against HF's image
processor and whole model given the same images.

- preprocessing: a generated image saved as PNG and as JPEG, decoded and patchified by us, within
  1e-6 of HF's PIL image processor, with the same grid; the prompt's ids equal what HF's
  processor lays out (`Qwen2_5_VLProcessor.replace_image_token`);
- the vision transformer and merger (window blocks and a full-attention block, 2-D RoPE) within
  1e-5 of HF's `get_image_features` for two images of two shapes in one packed call (negative
  control: the rows and columns of the rotary angles swapped is far off);
- M-RoPE positions equal HF's `get_rope_index` for a prompt with two images;
- through the engine: an image prompt (chunked: the text after the image in a later chunk) and a
  prompt with two images (a chunk ending inside the second), every prompt logprob within 1e-4 of HF's float32 log-softmax and the
  same greedy tokens (decoding continues from the images' shifted positions);
- a text-only prompt equals HF's greedy tokens; an image prompt batched with a text-only row
  equals it alone; the same image twice is one
  encoder run and a prefix hit, another image a miss; 0 compiles after warm-up;
- negative controls: positions as the plain token index (M-RoPE off) and the placeholders shifted
  by one both fail the comparison.
"""

from __future__ import annotations

import dataclasses
import io
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from ferrox_jax.config import EngineConfig  # noqa: E402
from ferrox_jax.engine import Engine  # noqa: E402
from ferrox_jax.images import mrope_positions  # noqa: E402
from models.image_input import ImageLimits  # noqa: E402
from tests.support.engine_helpers import float32_matmuls  # noqa: E402,F401
from tests.support.qwen_vl_checks import GREEDY, PAD, PROMPT, TWO  # noqa: E402
from tests.support.qwen_vl_checks import image as _image  # noqa: E402
from tests.support.qwen_vl_checks import image_file as _file  # noqa: E402
from tests.support.qwen_vl_checks import ours as _ours  # noqa: E402
from tests.support.qwen_vl_checks import serve_vlm  # noqa: E402
from tests.support.qwen_vl_checks import prompt_error as _prompt_error  # noqa: E402
from tests.support.qwen_vl_checks import prompt_logprobs as _prompt_logprobs  # noqa: E402
from tests.support.qwen_vl_checks import run_job as _run  # noqa: E402
from tests.support.qwen_vl_checks import submit_job as _submit  # noqa: E402
from tests.support.tiny_qwen_vl import image_processor  # noqa: E402


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tests.support.tiny_qwen_vl import make_tiny_qwen_vl

    yield from serve_vlm(make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen-vl") / "tiny-qwen2_5_vl"),
                         transformers.Qwen2_5_VLForConditionalGeneration)


def _reference(engine, images, prompt=PROMPT):
    """HF's processor's input_ids (its `replace_image_token` per image) and image inputs."""
    ip = image_processor()
    out = ip(images, return_tensors="pt")
    proc = types.SimpleNamespace(image_processor=ip, image_token=PAD)
    pieces = prompt.split(PAD)
    text = pieces[0] + "".join(transformers.Qwen2_5_VLProcessor.replace_image_token(proc, out, i) + piece
                               for i, piece in enumerate(pieces[1:]))
    return engine.tokenizer.encode(text, add_special_tokens=False), out


def _hf_logprobs(hf, ids, ref, image_token) -> np.ndarray:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = hf(input_ids=input_ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                    mm_token_type_ids=(input_ids == image_token).int()).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _hf_greedy(hf, ids, ref, image_token, n=GREEDY) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(_hf_logprobs(hf, ids + out, ref, image_token)[-1].argmax()))
    return out


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_pixels_and_prompt_equal_hf_processor(vlm, fmt):
    from models.image_input import decode_image
    from models.qwen_vision import patchify_image

    _, _, engine, vocab = vlm
    data = _file(_image(1, 60, 100), fmt)
    decoded = decode_image(data)
    patches, grid = patchify_image(decoded, engine.image_layout.cfg)
    want = image_processor()([PIL.open(io.BytesIO(data)).convert("RGB")], return_tensors="np")
    assert list(want["image_grid_thw"][0]) == list(grid) == [1, 4, 8]  # 60 x 100 -> 56 x 112
    assert np.abs(patches - want["pixel_values"]).max() < 1e-6
    ids, spans = _ours(engine, [_image(2, 90, 40)])
    want_ids, _ = _reference(engine, [_image(2, 90, 40)])
    assert ids == want_ids
    assert len(spans) == 1 and spans[0].grid == (1, 3, 2) and spans[0].length == 6
    assert ids[spans[0].start - 1] == vocab["<|vision_start|>"] and ids[spans[0].stop] == vocab["<|vision_end|>"]


def test_image_features_equal_hf(vlm):
    from models.qwen_vision import pack, patchify_image, qwen_image_tokens, read_qwen_vision, unpack

    folder, hf, _, _ = vlm
    images = [_image(3, 60, 100), _image(4, 110, 50)]
    cfg, params = read_qwen_vision(folder)
    pictures = [patchify_image(im, cfg) for im in images]
    ref = image_processor()(images, return_tensors="pt")
    with torch.no_grad():
        want = hf.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output
    call = pack(pictures, 64, cfg)
    assert len(set(call.window[call.window >= 0].tolist())) > len(images)  # several windows: window blocks differ
    got = unpack(call, np.asarray(qwen_image_tokens(params, call.patches, call.rows_cols, call.window, call.image,
                                                    cfg)))
    for ours, theirs in zip(got, want):
        assert ours.shape == tuple(theirs.shape)
        assert np.abs(ours - theirs.numpy()).max() < 1e-5
    # Negative control: rows and columns swapped in the rotary angles.
    wrong = unpack(call, np.asarray(qwen_image_tokens(params, call.patches, call.rows_cols[:, ::-1].copy(),
                                                      call.window, call.image, cfg)))
    assert np.abs(wrong[0] - want[0].numpy()).max() > 1e-3


def test_mrope_positions_equal_hf_rope_index(vlm):
    _, hf, engine, vocab = vlm
    images = [_image(5, 60, 100), _image(6, 90, 40)]
    ids, spans = _ours(engine, images, TWO)
    _, ref = _reference(engine, images, TWO)
    input_ids = torch.tensor([ids])
    want, delta = hf.model.get_rope_index(input_ids, (input_ids == vocab[PAD]).int(), ref["image_grid_thw"])
    got = mrope_positions(np.arange(len(ids) + 3), spans)
    assert np.array_equal(got[:len(ids)], want[:, 0].numpy().T)
    # decoding continues from the shifted positions: HF's rope delta
    assert np.array_equal(got[len(ids):], np.repeat(np.arange(len(ids), len(ids) + 3)[:, None] + int(delta), 3, 1))
    assert int(delta) != 0


@pytest.mark.parametrize("prompt,count", [(PROMPT, 1), (TWO, 2)], ids=["one", "two"])
def test_image_prompt_matches_hf(vlm, prompt, count):
    _, hf, engine, vocab = vlm
    images = [_image(7, 60, 100), _image(8, 110, 110)][:count]  # 8 and 16 image tokens
    ids, spans = _ours(engine, images, prompt)
    want_ids, ref = _reference(engine, images, prompt)
    assert ids == want_ids and len(spans) == count
    before = engine.stats().recompiles_after_warmup
    tokens, events = _run(engine, f"p{count}", ids, spans, prompt_logprobs=True)
    # 32-token chunks: the text after the image is in a later chunk, and with two images a chunk
    # ends inside the second (causal image tokens are cut like text; their positions follow)
    ends = list(range(events[0].num_cached_tokens + 32, len(ids), 32))
    assert ends and ends[0] > spans[0].stop
    assert count == 1 or any(s.start < end < s.stop for s in spans for end in ends)
    assert _prompt_error(events, ids, _hf_logprobs(hf, ids, ref, vocab[PAD])) < 1e-4
    assert tokens == _hf_greedy(hf, ids, ref, vocab[PAD])
    assert engine.stats().recompiles_after_warmup == before


def test_negative_controls_plain_positions_and_shifted_placeholders_fail(vlm):
    _, hf, engine, vocab = vlm
    images = [_image(9, 60, 100)]
    ids, spans = _ours(engine, images)
    want = _hf_logprobs(hf, ids, _reference(engine, images)[1], vocab[PAD])
    plain = tuple(dataclasses.replace(s, grid=None) for s in spans)  # M-RoPE off: the token index
    _, events = _run(engine, "plain", ids, plain, prompt_logprobs=True)
    assert _prompt_error(events, ids, want) > 1e-2
    shifted = tuple(dataclasses.replace(s, start=s.start + 1) for s in spans)
    _, events = _run(engine, "shifted", ids, shifted, prompt_logprobs=True)
    assert _prompt_error(events, ids, want) > 1e-2
    _, events = _run(engine, "control", ids, spans, prompt_logprobs=True)  # the same engine, the real spans
    assert _prompt_error(events, ids, want) < 1e-4


def test_batched_with_a_text_row_equals_alone(vlm):
    _, hf, engine, _ = vlm
    ids, spans = _ours(engine, [_image(10, 70, 70)])
    alone, alone_events = _run(engine, "alone", ids, spans, prompt_logprobs=True)
    text_ids = engine.tokenizer.encode("<|im_start|>user\nhello there, how are you<|im_end|>\n",
                                       add_special_tokens=False)
    text_alone, _ = _run(engine, "text-alone", text_ids, (), 16)
    with torch.no_grad():  # a text-only prompt: plain positions, as HF's text path
        want = hf.generate(torch.tensor([text_ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert text_alone == want[0, len(text_ids):].tolist()
    text = _submit(engine, "text", text_ids, (), 16)  # decoding while the image prompt's chunks run
    image = _submit(engine, "image", ids, spans, prompt_logprobs=True)
    assert image.tokens() == alone and text.tokens() == text_alone
    cached = image.events[0].num_cached_tokens  # the prefix cache may serve the repeat: compare what it computed
    assert np.abs(_prompt_logprobs(image.events) - _prompt_logprobs(alone_events)[max(cached - 1, 0):]).max() < 1e-5


def test_same_image_twice_one_encoder_run_and_a_prefix_hit_another_misses(vlm):
    _, hf, engine, vocab = vlm
    image = _image(11, 80, 60)
    ids, spans = _ours(engine, [image])
    before = engine.stats()
    first = _run(engine, "c1", ids, spans)
    mid = engine.stats()
    ids2, spans2 = _ours(engine, [image])  # decoded and patchified again from the file's bytes
    second = _run(engine, "c2", ids2, spans2)
    after = engine.stats()
    assert first[0] == second[0]
    assert mid.encoder_runs - before.encoder_runs == 1
    assert after.encoder_runs == mid.encoder_runs, "the same image was encoded again"
    assert second[1][0].num_cached_tokens >= spans[0].stop - 4, "the image's blocks did not hit"
    # the hit is honest: K/V cached at the image's 3-D positions continue as HF does
    assert second[0] == _hf_greedy(hf, ids, _reference(engine, [image])[1], vocab[PAD])
    other = _image(12, 80, 60)  # same size, same prompt, other pixels
    ids3, spans3 = _ours(engine, [other])
    assert ids3 == ids
    third = _run(engine, "c3", ids3, spans3)
    assert third[1][0].num_cached_tokens <= spans[0].start, "another image hit the first one's blocks"
    assert third[1][0].num_cached_tokens > 0  # the text before the image hits
    assert engine.stats().encoder_runs == after.encoder_runs + 1
    assert third[0] == _hf_greedy(hf, ids3, _reference(engine, [other])[1], vocab[PAD])


def test_max_pixels_is_served_at_the_cap_and_aspect_past_200_is_refused():
    from models.image_input import ImageError
    from models.qwen_vision import MAX_IMAGE_TOKENS, patch_buckets, smart_resize, vision_config
    from ferrox_jax.image_layout import QwenLayout

    raw = {"vision_config": {"patch_size": 14, "spatial_merge_size": 2}}
    cfg = vision_config(raw, {"min_pixels": 3136, "max_pixels": 12845056})  # the released checkpoints' processor
    assert cfg.max_pixels == 28 * 28 * MAX_IMAGE_TOKENS and patch_buckets(cfg)[-1] == 4 * MAX_IMAGE_TOKENS
    height, width = smart_resize(2000, 3000, 28, cfg.min_pixels, cfg.max_pixels)
    assert height * width <= cfg.max_pixels and (height, width) == smart_resize(2000, 3000, 28, 3136, 1003520)
    assert vision_config(raw, {"max_pixels": 28 * 28 * 64}).max_pixels == 28 * 28 * 64  # under the cap: as given
    with pytest.raises(ImageError, match="image 1: the image's aspect ratio is 250; the limit is 200"):
        QwenLayout(cfg).preprocess([_file(_image(0, 4, 1000))], ImageLimits())
    # a 4 x 700 image: the floor of min_pixels (28 x 756) passes a small max_pixels: refused, not encoded
    small = vision_config(raw, {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16})
    with pytest.raises(ImageError, match="image 2: the image resizes to 28 x 756 pixels, past this model's 12544"):
        QwenLayout(small).preprocess([_file(_image(0, 60, 100)), _file(_image(0, 4, 700))], ImageLimits())


def test_mmproj_beside_qwen2_5_vl_is_refused(vlm):
    folder = vlm[0]
    with pytest.raises(ValueError, match="--mmproj is supported for Gemma 3 models; "
                                         "Qwen2_5_VLForConditionalGeneration takes no projector"):
        Engine.load(EngineConfig(model=str(folder), mmproj=str(folder / "config.json"), kv_blocks=32, max_context=64))


def test_hub_config_layout_reads_as_transformers_5s(vlm):
    """The Hub's config.json keeps the text fields at the top with `rope_scaling: {type: mrope}`;
    transformers 5 saves `text_config` with `rope_parameters`: both read as one config."""
    import json

    from models.registry import config_from_hf

    saved = json.loads((vlm[0] / "config.json").read_text())
    text = dict(saved["text_config"])
    rope = text.pop("rope_parameters")
    hub = {**{k: v for k, v in saved.items() if k != "text_config"}, **text, "rope_theta": rope["rope_theta"],
           "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert config_from_hf(hub) == config_from_hf(saved)
    assert config_from_hf(hub).mrope_section == (2, 3, 3) and config_from_hf(hub).attention_bias
