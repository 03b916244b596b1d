"""Images on the wires, through a real server over a tiny random Gemma 3 vision-language checkpoint
(tests/support/tiny_vlm.py), with the official clients:

- OpenAI chat (`image_url` data URL), Anthropic Messages (`image` base64 block) and Responses
  (`input_image`): each answers, and its greedy text is HF's greedy continuation of the same
  prompt given the same pixels (the prompt laid out as HF's Gemma 3 processor lays it: the
  begin-of-image marker becomes "\\n\\n", the marker, the soft tokens, the end marker, "\\n\\n");
- bad images are 400s in each route's envelope that name what is wrong (truncated, not an image,
  an http URL, too many, bad base64), and the server serves on with no blocks leaked.
"""

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

from tests.support.tiny_vlm import IMAGE_SIZE, TOKENS_PER_IMAGE, make_tiny_vlm  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    folder, vocab_size = make_tiny_vlm(tmp_path_factory.mktemp("vlm-api") / "tiny-gemma3-vlm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = tiny_engine(folder, block_size=4, kv_blocks=400, max_seqs=8, prefill_chunk=32, max_context=256)
    with ServerThread(create_app(engine)) as base:
        yield base, engine, hf, vocab_size


def _png(seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    image = PIL.fromarray(rng.integers(0, 256, (40, 52, 3)).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _expected_text(engine, hf, vocab_size, question: str, data: bytes) -> str:
    """HF's greedy text for a user turn of [image, question], laid out as HF's processor does."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": question}]}])
    boi, eoi, soft = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    ids = tok.encode(text.replace(boi, f"\n\n{boi}{soft * TOKENS_PER_IMAGE}{eoi}\n\n"), add_special_tokens=False)
    proc = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    pixels = proc(images=[PIL.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")["pixel_values"]
    out = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            input_ids = torch.tensor([ids + out])
            logits = hf(input_ids=input_ids, pixel_values=pixels.float(),
                        token_type_ids=(input_ids == vocab_size - 1).long()).logits
            out.append(int(logits[0, -1].argmax()))
    return tok.decode(out)


def test_openai_chat_image_url(served):
    base, engine, hf, vocab = served
    data = _png(1)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=engine.model_name, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(data)}},
                                               {"type": "text", "text": "What is this?"}]}])
    assert reply.usage.prompt_tokens > TOKENS_PER_IMAGE
    assert reply.choices[0].message.content == _expected_text(engine, hf, vocab, "What is this?", data)


def test_anthropic_image_block(served):
    base, engine, hf, vocab = served
    data = _png(2, "JPEG")
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    reply = client.messages.create(
        model=engine.model_name, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(data).decode()}},
            {"type": "text", "text": "Describe it."}]}],
        extra_body={"ignore_eos": True, "temperature": 0})
    assert reply.content[0].text == _expected_text(engine, hf, vocab, "Describe it.", data)


def test_responses_input_image(served):
    base, engine, hf, vocab = served
    data = _png(3)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    reply = client.responses.create(
        model=engine.model_name, max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": _data_url(data)},
                                            {"type": "input_text", "text": "Name it."}]}])
    assert reply.output_text == _expected_text(engine, hf, vocab, "Name it.", data)


@pytest.mark.parametrize("url, words", [
    (_data_url(_png(4)[:120]), "truncated"),
    (_data_url(b"%PDF-1.4 not an image at all"), "could not be read"),
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,@@@@", "does not decode"),
])
def test_bad_images_are_400s_and_the_server_serves_on(served, url, words):
    base, engine, _, _ = served
    body = {"model": engine.model_name, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "hi"}]}]}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and "Error" not in error["message"]
    ok = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


def test_too_many_images_names_the_limit(served):
    base, engine, _, _ = served
    part = {"type": "image_url", "image_url": {"url": _data_url(_png(5))}}
    body = {"model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": [part] * 9}]}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "limit is 8" in r.json()["error"]["message"]


def test_anthropic_bad_image_is_its_envelope(served):
    base, engine, _, _ = served
    r = httpx.post(base + "/v1/messages", timeout=60, headers={"anthropic-version": "2023-06-01"}, json={
        "model": engine.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}]}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "not fetched" in r.json()["error"]["message"]


def test_no_blocks_leaked(served):
    _, engine, _, _ = served
    from tests.support.server_harness import wait_for

    assert wait_for(lambda: engine.stats().running_rows == 0)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "a refused or finished image request kept blocks"
    assert stats.encoder_runs >= 1 and stats.image_tokens >= TOKENS_PER_IMAGE
