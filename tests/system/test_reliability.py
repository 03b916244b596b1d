"""Reliability end to end: graceful drain of a real `ferrox serve` process, failures
injected into the real engine (one failing step, a dead owner loop), and a small soak.

Drain runs the console script as a subprocess on the tiny model (a few seconds to start
with the persistent compile cache) and sends it SIGTERM. Engine failures patch the real
runner / scheduler of engines no other module shares (their limits are unique), so a
killed loop cannot leak into other tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import (CONTEXT_TOKENS, ServerThread, api_checkpoint, free_port, parse_sse, tiny_engine,
                                  wait_for, wait_for_serve_process)

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-drain-secret-5f3c9a"
# ~2-4 s of decoding on the tiny model: outlasts anything a test does mid-stream
LONG = dict(prompt="Hello world", max_tokens=CONTEXT_TOKENS - 16, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------- helpers


@contextlib.contextmanager
def serve_process(tmp_path: Path, *flags: str, env: dict | None = None):
    """`ferrox serve` on the tiny model and a free loopback port; yields (process, url, log path)."""
    port = free_port()
    script = Path(sys.executable).with_name("ferrox")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]
    if env and "FERROX_FAULT_INJECT" in env:  # the CLI with the tests' fault-injection runner
        cmd = [sys.executable, "-m", "tests.support.fault_serve"]
    cmd += ["serve", "--model", str(api_checkpoint()), "--port", str(port), "--dtype", "float32",
            "--kv-blocks", "512", "--max-seqs", "32", "--prefill-chunk", "64", "--max-queue", "64",
            "--compile-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"], *flags]
    log_path = tmp_path / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_serve_process(proc, url, log_path, 120)
        yield proc, url, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def data_events(lines) -> list:
    return parse_sse("\n".join(lines) + "\n\n")


def first_event(lines) -> dict:
    import json

    line = next(line for line in lines if line.startswith("data: "))
    return json.loads(line[len("data: "):])


def stats(http) -> dict:
    return http.get("/admin/stats").json()


def idle(http) -> bool:
    s = stats(http)
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["queue_depth"] == 0 and s["generating_now"] == 0


def post_in_thread(url: str, body: dict, headers: dict | None = None) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        out.append(httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# ---------------------------------------------------------------- graceful drain


def test_drain_finishes_started_streams_refuses_new_work_and_exits_0(tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    with serve_process(tmp_path, "--shutdown-timeout", "30", env={"FERROX_API_KEY": KEY}) as (proc, url, log):
        with httpx.Client(base_url=url, headers=auth, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as started:
            lines = started.iter_lines()
            first = first_event(lines)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: http.get("/health").status_code == 503)
            assert http.get("/health").json()["state"] == "draining"
            for body in ({"prompt": "Hi", "max_tokens": 2}, {"prompt": "Hi", "max_tokens": 2, "stream": True}):
                late = http.post("/v1/completions", json=body)
                assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
                assert late.json()["error"]["code"] == "draining"
            events = [first] + data_events(lines)
        assert events[-1] == "[DONE]", "the stream started before SIGTERM runs to its end"
        choices = [c for e in events[:-1] for c in e["choices"]]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        assert proc.wait(30) == 0
        text = log.read_text()
        assert "draining" in text
        assert KEY not in text, "the API key must never be logged"


def test_drain_timeout_ends_leftovers_with_an_error_and_exits_0(tmp_path):
    with serve_process(tmp_path, "--shutdown-timeout", "0") as (proc, url, log):
        with httpx.Client(base_url=url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as leftover:
            lines = leftover.iter_lines()
            first_event(lines)
            thread, whole = post_in_thread(url, LONG)
            wait_for(lambda: stats(http)["generating_now"] == 2)
            proc.send_signal(signal.SIGTERM)
            events = data_events(lines)
            thread.join(30)
        assert events and events[-1] != "[DONE]"
        error = events[-1]["error"]
        assert error["code"] == "draining" and "shut down" in error["message"]
        assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "draining"
        assert whole[0].headers["retry-after"] == "1"
        assert proc.wait(30) == 0
        assert "still running after 0 s; ending them with an error" in log.read_text()


# ---------------------------------------------------------------- engine failures


class FailingRuns:
    """Cues the engine's fault-injection runner (`tests/support/faults.py`): the next `left` steps
    raise, then it runs normally (reset when the test ends)."""

    def __init__(self, monkeypatch, runner) -> None:
        self.runner = runner
        monkeypatch.setattr(runner, "fail_next", 0)

    @property
    def left(self) -> int:
        return self.runner.fail_next

    @left.setter
    def left(self, count: int) -> None:
        self.runner.fail_next = count


@pytest.fixture(scope="module")
def one_row():
    """One row at a time (max_seqs 1): a waiting request is in no step."""
    engine = tiny_engine(max_seqs=1, max_queue=8)
    with ServerThread(create_app(engine, ServerConfig())) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield engine, url, http


def test_a_failing_step_ends_only_its_stream_with_an_error_event(one_row, monkeypatch):
    engine, url, http = one_row
    fail = FailingRuns(monkeypatch, engine.runner)
    wait_for(lambda: idle(http))
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
        lines = running.iter_lines()
        first_event(lines)  # decoding: holds the one row
        thread, waiting = post_in_thread(url, {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        wait_for(lambda: stats(http)["queue_depth"] == 1)
        fail.left = 1  # the running stream's next step
        events = data_events(lines)
    thread.join(30)
    assert events[-1]["error"]["code"] == "engine_error" and "injected" in events[-1]["error"]["message"]
    assert waiting[0].status_code == 200, "a request that was in no failing step is served"
    assert waiting[0].json()["usage"]["completion_tokens"] == 4
    assert http.get("/health").status_code == 200
    wait_for(lambda: idle(http))


def test_a_failing_step_answers_a_whole_request_with_500(one_row, monkeypatch):
    engine, url, http = one_row
    fail = FailingRuns(monkeypatch, engine.runner)
    wait_for(lambda: idle(http))
    fail.left = 1
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_error") and "injected" in error["message"]
    assert "RuntimeError" not in error["message"], "the body names no exception class"
    wait_for(lambda: idle(http))
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200


def test_a_dead_loop_ends_open_requests_and_refuses_new_ones_without_hanging(monkeypatch):
    # Unique limits: nobody else uses this engine. Two rows (both requests below decode at once),
    # 16-token chunks: 8 executables to warm up where the harness's 32 rows and 64-token chunks make 32.
    engine = tiny_engine(max_seqs=2, prefill_chunk=16, max_queue=61)
    with ServerThread(create_app(engine, ServerConfig())) as url, httpx.Client(base_url=url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as open_stream:
            lines = open_stream.iter_lines()
            first_event(lines)
            thread, whole = post_in_thread(url, LONG)
            wait_for(lambda: stats(http)["generating_now"] == 2)

            def crash() -> None:
                raise RuntimeError("injected loop crash")

            monkeypatch.setattr(engine._batcher._scheduler, "schedule", crash)
            events = data_events(lines)  # httpx's 10 s timeout: a hang fails here
        thread.join(10)
        assert events[-1]["error"]["code"] == "engine_error" and "crashed" in events[-1]["error"]["message"]
        assert "RuntimeError" not in events[-1]["error"]["message"], "the event names no exception class"
        assert whole[0].status_code == 500 and whole[0].json()["error"]["code"] == "engine_error"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["state"] == "unavailable"
        assert health.headers["retry-after"] == "1"
        for body in ({"prompt": "Hi", "max_tokens": 2}, {"prompt": "Hi", "max_tokens": 2, "stream": True}):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "unavailable"


# ---------------------------------------------------------------- soak


def test_small_soak_has_no_5xx_and_leaks_no_blocks():
    from tools.soak.soak import SoakConfig, run_soak

    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        report = run_soak(SoakConfig(url=url, num_requests=60, concurrency=8, max_tokens=(1, 24), warmup=0,
                                     seed=7, idle_timeout_s=30))
    assert report["requests"] == 60
    assert report["num_5xx"] == 0, report
    assert report["leaked_blocks"] == 0, report
    assert report["ok"], report["failures"]
    assert report["by_kind"]["malformed"] and all(k.startswith("4") for k in report["by_kind"]["malformed"])


def test_soak_refuses_non_loopback_targets():
    from tools.soak.soak import require_loopback

    require_loopback("http://127.0.0.1:8383")
    require_loopback("http://localhost:8383")
    with pytest.raises(ValueError, match="loopback only"):
        require_loopback("http://192.0.2.1:8383")  # TEST-NET-1: never routed
