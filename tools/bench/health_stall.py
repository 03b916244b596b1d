"""How long `/health` stalls while big `count_tokens` bodies are in flight.

    python -m tools.bench.health_stall --url http://127.0.0.1:8383 --requests 8 --messages 60000

Samples `/health` every `--interval` seconds from a thread on its own connection: first
alone for `--baseline` seconds, then while `--requests` concurrent
`POST /v1/messages/count_tokens` calls each carry `--messages` short messages (about
1.2 MB for 60,000). Prints the /health latency (p50 / p99 / max) in both phases and how
long the count_tokens calls took; a liveness probe's `timeoutSeconds` must exceed the
loaded max. Loopback only. The figures go in docs/operations.md, not in an assertion.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import threading
import time

import httpx

from tools.soak.soak import require_loopback
from tools.soak.soak_monitor import percentile


def big_body(model: str, num_messages: int) -> bytes:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(num_messages)]
    return json.dumps({"model": model, "messages": messages}).encode()


def _sample(url: str, interval_s: float, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.wait(interval_s):
            started = time.perf_counter()
            client.get("/health")
            out.append(1000.0 * (time.perf_counter() - started))


def _summary(values: list[float]) -> dict:
    return {"samples": len(values), "p50_ms": round(percentile(values, 50) or 0, 1),
            "p99_ms": round(percentile(values, 99) or 0, 1), "max_ms": round(max(values, default=0), 1)}


def measure(url: str, num_requests: int, num_messages: int, baseline_s: float, interval_s: float) -> dict:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = big_body(model, num_messages)
    stop, quiet = threading.Event(), []
    sampler = threading.Thread(target=_sample, args=(url, interval_s, stop, quiet), daemon=True)
    sampler.start()
    time.sleep(baseline_s)
    stop.set()
    sampler.join()
    stop, loaded = threading.Event(), []
    sampler = threading.Thread(target=_sample, args=(url, interval_s, stop, loaded), daemon=True)
    sampler.start()

    def one(_: int) -> tuple[int, float]:
        started = time.perf_counter()
        r = httpx.post(url + "/v1/messages/count_tokens", content=body, timeout=600,
                       headers={"Content-Type": "application/json"})
        return r.status_code, time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        results = list(pool.map(one, range(num_requests)))
    stop.set()
    sampler.join()
    return {"body_bytes": len(body), "requests": num_requests, "statuses": sorted({s for s, _ in results}),
            "count_tokens_s": round(max(t for _, t in results), 2),
            "health_idle": _summary(quiet), "health_loaded": _summary(loaded)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8383")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--messages", type=int, default=60000)
    p.add_argument("--baseline", type=float, default=3.0, help="seconds of /health alone first")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between /health samples")
    args = p.parse_args(argv)
    try:
        require_loopback(args.url)
    except ValueError as e:
        print(f"health_stall: {e}", file=sys.stderr)
        return 2
    print(json.dumps(measure(args.url, args.requests, args.messages, args.baseline, args.interval), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
