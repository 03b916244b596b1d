"""Replicas behind a real router: how often do prompts hit a prefix cache?

    python -m tools.bench.bench_router --model PATH --users 5 --turns 4 --result-json results/router.json

Starts two `ferrox serve` replicas of `--model` on loopback and SGLang's model gateway
(`smg launch`, from PyPI) in front of them, then sends the same kind of traffic three
ways: through the gateway with its `cache_aware` policy, through it with `round_robin`,
and to one replica alone. The hit rate of a run is the prefix-cache hits over the
prefix-cache queries it added on the replicas it used, both in prompt tokens (the
`vllm:prefix_cache_*_total` counters of `/metrics`), so it says what fraction of the
prompt tokens was served from cache rather than computed.

Traffic (`make_traffic`): `--users` users share one system preamble; each has a context
of their own and asks `--turns` questions, each turn's prompt being the preamble, the
context and every question so far (a conversation resent whole, as chat clients do).
The users' requests are interleaved in a seeded random order, one at a time, so a run
is reproducible and no user's turns arrive in lock-step with a round-robin rotation.
Each run draws its own texts (its seed), so no run finds an earlier run's prefixes.

The gateway is asked to route to vLLM-like workers: it probes `/version`, reads its
load from `/metrics` (`vllm:kv_cache_usage_perc`, `vllm:num_requests_*`), and its
cache-aware policy keeps, per worker, a tree of the request texts it sent there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
REPLICA_LIMITS = ["--block-size", "16", "--kv-blocks", "512", "--max-context", "1024", "--max-seqs", "4",
                  "--prefill-chunk", "128", "--dtype", "float32"]


def _sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def make_traffic(num_users: int, turns: int, seed: int, preamble_words: int = 24, context_words: int = 48,
                 question_words: int = 8) -> list[tuple[int, str]]:
    """(user, prompt) in sending order (module docstring, "Traffic")."""
    rng = random.Random(seed)
    preamble = f"System {seed}: " + _sentence(rng, preamble_words) + ".\n"
    contexts = [f"User {u}: " + _sentence(rng, context_words) + ".\n" for u in range(num_users)]
    order = [u for u in range(num_users) for _ in range(turns)]
    rng.shuffle(order)
    asked: list[list[str]] = [[] for _ in range(num_users)]
    traffic = []
    for user in order:
        asked[user].append(f"Q{len(asked[user])}: " + _sentence(rng, question_words) + "?\n")
        traffic.append((user, preamble + contexts[user] + "".join(asked[user])))
    return traffic


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(queries, hits) in prompt tokens, summed over the replicas at `urls`."""
    queries = hits = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
                elif sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
    return queries, hits


def run_traffic(base_url: str, replica_urls: list[str], traffic: list[tuple[int, str]], model: str,
                max_tokens: int = 2) -> dict:
    """Send `traffic` to `base_url` one request at a time; the hit rate it added on the
    replicas and how many requests were answered (200 with the tokens asked for)."""
    queries0, hits0 = prefix_counters(replica_urls)
    answered = 0
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for _, prompt in traffic:
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
            answered += r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
    queries1, hits1 = prefix_counters(replica_urls)
    queries, hits = queries1 - queries0, hits1 - hits0
    return {"requests": len(traffic), "answered": answered, "prompt_tokens": int(queries),
            "cached_tokens": int(hits), "hit_rate": hits / queries if queries else 0.0}


def _wait_http(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float, ok=lambda r: True) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError, ValueError):
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and ok(r):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout_s:g} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def smg_binary() -> str | None:
    """The gateway's console script, next to this interpreter or on PATH; None when missing."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


@contextlib.contextmanager
def smg_gateway(worker_urls: list[str], policy: str, port: int, log_path: Path,
                timeout_s: float = 60.0) -> Iterator[str]:
    """`smg launch` in front of `worker_urls` with `policy`; yields its URL once it lists
    every worker as healthy."""
    binary = smg_binary()
    if binary is None:
        raise FileNotFoundError("smg is not installed (pip install smg)")
    cmd = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *worker_urls, "--log-level", "warn", "--disable-retries"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/readiness", proc, log_path, timeout_s,
                   ok=lambda r: r.json().get("healthy_workers", 0) >= len(worker_urls))
        yield url
    finally:
        _stop(proc)


@contextlib.contextmanager
def ferrox_replicas(model: str, ports: list[int], log_dir: Path, extra: list[str] | None = None,
                    timeout_s: float = 300.0) -> Iterator[list[str]]:
    """`ferrox serve` replicas of `model` on loopback `ports`, started together; yields their URLs."""
    procs, urls = [], []
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    try:
        for port in ports:
            log_path = log_dir / f"replica-{port}.log"
            cmd = [sys.executable, "-m", "api.cli", "serve", "--model", model, "--port", str(port),
                   *(extra if extra is not None else REPLICA_LIMITS), *(["--compile-cache-dir", cache] if cache else [])]
            with open(log_path, "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url, port in zip(procs, urls, ports):
            _wait_http(url + "/health", proc, log_dir / f"replica-{port}.log", timeout_s)
        yield urls
    finally:
        for proc in procs:
            _stop(proc)


def compare(replicas: list[str], gateway_port: int, log_dir: Path, users: int, turns: int, seed: int,
            workers_seen: list | None = None) -> dict:
    """The three runs of the module docstring on running replicas; returns their results.
    `workers_seen`, when given, gets each gateway's `/workers` listing (what it made of us)."""
    model = httpx.get(replicas[0] + "/v1/models").json()["data"][0]["id"]
    results = {}
    for i, policy in enumerate(("cache_aware", "round_robin")):
        with smg_gateway(replicas, policy, gateway_port, log_dir / f"smg-{policy}.log") as gateway:
            if workers_seen is not None:
                workers_seen.append(httpx.get(gateway + "/workers", timeout=10).json())
            results[policy] = run_traffic(gateway, replicas, make_traffic(users, turns, seed + i), model)
    results["one_replica"] = run_traffic(replicas[0], replicas[:1], make_traffic(users, turns, seed + 2), model)
    return results


def main() -> None:
    from tests.support.server_harness import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint the two replicas serve")
    parser.add_argument("--users", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="results/router")  # replica and gateway logs, git-ignored
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with ferrox_replicas(args.model, [free_port(), free_port()], log_dir) as replicas:
        results = compare(replicas, free_port(), log_dir, args.users, args.turns, args.seed)
    text = json.dumps(results, indent=2)
    print(text)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
