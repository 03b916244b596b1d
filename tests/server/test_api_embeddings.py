"""/v1/embeddings end to end with the `openai` client: vectors equal a direct computation
from the model's hidden states (HF transformers on the same checkpoint), mean and last
pooling, float and base64, batched with generation traffic, zero recompiles. Real server."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, api_checkpoint, tiny_engine, wait_for

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 8]  # the second spans 3 chunks of 64


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def reference():
    """Final-norm hidden states of the checkpoint, computed densely by transformers."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(api_checkpoint(), dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0].numpy()  # [T, D]

    return hidden


def unit(v) -> np.ndarray:
    return np.asarray(v) / np.linalg.norm(v)


def tokens(http, text: str) -> list[int]:
    return http.post("/v1/tokenize", json={"prompt": text}).json()["tokens"]


def test_mean_and_last_pooling_equal_the_hidden_states(client, model, http, reference):
    ids = [tokens(http, t) for t in TEXTS]
    assert len(ids[1]) > 128, "long enough to be prefilled in several chunks"
    out = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens == sum(map(len, ids))
    last = client.embeddings.create(model=model, input=TEXTS, extra_body={"pooling": "last"})
    for i, prompt in enumerate(ids):
        states = reference(prompt)
        # paged, chunked attention vs transformers' dense pass, f32: agree to ~1e-6; 1e-4 leaves room
        np.testing.assert_allclose(out.data[i].embedding, unit(states.mean(axis=0)), atol=1e-4)
        np.testing.assert_allclose(last.data[i].embedding, unit(states[-1]), atol=1e-4)
        assert np.linalg.norm(out.data[i].embedding) == pytest.approx(1.0, abs=1e-5)


def test_float_format_and_token_id_inputs(http):
    ids = tokens(http, TEXTS[0])
    as_text = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"}).json()
    as_ids = http.post("/v1/embeddings", json={"input": ids}).json()
    as_lists = http.post("/v1/embeddings", json={"input": [ids, ids]}).json()
    assert as_text["object"] == "list" and as_text["data"][0]["object"] == "embedding"
    assert isinstance(as_text["data"][0]["embedding"], list)
    np.testing.assert_allclose(as_ids["data"][0]["embedding"], as_text["data"][0]["embedding"], atol=1e-6)
    assert len(as_lists["data"]) == 2 and as_lists["usage"]["prompt_tokens"] == 2 * len(ids)


def test_batched_with_a_stream_that_keeps_decoding(http, server):
    long = {"prompt": "Hello", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/completions", json=long) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would close the connection
            next(line for line in lines if line.startswith("data: "))
            before = http.get("/admin/stats").json()["decode_steps"]
            for _ in range(3):
                assert http.post("/v1/embeddings", json={"input": TEXTS}).status_code == 200
            assert http.get("/admin/stats").json()["decode_steps"] > before, "the stream decoded meanwhile"
    wait_for(lambda: (s := http.get("/admin/stats").json())["kv_blocks_free"] == s["kv_blocks_total"])
    stats = http.get("/admin/stats").json()
    assert stats["recompiles_after_warmup"] == 0, "pooling shares the prefill buckets compiled at warm-up"
    assert stats["recent"][-1]["route"] == "/v1/completions" and stats["recent"][-2]["route"] == "/v1/embeddings"


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [1, "a"]}, "input"),
    ({"input": "Hi", "dimensions": 3}, "dimensions"), ({"input": "Hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "Hi", "pooling": "max"}, "pooling"), ({"input": [[1] * 4096]}, "input"),
    ({"input": "Hi", "model": "text-embedding-3-small"}, "model"),
])
def test_refusals_name_the_param(http, body, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
