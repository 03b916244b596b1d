"""The embedded default model (SmolLM2-135M-Instruct Q4_1) behind the real server: the
model id clients see and a greedy answer a 135M instruct model gets right. Kept small
(one row, short prefill buckets, 64 KV blocks) so it loads and compiles in seconds."""

from __future__ import annotations

import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    engine = tiny_engine("default", kv_blocks=64, max_seqs=1, prefill_chunk=64, max_queue=4)
    with ServerThread(create_app(engine, ServerConfig())) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_default_model_id_and_greedy_chat(client):
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct.Q4_1", "the GGUF file's stem, as docs/api.md shows"
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", "ends on <|im_end|>, which is not in the text"
    assert "<|im_end|>" not in reply.choices[0].message.content


def test_default_model_streams(client):
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                            temperature=0, stream=True))
    assert "Paris" in "".join(c.choices[0].text for c in chunks)
