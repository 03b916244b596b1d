"""`/v1/rerank`, `/rerank` and `/v1/score` against a reference computed with transformers on
the tiny random checkpoint: the yes/no-logit scheme (Qwen3-Reranker's prompt, the two
answer tokens' logits at its last position) and the embedding scheme (cosine of mean-pooled
final hidden states). Two apps over the shared tiny engine (no engine of their own), one
per scheme; the Jina/Cohere response shape and the 400s."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from api.app import create_app
from api.config import ServerConfig
from api.rerank_routes import DEFAULT_INSTRUCTION, answer_token_ids, judge_prompt
from tests.support.server_harness import ServerThread, api_checkpoint, tiny_engine

QUERY = "What stores keys and values?"
DOCUMENTS = ["Paged attention stores keys and values in fixed-size blocks.", "The quick brown fox.",
             "Hello world! How are you today?"]
# f32 on both sides; the paged attention path and the dense reference differ in summation order.
ATOL = 1e-4


@pytest.fixture(scope="module")
def servers():
    with ServerThread(create_app(tiny_engine(), ServerConfig(rerank_scheme="yes-no"))) as yes_no, \
            ServerThread(create_app(tiny_engine(), ServerConfig(rerank_scheme="embedding"))) as embedding:
        yield {"yes-no": yes_no, "embedding": embedding}


@pytest.fixture(scope="module")
def reference():
    """(yes/no score, cosine score) of a pair, computed densely by transformers."""
    import torch
    import transformers

    folder = api_checkpoint()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    yes_id, no_id = answer_token_ids(tiny_engine().tokenizer)

    def yes_no(query: str, document: str) -> float:
        ids = tok(judge_prompt(query, document, DEFAULT_INSTRUCTION), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits[[no_id, yes_id]], dim=0)[1])

    def cosine(query: str, document: str) -> float:
        def mean_state(text: str) -> np.ndarray:
            with torch.no_grad():
                out = model.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0]
            v = out.mean(dim=0).numpy()
            return v / np.linalg.norm(v)
        return float(np.dot(mean_state(query), mean_state(document)))

    return {"yes-no": yes_no, "embedding": cosine}


@pytest.mark.parametrize("scheme", ["yes-no", "embedding"])
def test_rerank_scores_equal_the_reference_best_first(servers, reference, scheme):
    body = httpx.post(servers[scheme] + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS},
                      timeout=60).json()
    want = [reference[scheme](QUERY, doc) for doc in DOCUMENTS]
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert sorted(got) == [0, 1, 2]
    np.testing.assert_allclose([got[i] for i in range(3)], want, atol=ATOL)
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True), "best first"
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[r["index"]] for r in body["results"]]
    assert body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0


def test_top_n_documents_objects_and_the_llamacpp_alias(servers):
    url = servers["yes-no"]
    full = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    top = httpx.post(url + "/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                                            "top_n": 2, "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in full["results"][:2]]
    assert all("document" not in r for r in top["results"])


def test_score_pairs_one_against_many_and_pairwise(servers, reference):
    url = servers["yes-no"]
    many = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    assert many["object"] == "list" and [d["index"] for d in many["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in many["data"]],
                               [reference["yes-no"](QUERY, doc) for doc in DOCUMENTS], atol=ATOL)
    pairwise = httpx.post(url + "/v1/score", json={"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[1:]},
                          timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [reference["yes-no"](DOCUMENTS[0], DOCUMENTS[1]),
                                reference["yes-no"](DOCUMENTS[1], DOCUMENTS[2])], atol=ATOL)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"documents": DOCUMENTS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": [3]}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/rerank", {"model": "nope", "query": QUERY, "documents": DOCUMENTS}, "model"),
])
def test_bad_requests_name_the_field(servers, path, body, param):
    r = httpx.post(servers["yes-no"] + path, json=body, timeout=60)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
