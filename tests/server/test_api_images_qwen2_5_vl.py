"""Qwen2.5-VL images through a real server (a tiny random `Qwen2_5_VLForConditionalGeneration`,
tests/support/tiny_qwen_vl.py) with the official OpenAI client: a chat turn asking about an image
answers HF's greedy continuation of the prompt HF's processor lays out for it (M-RoPE positions
through the whole path: the API's layout, the engine's chunks and its decoding)."""

from __future__ import annotations

import base64
import io
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

import openai  # noqa: E402

from tests.support.tiny_qwen_vl import image_processor, make_tiny_qwen_vl  # noqa: E402

MAX_TOKENS = 6
PAD = "<|image_pad|>"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    folder, _ = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen-vl-api") / "tiny-qwen2_5_vl")
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    engine = tiny_engine(folder, block_size=4, kv_blocks=300, max_seqs=4, prefill_chunk=32, max_context=256)
    with ServerThread(create_app(engine)) as base:
        yield base, engine, hf


def test_openai_chat_image_question_equals_hf(served):
    base, engine, hf = served
    rng = np.random.default_rng(1)
    image = PIL.fromarray(rng.integers(0, 256, (70, 110, 3)).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = "What is in this picture?"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    runs = engine.stats().encoder_runs
    reply = client.chat.completions.create(
        model=engine.model_name, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": question}]}])
    assert engine.stats().encoder_runs - runs == 1
    # HF: the chat template's text, each <|image_pad|> repeated as its processor does, the whole model.
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": question}]}])
    ip = image_processor()
    ref = ip([image], return_tensors="pt")
    pieces = text.split(PAD)
    proc = types.SimpleNamespace(image_processor=ip, image_token=PAD)
    text = pieces[0] + transformers.Qwen2_5_VLProcessor.replace_image_token(proc, ref, 0) + pieces[1]
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(ids)
    out = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            input_ids = torch.tensor([ids + out])
            logits = hf(input_ids=input_ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                        mm_token_type_ids=(input_ids == engine.tokenizer.token_to_id(PAD)).int()).logits
            out.append(int(logits[0, -1].argmax()))
    assert reply.choices[0].message.content == engine.tokenizer.decode(out)
