"""Qwen3-VL images through a real server (a tiny random `Qwen3VLForConditionalGeneration`,
tests/support/tiny_qwen_vl.py) with the official Anthropic client: an image block and a question
answer HF's greedy continuation of the prompt its processor lays out (interleaved M-RoPE and the
deepstack rows through the whole path); a JPEG of the same picture is its own image (another
digest, one more encoder run)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

import anthropic  # noqa: E402

from tests.support.qwen_vl_checks import PAD, image, image_file  # noqa: E402
from tests.support.tiny_qwen_vl import make_tiny_qwen3_vl, qwen3_image_processor  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    folder, _ = make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl-api") / "tiny-qwen3_vl")
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    engine = tiny_engine(folder, block_size=4, kv_blocks=300, max_seqs=4, prefill_chunk=32, max_context=256)
    with ServerThread(create_app(engine)) as base:
        yield base, engine, hf


def _hf_text(engine, hf, picture, question) -> str:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": question}]}])
    ref = qwen3_image_processor()([picture], return_tensors="pt")
    before, after = text.split(PAD)
    ids = engine.tokenizer.encode(before + PAD * int(ref["image_grid_thw"][0].prod() // 4) + after,
                                  add_special_tokens=False)
    out = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            input_ids = torch.tensor([ids + out])
            logits = hf(input_ids=input_ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                        mm_token_type_ids=(input_ids == engine.tokenizer.token_to_id(PAD)).int()).logits
            out.append(int(logits[0, -1].argmax()))
    return engine.tokenizer.decode(out)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_anthropic_image_block_equals_hf(served, fmt):
    base, engine, hf = served
    data = image_file(image(2, 70, 110), fmt)
    picture = PIL.open(io.BytesIO(data)).convert("RGB")  # what the server decodes (JPEG: lossy)
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    runs = engine.stats().encoder_runs
    reply = client.messages.create(
        model=engine.model_name, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": f"image/{fmt.lower()}",
                                         "data": base64.b64encode(data).decode()}},
            {"type": "text", "text": "Describe it."}]}],
        extra_body={"ignore_eos": True, "temperature": 0})
    assert engine.stats().encoder_runs - runs == 1
    assert reply.content[0].text == _hf_text(engine, hf, picture, "Describe it.")
    assert np.asarray(picture).shape == (70, 110, 3)
