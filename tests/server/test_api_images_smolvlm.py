"""SmolVLM images through a real server (a tiny random `SmolVLMForConditionalGeneration`,
tests/support/tiny_smolvlm.py) with the official clients: an OpenAI chat turn with two images of
two shapes (a wide one, 1 x 2 tiles plus the global view; a square one, 2 x 2 plus the global
view), and an Anthropic image block, answer HF's greedy continuation of the prompt HF's processor
lays out for the same images;
a bad image is a 400 naming what is wrong and the server serves on with no blocks leaked."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402

from tests.support.tiny_smolvlm import TOKENS_PER_TILE, make_tiny_smolvlm, processor  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    folder, _ = make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm-api") / "tiny-smolvlm", smolvlm=True)
    hf = transformers.SmolVLMForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    engine = tiny_engine(folder, block_size=4, kv_blocks=400, max_seqs=4, prefill_chunk=32, max_context=384)
    with ServerThread(create_app(engine)) as base:
        yield base, engine, hf, folder


def _image(seed: int, height: int, width: int):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, 3)).astype(np.uint8), "RGB")


def _b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _data_url(image) -> str:
    return "data:image/png;base64," + _b64(image)


def _hf_text(engine, hf, folder, content: list[dict], images: list) -> str:
    """HF's greedy text for a user turn of `content`, laid out by HF's processor."""
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    ref = processor(folder)(text=[text], images=[images], return_tensors="pt")
    ids, out = ref["input_ids"][0].tolist(), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = hf(input_ids=torch.tensor([ids + out]), pixel_values=ref["pixel_values"],
                        pixel_attention_mask=ref["pixel_attention_mask"]).logits
            out.append(int(logits[0, -1].argmax()))
    return engine.tokenizer.decode(out)


def test_openai_chat_two_images_equal_hf(served):
    base, engine, hf, folder = served
    images = [_image(1, 20, 60), _image(2, 48, 48)]
    question = "What differs?"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    runs = engine.stats().encoder_runs
    reply = client.chat.completions.create(
        model=engine.model_name, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(images[0])}},
                                               {"type": "text", "text": question},
                                               {"type": "image_url", "image_url": {"url": _data_url(images[1])}}]}])
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": question}, {"type": "image"}]}])
    ref = processor(folder)(text=[text], images=[images], return_tensors="pt")
    ids = ref["input_ids"][0].tolist()
    assert ids.count(engine.tokenizer.token_to_id("<image>")) == (3 + 5) * TOKENS_PER_TILE
    assert reply.usage.prompt_tokens == len(ids)
    assert engine.stats().encoder_runs - runs == 3 + 5  # every tile of the two images once
    out = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = hf(input_ids=torch.tensor([ids + out]), pixel_values=ref["pixel_values"],
                        pixel_attention_mask=ref["pixel_attention_mask"]).logits
            out.append(int(logits[0, -1].argmax()))
    assert reply.choices[0].message.content == engine.tokenizer.decode(out)


def test_bad_image_is_a_400_and_the_server_serves_on(served):
    base, engine, _, _ = served
    body = {"model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"GIF89a no").decode()}},
        {"type": "text", "text": "hi"}]}]}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "could not be read" in r.json()["error"]["message"]
    ok = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200
    from tests.support.server_harness import wait_for

    assert wait_for(lambda: engine.stats().running_rows == 0)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_anthropic_image_block_equals_hf(served):
    base, engine, hf, folder = served
    image = _image(3, 64, 30)  # tall: 2 x 1 tiles plus the global view
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    reply = client.messages.create(
        model=engine.model_name, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(image)}},
            {"type": "text", "text": "Describe it."}]}],
        extra_body={"ignore_eos": True, "temperature": 0})
    want = _hf_text(engine, hf, folder, [{"type": "image"}, {"type": "text", "text": "Describe it."}], [image])
    assert reply.content[0].text == want
