"""`POST /v1/cache/rebuild` over a real server: a stream in flight finishes on the old
cache, new requests meanwhile get 503 `cache_rebuilding` with Retry-After, the new geometry
serves the same greedy text with nothing compiled after its warm-up, and bad bodies are
400s. A cache the device cannot hold (or its int32 block ids cannot address) is a 400
naming the field and what fits, before anything is sealed or freed: the old cache serves
on. A model load or unload while a rebuild runs is a 409, and the rebuilt engine serves.
Its own small engine (2 rows, 32-token chunks: few step shapes to compile twice)."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from ferrox_jax.memory_bounds import host_total_bytes
from tests.support.server_harness import ServerThread, api_checkpoint, tiny_engine, wait_for

SMALL = dict(max_seqs=2, prefill_chunk=32, kv_blocks=64, max_queue=8)
loads: list[str] = []  # checkpoints the app asked its engine factory for


def refuse_to_load(path: str):
    """The app's engine factory: nothing may load while a rebuild runs; it records the ask."""
    loads.append(path)
    raise RuntimeError("this test's factory loads nothing")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("models")
    (model_dir / "tiny-again").symlink_to(api_checkpoint(), target_is_directory=True)
    app = create_app(tiny_engine(**SMALL), ServerConfig(model_dir=str(model_dir)), engine_factory=refuse_to_load)
    with ServerThread(app) as url:
        yield url


def greedy(http) -> str:
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True})
    return r.json()["choices"][0]["text"]


def test_the_kv_blocks_asked_for_are_the_contracts_kv_blocks_total(http):
    # kv_blocks=64 at load: the contract's total is the budget requests can use, so 64; the
    # null block padded rows write into is the engine's own (65 blocks of bytes).
    stats = http.get("/admin/stats").json()
    assert stats["kv_blocks_total"] == SMALL["kv_blocks"], f"asked {SMALL['kv_blocks']} blocks: {stats}"
    status = http.get("/v1/cache/status").json()
    assert status["bytes_total"] == (SMALL["kv_blocks"] + 1) * status["bytes_per_block"], status


@pytest.mark.parametrize("body, param", [({"kv_blocks": 48, "kv_memory_gib": 1.0}, "kv_blocks"),
                                         ({"kv_blocks": 0}, "kv_blocks"), ({"kv_blocks": "many"}, "kv_blocks"),
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
    assert answers[0].status_code == 200 and done["blocks_total"] == 48, done  # asked 48 usable blocks
    assert done["recompiles_after_warmup"] == 0
    status = http.get("/v1/cache/status").json()
    assert (status["blocks_total"], status["blocks_free"]) == (48, 48)
    assert status["bytes_total"] == 49 * status["bytes_per_block"], "the cache holds the 48 and the null block"
    stats = http.get("/admin/stats").json()
    assert (stats["kv_blocks_total"], stats["kv_blocks_free"]) == (48, 48), "the contract's total is what was asked"
    assert greedy(http) == text, "the same weights on the new cache"
    assert http.get("/admin/stats").json()["recompiles_after_warmup"] == 0, "warmed before it served"


@pytest.mark.parametrize("body", [{"kv_blocks": 2**62}, {"kv_blocks": 2**40}, {"kv_memory_gib": 1e12},
                                  {"kv_memory_gib": 1e9}])
def test_a_cache_the_device_cannot_hold_is_a_400_naming_what_fits_and_the_old_cache_serves_on(http, body):
    text = greedy(http)
    before = http.get("/v1/cache/status").json()
    r = http.post("/v1/cache/rebuild", json=body)
    field, value = next(iter(body.items()))
    assert r.status_code == 400, f"a cache too big for the device is a 400, not an abort or a 500: {r.text}"
    error = r.json()["error"]
    assert error["param"] == field and error["code"] in ("insufficient_memory", "invalid_value"), error
    message = error["message"]
    assert message.startswith(f"{field} "), f"the message names the field first: {message}"
    assert "Error" not in message, f"no internal exception names: {message}"
    most = re.search(rf"ask for at most {field} ([0-9.]+)$", message)
    assert most, f"the message says what fits: {message}"
    # What it offers is within this host's memory (the rebuild's own arithmetic is checked
    # exactly in tests/engine/test_memory_bounds.py against a given room).
    offered = float(most.group(1)) * (before["bytes_per_block"] if field == "kv_blocks" else 2**30)
    assert 0 < offered <= host_total_bytes(), message
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["state"] == "ready", "nothing was sealed"
    after = http.get("/v1/cache/status").json()
    assert after["blocks_total"] == before["blocks_total"], "the old cache serves on"
    assert greedy(http) == text, "the old engine answers as before"


def test_a_model_load_or_unload_during_a_rebuild_is_a_409_and_the_rebuilt_engine_serves(server, http):
    blocks = http.get("/v1/cache/status").json()["blocks_total"]  # the same size again
    answers: list[httpx.Response] = []
    rebuilder = threading.Thread(target=lambda: answers.append(
        httpx.post(server + "/v1/cache/rebuild", json={"kv_blocks": blocks}, timeout=300)))
    rebuilder.start()
    wait_for(lambda: http.get("/health").json()["state"] == "rebuilding")
    load = http.post("/admin/models/load", json={"model": "tiny-again"})
    unload = http.post("/admin/models/unload")
    rebuilder.join(300)
    assert load.status_code == 409 and load.json()["error"]["code"] == "cache_rebuilding", \
        f"a load during a rebuild is refused, not swapped out again by the rebuild's end: {load.text}"
    assert unload.status_code == 409 and unload.json()["error"]["code"] == "cache_rebuilding", unload.text
    assert loads == [], "the factory was never asked"
    assert answers[0].status_code == 200, answers[0].text
    assert http.get("/health").json()["state"] == "ready"
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    assert [t for t in http.get("/admin/tasks").json()["data"] if t["kind"] in ("load", "unload")] == [], \
        "no task was started"
