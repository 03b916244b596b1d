"""llama.cpp's native `/completion` end to end, checked against the field names its server
README documents: flat JSON (`content`, `stop`, `stop_type`, `stopping_word`,
`tokens_predicted`, `tokens_evaluated`, `timings`), bare `data:` stream frames ending in
one `stop: true` frame, llama.cpp's error envelope, cancellation. Real server, tiny Llama."""

from __future__ import annotations

import json

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, tiny_engine, wait_for

PROMPT = "Hello world"
TIMINGS = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
           "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def complete(http, **body) -> dict:
    r = http.post("/completion", json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def frames(text: str) -> list[dict]:
    blocks = text.strip().split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), "bare data frames, nothing else"
    return [json.loads(b[len("data: "):]) for b in blocks]


def test_completion_fields_and_timings(http):
    out = complete(http, n_predict=8)
    assert isinstance(out["content"], str) and out["stop"] is True
    assert out["stop_type"] == "limit" and out["stopping_word"] == ""
    assert out["tokens_predicted"] == 8
    assert out["tokens_evaluated"] == http.post("/v1/tokenize", json={"prompt": PROMPT}).json()["count"]
    timings = out["timings"]
    assert set(timings) == TIMINGS
    assert timings["prompt_n"] == out["tokens_evaluated"] and timings["predicted_n"] == 8
    assert timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    assert out["generation_settings"]["n_predict"] == 8


def test_token_id_prompts_and_the_default_n_predict(http):
    ids = http.post("/v1/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert complete(http, prompt=ids, n_predict=6)["content"] == complete(http, n_predict=6)["content"]
    near_full = (ids * CONTEXT_TOKENS)[:CONTEXT_TOKENS - 20]  # room for 20 tokens: a short generation
    out = complete(http, prompt=near_full)  # n_predict absent: the room left in the context
    assert out["tokens_predicted"] == 20 and out["stop_type"] == "limit"
    scored = complete(http, n_predict=0)
    assert scored["content"] == "" and scored["tokens_predicted"] == 0


def test_stopping_word(http):
    text = complete(http, n_predict=24)["content"]
    word = text[4:7]
    out = complete(http, n_predict=24, stop=["never-there", word])
    assert out["stop_type"] == "word" and out["stopping_word"] == word
    assert out["content"] == text[:text.find(word)]


def test_sampling_fields_are_accepted(http):
    out = complete(http, n_predict=4, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                   presence_penalty=0.5, frequency_penalty=0.5, seed=42, cache_prompt=True)
    again = complete(http, n_predict=4, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                     presence_penalty=0.5, frequency_penalty=0.5, seed=42, cache_prompt=True)
    assert out["content"] == again["content"], "a seed makes the draw reproducible"
    greedy = complete(http, n_predict=12, ignore_eos=True)["content"]
    hot = dict(n_predict=12, ignore_eos=True, temperature=1.5, seed=7)
    assert complete(http, **hot, top_k=1)["content"] == greedy, "top_k 1 keeps only the greedy token"
    assert complete(http, **hot, min_p=1.0)["content"] == greedy, "min_p 1 keeps only the greedy token"
    assert complete(http, **hot, top_p=1e-6)["content"] == greedy, "a tiny top_p keeps only the greedy token"


def test_seed_minus_one_reports_the_seed_the_engine_drew(http):
    sampled = dict(n_predict=8, temperature=1.0, ignore_eos=True)
    drawn = complete(http, **sampled)  # seed -1
    seed = drawn["generation_settings"]["seed"]
    assert 0 <= seed < 2**31, "seed -1 reports the drawn seed, in int32 range"
    again = complete(http, **sampled, seed=seed)
    assert again["content"] == drawn["content"], "the reported seed reproduces the reply"
    assert again["generation_settings"]["seed"] == seed, "a named seed is reported as sent"


def test_stream_frames_end_with_one_stop_frame(http):
    whole = complete(http, n_predict=10)
    r = http.post("/completion", json={"prompt": PROMPT, "temperature": 0, "n_predict": 10, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream") and "[DONE]" not in r.text
    events = frames(r.text)
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == whole["content"]
    last = events[-1]
    assert last["content"] == "" and last["tokens_predicted"] == 10 and last["stop_type"] == "limit"
    assert set(last["timings"]) == TIMINGS


@pytest.mark.parametrize("method,path,body,status,kind", [
    ("POST", "/completion", b"{oops", 400, "invalid_request_error"),
    ("POST", "/completion", json.dumps({"prompt": ["a", "b"]}).encode(), 400, "invalid_request_error"),
    ("POST", "/completion", json.dumps({"prompt": "x", "n_predict": -2}).encode(), 400, "invalid_request_error"),
    ("POST", "/completions", json.dumps({"prompt": [1] * CONTEXT_TOKENS}).encode(), 400,
     "exceed_context_size_error"),
    ("GET", "/completion", None, 405, "invalid_request_error"),
    ("POST", "/completion/more", b"{}", 404, "not_found_error"),
])
def test_errors_use_the_llamacpp_envelope(http, method, path, body, status, kind):
    r = http.request(method, path, content=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"code", "message", "type"} and error["code"] == status and error["type"] == kind


def test_disconnect_cancels_and_frees_every_block(http, server):
    before = http.get("/admin/stats").json()["aborted"]
    with httpx.Client(base_url=server, timeout=60) as streamer:
        with streamer.stream("POST", "/completion", json={"prompt": PROMPT, "temperature": 0, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_for(lambda: http.get("/admin/stats").json()["aborted"] == before + 1)
    wait_for(lambda: http.get("/admin/stats").json()["kv_blocks_free"] == http.get("/admin/stats").json()[
        "kv_blocks_total"])
    record = http.get("/admin/stats").json()["recent"][-1]
    assert record["route"] == "/completion" and record["status"] == 499
