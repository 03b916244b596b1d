"""Process and admin knobs: cancelling a model load, `/v1/admin/prepare-stop` (drain and
seal), and `ferrox serve --port 0 --exit-on-stdin-close` (the ready lines on stdout, the
exit when stdin closes). The routes run on one app over the shared tiny engine (no engine
of its own); the console script is one real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, api_checkpoint, tiny_engine, wait_for


# The shared engine's limits (tests/support/server_harness.py), so its compiled steps are reused.
SHARED_ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "16", "--kv-blocks", "512", "--max-seqs", "32",
                       "--max-queue", "64", "--prefill-chunk", "64"]


class _FakeEngine:
    """What a cancelled load builds: only its shutdown is ever called."""

    def __init__(self) -> None:
        self.shut_down = threading.Event()

    def shutdown(self) -> None:
        self.shut_down.set()


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """(release, built): the app's engine factory blocks until `release` is set."""
    return threading.Event(), []


@pytest.fixture(scope="module")
def server(tmp_path_factory, loads):
    model_dir = tmp_path_factory.mktemp("models")
    (model_dir / "other").mkdir()
    (model_dir / "other" / "config.json").write_text("{}")
    release, built = loads

    def factory(_path: str) -> _FakeEngine:
        release.wait(30)
        built.append(_FakeEngine())
        return built[-1]

    app = create_app(tiny_engine(), ServerConfig(model_dir=str(model_dir)), engine_factory=factory)
    with ServerThread(app) as url:
        yield url


def test_a_cancelled_load_is_discarded_and_the_model_keeps_serving(http, loads):
    release, built = loads
    before = http.get("/v1/models").json()["data"][0]["id"]
    task = http.post("/admin/models/load", json={"model": "other"}).json()
    cancelled = http.post(f"/admin/tasks/{task['task_id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    release.set()
    wait_for(lambda: built and built[0].shut_down.is_set())
    assert http.get(f"/admin/tasks/{task['task_id']}").json()["status"] == "cancelled"
    assert http.get("/v1/models").json()["data"][0]["id"] == before, "the cancelled model never swapped in"
    again = http.post(f"/admin/tasks/{task['task_id']}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "task_finished"
    unknown = http.post("/admin/tasks/task-nope/cancel")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("body, param", [({"wait": "yes"}, "wait"), ({"timeout_s": -1}, "timeout_s")])
def test_prepare_stop_bad_bodies_are_400s(http, body, param):
    r = http.post("/v1/admin/prepare-stop", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert http.get("/health").status_code == 200, "a refused call seals nothing"


def test_prepare_stop_finishes_in_flight_work_then_reports_sealed(server, http, client, model):
    """Last in the module: the server stays sealed."""
    with httpx.Client(base_url=server, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 800,
                                                              "temperature": 0, "ignore_eos": True,
                                                              "stream": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            first = http.post("/v1/admin/prepare-stop", json={"wait": False})
            assert first.status_code == 202 and first.json() == {"status": "draining", "in_flight": 1}
            assert http.get("/health").json()["state"] == "draining"
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model=model, prompt="Hello", max_tokens=1)
            assert e.value.status_code == 503 and e.value.body["code"] == "draining"
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length", \
        "the stream in flight finishes whole"
    sealed = http.post("/v1/admin/prepare-stop")
    assert sealed.status_code == 200 and sealed.json() == {"status": "sealed", "in_flight": 0}


def test_port_0_prints_its_address_and_stdin_closing_stops_the_server():
    code = "import sys\nfrom api.cli import main\nsys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "serve", "--port", "0", "--exit-on-stdin-close", "--model",
            str(api_checkpoint()), *SHARED_ENGINE_FLAGS, "--no-web-ui"]
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # the tests' persistent cache: the same shapes load, not compile
        argv += ["--compile-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    env = {**os.environ, "FERROX_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True)
    try:
        listening = json.loads(proc.stdout.readline())
        assert listening["event"] == "listening" and listening["port"] > 0
        assert listening["url"] == f"http://127.0.0.1:{listening['port']}"
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["url"] == listening["url"]
        health = httpx.get(ready["url"] + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["model"] == ready["model"]
        proc.stdin.close()
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
        assert proc.stdout.read() == "", "nothing but the two lines on stdout"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
