"""Multi-host serving on a local CPU cluster: `ferrox serve` as 2 and as 4 processes
(jax.distributed, gloo collectives, tensor parallel across them; the followers configured
by FERROX_* variables) answers the single-process greedy tokens through the HTTP API with
no compile after warm-up; a follower killed mid-stream ends the stream with an error
event, turns the leader's /health 503 with the reason and makes the leader exit
non-zero; followers whose leader was killed exit non-zero."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.server_harness import ServerThread, api_checkpoint, free_port, parse_sse, tiny_engine, wait_for_serve_process

REPO = Path(__file__).resolve().parent.parent
# Few buckets (decode 1 and 2 rows, one 32-token chunk): every process compiles them all.
LIMITS = dict(block_size=16, kv_blocks=128, max_context=512, max_seqs=2, prefill_chunk=32)
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "Numbers: 0 1 2 3"]


def _flags(limits: dict) -> list[str]:
    return [arg for key, value in limits.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def _coordinator_port() -> int:
    """A free port whose successor (the step channel) is free too."""
    while True:
        port = free_port()
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port


@contextlib.contextmanager
def cluster(num_processes: int, log_dir: Path, extra: tuple[str, ...] = ()):
    coordinator = f"127.0.0.1:{_coordinator_port()}"
    common = [sys.executable, "-m", "api.cli", "serve", "--model", str(api_checkpoint()), "--dtype", "float32",
              *_flags(LIMITS), "--tensor-parallel", str(num_processes), *extra,
              "--compile-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs, ports = [], [free_port() for _ in range(num_processes)]
    for i, port in enumerate(ports):
        if i == 0:  # the leader by flags, the followers by FERROX_* variables
            cmd = [*common, "--port", str(port), "--coordinator-address", coordinator,
                   "--num-processes", str(num_processes), "--process-id", "0"]
            proc_env = env
        else:
            cmd = [*common, "--port", str(port)]
            proc_env = {**env, "FERROX_COORDINATOR_ADDRESS": coordinator, "FERROX_NUM_PROCESSES": str(num_processes),
                        "FERROX_PROCESS_ID": str(i)}
        with open(log_dir / f"process-{i}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=proc_env))
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        wait_for_serve_process(procs[0], urls[0], log_dir / "process-0.log", 300)
        yield urls, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def complete_all(url: str) -> list[dict]:
    """The prompts two at a time (decode steps of 2 rows), greedy; (text, tokens) each."""
    def one(prompt: str) -> dict:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    with ServerThread(create_app(tiny_engine(**LIMITS), ServerConfig())) as url:
        return complete_all(url)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("multihost")
    with cluster(2, log_dir) as (urls, procs):
        yield urls, procs, log_dir


def test_two_processes_give_the_single_process_greedy_tokens(two_processes, reference):
    (leader, follower), _, _ = two_processes
    assert httpx.get(follower + "/health").json() == {"state": "ready", "role": "follower", "process_id": 1}
    assert httpx.get(follower + "/v1/models").status_code == 404, "a follower serves /health only"
    got = complete_all(leader)
    assert got == reference, "tp2 across 2 processes: the greedy tokens of one process"
    metrics = httpx.get(leader + "/metrics").text
    assert "ferrox_recompiles_after_warmup_total 0.0" in metrics, "no compile after warm-up"


def test_a_killed_follower_fails_the_stream_the_health_and_the_leader(two_processes):
    (leader, _), (leader_proc, follower_proc), log_dir = two_processes
    body = {"prompt": "Count", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", leader + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)  # streaming
        killed_at = time.monotonic()
        follower_proc.send_signal(signal.SIGKILL)
        rest = "\n".join(lines)
    events = parse_sse(rest + "\n\n")
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and "follower process 1" in errors[-1]["error"]["message"], rest[-1000:]
    health = httpx.get(leader + "/health", timeout=5)
    assert health.status_code == 503 and "follower process 1" in health.json()["reason"], health.text
    assert time.monotonic() - killed_at < 30, "the failure is reported within 30 s"
    assert events[-1] == "[DONE]" or "error" in events[-1], "the error event closes the stream"
    assert leader_proc.wait(60) != 0, "the leader exits non-zero so a supervisor restarts the group"
    assert "multi-host group failed" in (log_dir / "process-0.log").read_text()


def test_four_processes_give_the_single_process_greedy_tokens(tmp_path, reference):
    # The tiny model has 2 KV heads: 4-way tensor parallelism replicates attention and
    # splits the MLP and the vocabulary over the 4 processes.
    with cluster(4, tmp_path, ("--replicate-attention",)) as (urls, procs):
        for follower in urls[1:]:
            assert httpx.get(follower + "/health").json()["state"] == "ready"
        assert complete_all(urls[0]) == reference, "tp4 across 4 processes: the greedy tokens of one process"
        assert "ferrox_recompiles_after_warmup_total 0.0" in httpx.get(urls[0] + "/metrics").text
        procs[0].send_signal(signal.SIGKILL)  # the leader dies: every follower exits too, non-zero
        for follower in procs[1:]:
            assert follower.wait(30) != 0, "a follower without its leader exits non-zero"
