"""`POST /v1/cache/rebuild` over a real server: a stream in flight finishes on the old
cache, new requests meanwhile get 503 `cache_rebuilding` with Retry-After, the new geometry
serves the same greedy text with nothing compiled after its warm-up, and bad bodies are
400s. Its own small engine (2 rows, 32-token chunks: few step shapes to compile twice)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.server_harness import ServerThread, tiny_engine, wait_for

SMALL = dict(max_seqs=2, prefill_chunk=32, kv_blocks=64, max_queue=8)


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(**SMALL), ServerConfig())) as url:
        yield url


def greedy(http) -> str:
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True})
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("body, param", [({"kv_blocks": 48, "kv_memory_gib": 1.0}, "kv_blocks"),
                                         ({"kv_blocks": 1}, "kv_blocks"), ({"kv_blocks": "many"}, "kv_blocks"),
                                         ({}, "kv_blocks")])
def test_bad_bodies_are_400s_and_the_old_cache_serves_on(http, body, param):
    r = http.post("/v1/cache/rebuild", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.get("/health").status_code == 200


def test_a_rebuild_lets_work_finish_refuses_new_work_then_serves_the_new_geometry(server, http):
    text = greedy(http)
    answers: list[httpx.Response] = []
    body = {"prompt": "Hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        rebuilder = threading.Thread(target=lambda: answers.append(
            httpx.post(server + "/v1/cache/rebuild", json={"kv_blocks": 48}, timeout=300)))
        rebuilder.start()
        wait_for(lambda: http.get("/health").json()["state"] == "rebuilding")
        refused = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "cache_rebuilding"
    assert refused.headers["Retry-After"] == "1"
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    rebuilder.join(300)
    done = answers[0].json()
    assert answers[0].status_code == 200 and done["blocks_total"] == 47, done  # 48 less the null block
    assert done["recompiles_after_warmup"] == 0
    status = http.get("/v1/cache/status").json()
    assert (status["blocks_total"], status["blocks_free"]) == (47, 47)
    assert greedy(http) == text, "the same weights on the new cache"
    assert http.get("/admin/stats").json()["recompiles_after_warmup"] == 0, "warmed before it served"
