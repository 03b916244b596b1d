"""A local CPU cluster of `ferrox serve` processes for the multi-host tests.

`cluster(n, log_dir, ...)` starts n processes tensor parallel across all of them (the
leader configured by flags, the followers by FERROX_* variables, one CPU device each,
gloo collectives) and yields (urls, procs) once the leader answers /health 200; every
process is killed on the way out. `complete_all` sends the suite's greedy prompts;
`check_shared_compiles` reads the processes' logs for the compiles process 0 shared.

Used by tests/system/test_multihost.py (what the group computes: the single-process
tokens, shared compiles, drafts) and tests/system/test_multihost_faults.py (failures,
signals and the step channel's door), split so the two halves run on both workers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.server_harness import api_checkpoint, free_port, wait_for_serve_process
from tests.support.xla_flags import with_devices

REPO = Path(__file__).resolve().parents[2]
# Few buckets (decode 1 and 2 rows, one 32-token chunk): quick to compile.
TINY_LIMITS = dict(block_size=16, kv_blocks=128, max_context=512, max_seqs=2, prefill_chunk=32)
# The default model: one decode row, one 16-token chunk (the prompts are shorter), 64
# blocks: 6 compiled shapes (decode, chunk, mixed, 2 samplers, the block copy) where a
# 64-token chunk makes 10; each costs 10-20 s per cluster on the shared 2 cores.
DEFAULT_LIMITS = dict(block_size=16, kv_blocks=64, max_seqs=1, prefill_chunk=16, max_queue=4)
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "Numbers: 0 1 2 3"]
TIMEOUT_S = 4  # --multihost-timeout-s of the fault clusters (10 s by default)
SECRET = "the test group's shared secret"  # at least 16 characters, as EngineConfig asks


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
def cluster(num_processes: int, log_dir: Path, model: str | None = None, limits: dict = TINY_LIMITS,
            extra: tuple[str, ...] = (), secret: str | None = None, during_start_up=None,
            follower_faults: dict[str, str] | None = None):
    """`num_processes` `ferrox serve` processes, tensor parallel across all of them; yields
    (urls, procs) once the leader answers /health 200, and kills every one on the way out
    (SIGKILL also ends a stopped process). `secret`: the leader's --multihost-secret and the
    followers' FERROX_MULTIHOST_SECRET (None: the leader generates one); `during_start_up`
    is called with (the step channel's address, procs) once every process is started;
    `follower_faults`: variables the followers run `tests/support/fault_serve.py` under instead of
    the plain CLI (a test fault on the followers' runners; None: none)."""
    port = _coordinator_port()
    coordinator = f"127.0.0.1:{port}"
    common = [sys.executable, "-m", "api.cli", "serve", "--model", model or str(api_checkpoint()),
              "--dtype", "float32", *_flags(limits), "--tensor-parallel", str(num_processes), *extra,
              "--compile-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": with_devices(1)}
    procs, ports = [], [free_port() for _ in range(num_processes)]
    try:
        for i, http_port in enumerate(ports):
            if i == 0:  # the leader by flags, the followers by FERROX_* variables
                cmd = [*common, "--port", str(http_port), "--coordinator-address", coordinator,
                       "--num-processes", str(num_processes), "--process-id", "0"]
                cmd += ["--multihost-secret", secret] if secret else []
                proc_env = env
            else:
                cmd = [*common, "--port", str(http_port)]
                if follower_faults:  # the same serve arguments, through the fault-injecting entry point
                    cmd[1:3] = ["-m", "tests.support.fault_serve"]
                proc_env = {**env, **(follower_faults or {}), "FERROX_COORDINATOR_ADDRESS": coordinator,
                            "FERROX_NUM_PROCESSES": str(num_processes), "FERROX_PROCESS_ID": str(i)}
                proc_env.update({"FERROX_MULTIHOST_SECRET": secret} if secret else {})
            with open(log_dir / f"process-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=proc_env))
        if during_start_up is not None:
            during_start_up(("127.0.0.1", port + 1), procs)
        urls = [f"http://127.0.0.1:{http_port}" for http_port in ports]
        wait_for_serve_process(procs[0], urls[0], log_dir / "process-0.log", 600)
        yield urls, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def complete_all(url: str, concurrent: bool = False, prompts: list[str] = PROMPTS) -> list[dict]:
    """The prompts, greedy, one after another (or two at a time: decode steps of 2 rows);
    (text, tokens) each."""
    def one(prompt: str) -> dict:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}

    if not concurrent:
        return [one(p) for p in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, prompts))


def reference_replies(checkpoint: str | None = None, limits: dict = TINY_LIMITS, concurrent: bool = False) -> list[dict]:
    """One process's replies to PROMPTS (`complete_all`), from this one: `checkpoint`
    (None: the tiny one) in float32 under `limits` (over tests/support/server_harness.py's
    defaults, as `tiny_engine` builds it), served over HTTP, then shut down. Not warmed up:
    a reference compiles only the shapes its requests reach (the default model one row at a
    time: 3 of its 6 executables), the same programs a warmed engine runs; the clusters
    under test warm up, and their "no compile after warm-up" is checked on their leaders."""
    from api.app import create_app
    from api.config import ServerConfig
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from tests.support.server_harness import DEFAULT_LIMITS as SERVER_LIMITS
    from tests.support.server_harness import ServerThread

    engine = Engine.load(EngineConfig(model=str(checkpoint or api_checkpoint()), dtype="float32",
                                      **{**SERVER_LIMITS, **limits}))
    try:
        engine.start()
        with ServerThread(create_app(engine, ServerConfig())) as url:
            return complete_all(url, concurrent=concurrent)
    finally:
        engine.shutdown()


def tiny_reference_replies() -> list[dict]:
    """The tiny checkpoint's replies to PROMPTS (two at a time) from one process, in this one."""
    return reference_replies(concurrent=True)


def check_shared_compiles(log_dir: Path, num_processes: int) -> None:
    """Process 0 compiled every shape once for the group and every follower loaded each one;
    except those process 0 read from its persistent cache (a warm tests/.jax_cache), which
    the followers compile themselves (multihost.py: such executables cannot be shared)."""
    leader = (log_dir / "process-0.log").read_text()
    shared, cached = leader.count("and shared it with the group"), leader.count("from the compilation cache:")
    assert shared + cached > 0, "process 0 compiles (or reads) the step shapes and shares them"
    for i in range(1, num_processes):
        log = (log_dir / f"process-{i}.log").read_text()
        assert log.count("from process 0 (") == shared, f"follower {i} loads each of process 0's {shared} executables"
        assert log.count("process 0 read it from its compilation cache") == cached
        assert "Traceback" not in log, f"follower {i} ran every step it was sent"
