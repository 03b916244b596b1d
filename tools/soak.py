"""Soak test: a bounded, loopback-only load of mixed requests against a running `ferrox serve`.

    python -m tools.soak --url http://127.0.0.1:8383 --requests 2000 --concurrency 16

Each request is drawn (seeded) from this mix:

- 10% malformed: bad JSON, non-UTF-8, wrong types, out-of-range values, unknown model,
  too many stop strings... each must get a 4xx in the OpenAI error envelope;
- 20% cancelled mid-flight by closing the connection: a stream after 1-3 events, a
  whole request after a random 10-300 ms;
- the rest served in full: `/v1/completions` or `/v1/chat/completions`, streaming or
  not, random prompt lengths, `max_tokens` drawn from `--max-tokens LO,HI`, some with
  n=2, logprobs or a stop string. A stream must end with `data: [DONE]` and carry no
  error event.

Then it waits for the server to go idle and reports: counts by status (and by kind),
leaked KV blocks (`kv_blocks_total - kv_blocks_free` from /admin/stats once nothing is
running or waiting), and the server's RSS before and after (from /admin/stats
`rss_bytes`, or /proc/PID/status with `--pid`). RSS "before" is taken after
`--warmup` requests, so allocator growth on the first requests is not counted as a leak;
the RSS at the very start is reported too.

Exit status: 0 when there was no 5xx, no stream error, no malformed request answered
outside the 4xx envelope, no leaked block, the server is still ready, and (with
`--max-rss-growth-pct`) RSS grew less than that; 1 otherwise; 2 for a non-loopback URL.
Traffic goes only to loopback addresses, and the run is bounded by `--requests` and
`--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import ipaddress
import json
import random
import socket
import sys
import time
from typing import Any
from urllib.parse import urlparse

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches near old stone bridges under bright winter stars").split()


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    url: str
    num_requests: int = 2000
    concurrency: int = 16
    max_tokens: tuple[int, int] = (1, 16)
    max_prompt_words: int = 64
    cancel_frac: float = 0.2
    malformed_frac: float = 0.1
    warmup: int = 20  # requests before the RSS baseline
    seed: int = 0
    api_key: str | None = None
    pid: int | None = None
    idle_timeout_s: float = 120.0
    max_seconds: float = 3600.0
    request_timeout_s: float = 300.0
    max_rss_growth_pct: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.cancel_frac + self.malformed_frac <= 1:
            raise ValueError("SoakConfig.cancel_frac + malformed_frac must be in [0, 1]")
        if not 1 <= self.max_tokens[0] <= self.max_tokens[1]:
            raise ValueError(f"SoakConfig.max_tokens must be 1 <= LO <= HI; got {self.max_tokens}")
        if self.concurrency < 1 or self.num_requests < 0:
            raise ValueError("SoakConfig.concurrency must be >= 1 and num_requests >= 0")


def require_loopback(url: str) -> None:
    """Raises ValueError unless every address `url`'s host resolves to is loopback."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"expected an http(s) URL; got {url!r}")
    infos = socket.getaddrinfo(parsed.hostname, parsed.port or 80, proto=socket.IPPROTO_TCP)
    addresses = {info[4][0] for info in infos}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"soak traffic goes to loopback only; {parsed.hostname!r} resolves to {sorted(addresses)}")


# ---------------------------------------------------------------- the request mix


def _prompt(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


def valid_body(rng: random.Random, config: SoakConfig, model: str) -> tuple[str, dict]:
    """A random request the server must serve: (path, JSON body)."""
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*config.max_tokens),
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1 << 20),
                            "stream": rng.random() < 0.5}
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        path = "/v1/completions"
        body["prompt"] = _prompt(rng, config.max_prompt_words)
        if rng.random() < 0.1:
            body["logprobs"] = 2
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": _prompt(rng, config.max_prompt_words)}]
        if rng.random() < 0.1:
            body.update(logprobs=True, top_logprobs=2)
    return path, body


def malformed_body(rng: random.Random, model: str) -> tuple[str, bytes]:
    """A request the server must refuse with a 4xx: (path, raw body)."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    ok = ({"model": model, "prompt": "hi", "max_tokens": 2} if path == "/v1/completions"
          else {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    broken = rng.choice([
        lambda: b'{"prompt": "hi", "max_tokens": ',
        lambda: b"\xff\xfe not utf-8",
        lambda: b"",
        lambda: b"[1, 2, 3]",
        lambda: json.dumps({**ok, "max_tokens": "many"}).encode(),
        lambda: json.dumps({**ok, "max_tokens": -3}).encode(),
        lambda: json.dumps({**ok, "temperature": 7}).encode(),
        lambda: json.dumps({**ok, "n": 0}).encode(),
        lambda: json.dumps({**ok, "model": "no-such-model"}).encode(),
        lambda: json.dumps({**ok, "stop": ["x"] * 100}).encode(),
        lambda: json.dumps({**ok, "top_p": 0}).encode(),
        lambda: json.dumps({k: v for k, v in ok.items() if k not in ("prompt", "messages")}).encode(),
    ])
    return path, broken()


# ---------------------------------------------------------------- one request


async def _full(client: httpx.AsyncClient, path: str, body: dict) -> str:
    """Serve one request in full; returns the outcome key ("200", "5xx-stream-error", ...)."""
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code == 200 and not r.json().get("choices"):
            return "200-empty"
        return str(r.status_code)
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        saw_done = False
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                if payload == "[DONE]":
                    saw_done = True
                elif '"error"' in payload and "error" in json.loads(payload):
                    return "5xx-stream-error"
        return "200" if saw_done else "200-no-done"


async def _cancelled(client: httpx.AsyncClient, path: str, body: dict, rng: random.Random) -> str:
    """Start a request and close the connection mid-flight."""
    if body["stream"]:
        stop_after = rng.randint(1, 3)
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if line == "data: [DONE]":
                        return "200"  # finished before we could leave
                    seen += 1
                    if seen >= stop_after:
                        return "cancelled"  # leaving the block closes the connection
        return "200-no-done"
    try:
        r = await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.01, 0.3))
    except TimeoutError:
        return "cancelled"
    return str(r.status_code)


async def _malformed(client: httpx.AsyncClient, path: str, raw: bytes) -> str:
    r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    if 400 <= r.status_code < 500:
        try:
            error = r.json()["error"]
            assert {"message", "type", "param", "code"} <= set(error)
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"{r.status_code}-no-envelope"
    return str(r.status_code)


# ---------------------------------------------------------------- the run


def read_rss(stats: dict, pid: int | None) -> int | None:
    if pid is not None:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return stats.get("rss_bytes")


async def _stats(client: httpx.AsyncClient) -> dict:
    r = await client.get("/admin/stats")
    r.raise_for_status()
    return r.json()


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = await _stats(client)
        idle = s["generating_now"] == 0 and s["queue_depth"] == 0 and s.get("running_rows", 0) == 0
        if idle and s["kv_blocks_free"] == s["kv_blocks_total"]:
            return s
        if time.monotonic() > deadline:
            return s  # reported as a leak
        await asyncio.sleep(0.1)


async def _soak(config: SoakConfig) -> dict:
    rng = random.Random(config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits,
                                 timeout=config.request_timeout_s) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        first = await _stats(client)
        rss_start = read_rss(first, config.pid)
        outcomes: collections.Counter[str] = collections.Counter()
        by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        plan = []
        for _ in range(config.num_requests):
            u = rng.random()
            kind = ("malformed" if u < config.malformed_frac
                    else "cancelled" if u < config.malformed_frac + config.cancel_frac else "full")
            plan.append((kind, random.Random(rng.randrange(1 << 30))))
        started = time.monotonic()
        rss_before = rss_start
        next_index = 0
        lock = asyncio.Lock()

        async def one(kind: str, r: random.Random) -> None:
            try:
                if kind == "malformed":
                    outcome = await _malformed(client, *malformed_body(r, model))
                else:
                    path, body = valid_body(r, config, model)
                    outcome = await (_full(client, path, body) if kind == "full" else _cancelled(client, path, body, r))
            except httpx.HTTPError as e:
                outcome = f"transport-error:{type(e).__name__}"
            outcomes[outcome] += 1
            by_kind[kind][outcome] += 1

        async def worker() -> None:
            nonlocal next_index, rss_before
            while time.monotonic() - started < config.max_seconds:
                async with lock:
                    if next_index >= len(plan):
                        return
                    index = next_index
                    next_index += 1
                if index == config.warmup and config.warmup:
                    # the RSS baseline: taken once the warm-up requests are out
                    rss_before = read_rss(await _stats(client), config.pid)
                await one(*plan[index])

        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
        elapsed_s = time.monotonic() - started
        idle = await _wait_idle(client, config.idle_timeout_s)
        health = (await client.get("/health")).status_code
        rss_after = read_rss(idle, config.pid)
    return _report(config, outcomes, by_kind, idle, health, rss_start, rss_before, rss_after, elapsed_s,
                   sum(outcomes.values()))


def _report(config: SoakConfig, outcomes: collections.Counter, by_kind: dict, idle: dict, health: int,
            rss_start: int | None, rss_before: int | None, rss_after: int | None, elapsed_s: float,
            num_done: int) -> dict:
    num_5xx = sum(n for k, n in outcomes.items() if k.startswith("5"))
    bad_malformed = sum(n for k, n in by_kind["malformed"].items() if not (k.startswith("4") and k[3:] == ""))
    bad_other = sum(n for k, n in outcomes.items()
                    if k.startswith("transport-error") or k in ("200-no-done", "200-empty"))
    leaked = idle["kv_blocks_total"] - idle["kv_blocks_free"]
    growth_pct = None
    if rss_before and rss_after:
        growth_pct = 100.0 * (rss_after - rss_before) / rss_before
    failures = []
    if num_5xx:
        failures.append(f"{num_5xx} 5xx / stream errors")
    if bad_malformed:
        failures.append(f"{bad_malformed} malformed requests not answered with a 4xx envelope")
    if bad_other:
        failures.append(f"{bad_other} transport errors or incomplete responses")
    if leaked:
        failures.append(f"{leaked} KV blocks leaked")
    if idle["generating_now"] or idle["queue_depth"]:
        failures.append(f"not idle: generating_now={idle['generating_now']} queue_depth={idle['queue_depth']}")
    if health != 200:
        failures.append(f"/health answered {health} after the soak")
    if num_done < config.num_requests:
        failures.append(f"only {num_done} of {config.num_requests} requests ran within {config.max_seconds} s")
    if config.max_rss_growth_pct is not None and growth_pct is not None and growth_pct > config.max_rss_growth_pct:
        failures.append(f"RSS grew {growth_pct:.1f}% (limit {config.max_rss_growth_pct}%)")
    return {
        "requests": num_done, "elapsed_s": round(elapsed_s, 2),
        "requests_per_s": round(num_done / elapsed_s, 2) if elapsed_s else None,
        "by_status": dict(sorted(outcomes.items())),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "num_5xx": num_5xx, "kv_blocks_total": idle["kv_blocks_total"], "kv_blocks_free": idle["kv_blocks_free"],
        "leaked_blocks": leaked, "aborted": idle.get("aborted"), "health_after": health,
        "rss_start_bytes": rss_start, "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
        "rss_growth_pct": None if growth_pct is None else round(growth_pct, 2),
        "failures": failures, "ok": not failures,
    }


def run_soak(config: SoakConfig) -> dict:
    """Run the soak (refusing non-loopback URLs) and return the report dict."""
    require_loopback(config.url)
    return asyncio.run(_soak(config))


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8383")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16, help="keep it at or below the server's --max-queue")
    p.add_argument("--max-tokens", type=_range, default=(1, 16), help="LO,HI for full requests")
    p.add_argument("--max-prompt-words", type=int, default=64)
    p.add_argument("--cancel-frac", type=float, default=0.2)
    p.add_argument("--malformed-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20, help="requests before the RSS baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", type=int, default=None, help="read RSS from /proc/PID (default: /admin/stats)")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for the server to go idle")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="stop sending after this long")
    p.add_argument("--max-rss-growth-pct", type=float, default=None, help="fail above this RSS growth")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    config = SoakConfig(url=args.url, num_requests=args.requests, concurrency=args.concurrency,
                        max_tokens=args.max_tokens, max_prompt_words=args.max_prompt_words,
                        cancel_frac=args.cancel_frac, malformed_frac=args.malformed_frac, warmup=args.warmup,
                        seed=args.seed, api_key=args.api_key, pid=args.pid, idle_timeout_s=args.idle_timeout,
                        max_seconds=args.max_seconds, max_rss_growth_pct=args.max_rss_growth_pct)
    try:
        report = run_soak(config)
    except ValueError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    for failure in report["failures"]:
        print(f"soak: FAIL: {failure}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
