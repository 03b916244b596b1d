"""Model admin: local checkpoints listed, a load in the background while the current model
serves (the request in flight finishing on the model it started on), a failed load that
changes nothing, unload (503 model_not_loaded), tasks, and no downloads. Real server."""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, parse_sse, tiny_engine, wait_for

LIMITS = dict(block_size=16, kv_blocks=64, max_seqs=2, max_queue=8, prefill_chunk=16)  # few shapes to compile
made: list = []  # engines the factory built (the app owns them)


def factory(path: str):
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    engine = Engine.load(EngineConfig(model=path, dtype="float32", **LIMITS))
    engine.warmup()
    engine.start()
    made.append(engine)
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.support.tiny_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("models")
    make_tiny_checkpoint(root / "tiny-b", seed=1, max_position_embeddings=256)
    (root / "broken.gguf").write_bytes(b"not a gguf")
    (root / "notes").mkdir()  # neither a folder with config.json nor a .gguf: not listed
    return root


@pytest.fixture(scope="module")
def server(model_dir):
    app = create_app(tiny_engine(), ServerConfig(model_dir=str(model_dir)), engine_factory=factory)
    with ServerThread(app) as url:
        yield url


def task_done(http, task_id: str) -> dict | None:
    task = http.get(f"/admin/tasks/{task_id}").json()
    return task if task["status"] in ("succeeded", "failed") else None


def test_lists_local_checkpoints_and_the_loaded_model(http, model):
    listing = http.get("/admin/models").json()
    assert [m["id"] for m in listing["data"]] == ["default", "broken", "tiny-b"]
    assert listing["loaded"]["id"] == model and not any(m["loaded"] for m in listing["data"])
    assert {m["format"] for m in listing["data"]} == {"gguf", "hf"}


def test_load_swaps_while_the_request_in_flight_finishes_on_its_model(http, server, model):
    body = {"prompt": "Hello world", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, timeout=120) as streamer:
        with streamer.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            started = http.post("/admin/models/load", json={"model": "tiny-b"})
            assert started.status_code == 202 and started.headers["location"].endswith(started.json()["task_id"])
            again = http.post("/admin/models/load", json={"model": "tiny-b"})
            assert again.status_code == 409 and again.json()["error"]["code"] == "load_in_progress"
            assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200, \
                "the current model serves while the new one loads"
            task = wait_for(lambda: task_done(http, started.json()["task_id"]), timeout_s=300)
            events = parse_sse("\n".join(lines) + "\n\n")
    assert task["status"] == "succeeded" and task["kind"] == "load", task
    chunks = [e for e in events if e != "[DONE]"]
    assert {c["model"] for c in chunks} == {model}, "the stream stayed on the model it started on"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny-b"
    out = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).json()
    assert out["model"] == "tiny-b" and out["usage"]["completion_tokens"] == 3
    assert [m["id"] for m in http.get("/admin/models").json()["data"] if m["loaded"]] == ["tiny-b"]


def test_a_failed_load_keeps_the_current_model(http):
    started = http.post("/admin/models/load", json={"model": "broken"})
    task = wait_for(lambda: task_done(http, started.json()["task_id"]), timeout_s=60)
    assert task["status"] == "failed" and "broken.gguf is not a valid GGUF file" in task["error"], task
    assert "ValueError" not in task["error"], "the task's error names no exception class"
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny-b"
    r = http.post("/admin/models/load", json={"model": "../etc/passwd"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", "only listed ids load"


def test_downloads_are_refused(http):
    r = http.post("/admin/download", json={"model": "org/model"})
    assert r.status_code == 501 and "local" in r.json()["error"]["message"]


def test_unload_answers_503_and_retires_the_engine(http):
    r = http.post("/admin/models/unload")
    assert r.status_code == 200 and r.json()["model"] == "tiny-b"
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/messages", None)):
        r = http.post(path, json=body or {"model": "tiny-b", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code in (503, 529), r.text
    assert http.post("/v1/completions", json={"prompt": "Hi"}).json()["error"]["code"] == "model_not_loaded"
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["state"] == "unloaded"
    wait_for(lambda: made[-1].health() == "stopped", timeout_s=30)  # the app owned it: shut down once idle
    kinds = [t["kind"] for t in http.get("/admin/tasks").json()["data"]]
    assert kinds == ["load", "load", "unload"]
