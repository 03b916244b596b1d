"""Qwen3-VL images: a tiny random `Qwen3VLForConditionalGeneration` (transformers 5.25,
tests/support/tiny_qwen_vl.py) served by the real engine, against HF's image processor and model.

- preprocessing (16-pixel patches, mean and std 0.5) within 1e-6 of HF's PIL processor; the
  vision transformer (learned positions resampled bilinearly, full attention, LayerNorms) with
  its merger and deepstack merger within 1e-5 of HF's `get_image_features` (pooler output and
  deepstack features) for two images of two shapes in one call;
- interleaved M-RoPE: our cos / sin equal HF's text rotary embedding for 3-D positions whose axes
  differ (negative control: Qwen2.5-VL's contiguous sections differ);
- one- and two-image prompts through the engine within 1e-4 of HF's float32 logprobs with the same
  greedy tokens; the same image twice is one encoder run and a prefix hit;
- negative controls: positions as the plain token index, and HF's model with its deepstack
  additions removed (what an implementation without them computes), are both far off.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from tests.support.qwen_vl_checks import PAD, PROMPT, TWO  # noqa: E402
from tests.support.qwen_vl_checks import image as _image  # noqa: E402
from tests.support.qwen_vl_checks import ours as _ours  # noqa: E402
from tests.support.qwen_vl_checks import serve_vlm  # noqa: E402
from tests.support.qwen_vl_checks import prompt_error as _prompt_error  # noqa: E402
from tests.support.qwen_vl_checks import run_job as _run  # noqa: E402
from tests.support.engine_helpers import float32_matmuls  # noqa: E402,F401
from tests.support.tiny_qwen_vl import qwen3_image_processor  # noqa: E402


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tests.support.tiny_qwen_vl import make_tiny_qwen3_vl

    yield from serve_vlm(make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl") / "tiny-qwen3_vl"),
                         transformers.Qwen3VLForConditionalGeneration)


def _reference(engine, images, prompt=PROMPT):
    """HF's image inputs, and the prompt with each <|image_pad|> repeated per image token (its processor's layout)."""
    out = qwen3_image_processor()(images, return_tensors="pt")
    pieces = prompt.split(PAD)
    counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
    text = pieces[0] + "".join(PAD * n + piece for n, piece in zip(counts, pieces[1:]))
    return engine.tokenizer.encode(text, add_special_tokens=False), out


def _hf_logprobs(hf, ids, ref, image_token) -> np.ndarray:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = hf(input_ids=input_ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                    mm_token_type_ids=(input_ids == image_token).int()).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_pixels_and_features_equal_hf(vlm):
    from ferrox_jax.image_layout import QwenPicture
    from ferrox_jax.vision import QwenVisionEncoder
    from models.qwen3_vl_vision import qwen3_image_tokens, read_qwen3_vision
    from models.qwen_vision import patchify_image

    folder, hf, _, _ = vlm
    images = [_image(3, 60, 100), _image(4, 110, 40)]
    cfg, params = read_qwen3_vision(folder)
    pictures = [patchify_image(im, cfg) for im in images]
    ref = qwen3_image_processor()(images, return_tensors="pt")
    assert [list(g) for _, g in pictures] == ref["image_grid_thw"].tolist()
    assert np.abs(np.concatenate([p for p, _ in pictures]) - ref["pixel_values"].numpy()).max() < 1e-6
    with torch.no_grad():
        want = hf.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
    encoder = QwenVisionEncoder(cfg, params)
    got = encoder.encode([QwenPicture(p, g, bytes(32)) for p, g in pictures],
                         lambda bucket: lambda *a: qwen3_image_tokens(*a, cfg))
    d = cfg.out_hidden
    for i, ours in enumerate(got):
        assert np.abs(ours[:, :d] - want.pooler_output[i].numpy()).max() < 1e-5
        assert np.abs(ours[:, d:] - want.deepstack_features[0][i].numpy()).max() < 1e-5


def test_interleaved_mrope_equals_hf():
    import jax.numpy as jnp

    from models.qwen3_vl import Qwen3VLModel
    from models.rope import mrope_cos_sin

    text = transformers.Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    positions = np.stack([np.arange(12), 3 + np.arange(12) // 4, 3 + np.arange(12) % 4], -1)[None]  # [1, T, 3]
    with torch.no_grad():
        cos, sin = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding(text)(
            torch.zeros(1, dtype=torch.float32), torch.tensor(positions.transpose(2, 0, 1)))
    cfg = types.SimpleNamespace(rope_dim=16, rope_theta=10000.0, mrope_section=(4, 2, 2))
    ours_cos, ours_sin = Qwen3VLModel.rope(types.SimpleNamespace(cfg=cfg), jnp.asarray(positions), None)["global"]
    assert np.abs(np.asarray(ours_cos) - cos.numpy()).max() < 1e-6
    assert np.abs(np.asarray(ours_sin) - sin.numpy()).max() < 1e-6
    contiguous, _ = mrope_cos_sin(jnp.asarray(positions), 16, 10000.0, cfg.mrope_section)  # Qwen2.5-VL's layout
    assert np.abs(np.asarray(contiguous) - cos.numpy()).max() > 1e-2


@pytest.mark.parametrize("prompt,count", [(PROMPT, 1), (TWO, 2)], ids=["one", "two"])
def test_image_prompt_matches_hf(vlm, prompt, count):
    _, hf, engine, vocab = vlm
    images = [_image(7, 60, 100), _image(8, 110, 50)][:count]
    ids, spans = _ours(engine, images, prompt)
    want_ids, ref = _reference(engine, images, prompt)
    assert ids == want_ids and len(spans) == count
    tokens, events = _run(engine, f"p{count}", ids, spans, prompt_logprobs=True)
    assert _prompt_error(events, ids, _hf_logprobs(hf, ids, ref, vocab[PAD])) < 1e-4
    greedy = []
    for _ in range(len(tokens)):
        greedy.append(int(_hf_logprobs(hf, ids + greedy, ref, vocab[PAD])[-1].argmax()))
    assert tokens == greedy
    assert engine.stats().recompiles_after_warmup == 0


def test_negative_controls_plain_positions_and_no_deepstack_fail(vlm, monkeypatch):
    _, hf, engine, vocab = vlm
    images = [_image(9, 60, 100)]
    ids, spans = _ours(engine, images)
    ref = _reference(engine, images)[1]
    want = _hf_logprobs(hf, ids, ref, vocab[PAD])
    _, events = _run(engine, "plain", ids, tuple(dataclasses.replace(s, grid=None) for s in spans),
                     prompt_logprobs=True)
    assert _prompt_error(events, ids, want) > 1e-2
    _, events = _run(engine, "control", ids, spans, prompt_logprobs=True)
    assert _prompt_error(events, ids, want) < 1e-4
    text_model = type(hf.model.language_model)
    monkeypatch.setattr(text_model, "_deepstack_process", lambda self, hidden, masks, embeds: hidden)
    assert _prompt_error(events, ids, _hf_logprobs(hf, ids, ref, vocab[PAD])) > 1e-2


def test_same_image_twice_one_encoder_run_and_a_prefix_hit(vlm):
    _, _, engine, _ = vlm
    image = _image(11, 80, 60)
    ids, spans = _ours(engine, [image])
    before = engine.stats()
    first = _run(engine, "c1", ids, spans)
    mid = engine.stats()
    second = _run(engine, "c2", *_ours(engine, [image]))
    assert first[0] == second[0]
    assert mid.encoder_runs - before.encoder_runs == 1 and engine.stats().encoder_runs == mid.encoder_runs
    assert second[1][0].num_cached_tokens >= spans[0].stop - 4
