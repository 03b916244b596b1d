"""Soak test: a bounded, loopback-only load of mixed requests against a running `ferrox serve`.

    python -m tools.soak.soak --url http://127.0.0.1:8383 --duration 1800 --concurrency 64 --rss-baseline 300

Each request is drawn (seeded) from the mix in tools/soak/soak_mix.py, over every wire protocol
(OpenAI completions / chat / responses, Anthropic messages, llama.cpp `/completion`,
embeddings), half of the prompts starting with a shared prefix, some with structured
output (`json_schema`), tools, or a LoRA adapter (the adapters `/v1/models` lists):

- `--malformed-frac` (10%) malformed: bad JSON, non-UTF-8, wrong types, out-of-range
  values, unknown model, too many stop strings, a missing field... each must get a 4xx
  in its protocol's own error envelope;
- `--cancel-frac` (20%) cancelled mid-flight by closing the connection: a stream after
  1-3 events, a whole request after a random 10-300 ms;
- `--recheck-frac` (5%) prefix-cache re-checks: one greedy llama.cpp `/completion` over a
  shared prefix sent with `cache_prompt: true` twice (the second reads the cache) and once
  with `cache_prompt: false` (computed cold); the cached tokens must equal the cold ones,
  or part at a near tie (both picks within `soak_requests.NEAR_TIE_NATS` of each other: the
  CPU kernels' arithmetic moves with the step's batch), which is counted and listed;
- `--hostile-frac` (0 unless given) hostile (tools/soak/soak_hostile.py): cache rebuilds no
  device holds, cross-origin "simple" posts to state-changing routes, a foreign `Host`,
  text/plain bodies, broken or mis-named LoRA adapters (with `--runtime-lora`, and the
  folders `--bad-adapters` names under the server's --model-dir), grammar and reply bombs,
  bloated session turns: each must get a 4xx in its route's envelope, and none may change
  whether the server sleeps, its KV cache's size or its adapters (checked at the end);
- the rest served in full. A stream must end the way its protocol ends one (`[DONE]`,
  `response.completed`, `message_stop`, llama.cpp's `stop: true`) and carry no error event.

Throughout, a thread samples `/health` every `--health-interval` seconds on its own
connection (latency p50 / p99 / max, and any non-200) and `/admin/stats` RSS. At the end
it waits for the server to go idle and reports counts by status (and by kind and
protocol), leaked KV blocks (`kv_blocks_total - kv_blocks_free` once nothing is running or
waiting), RSS growth from the baseline (taken `--rss-baseline` seconds in, or after
`--warmup` requests) to the end, and speculative-decoding counters.

Exit status: 0 when there was no 5xx, no stream error, no malformed request answered
outside its envelope, no hostile request served or changing the server, no cached/cold mismatch, no leaked block, the server is still ready,
and (with `--max-rss-growth-pct` / `--max-health-p99-ms`) RSS growth and /health p99 are
under those limits; 1 otherwise; 2 for a non-loopback URL. Traffic goes only to loopback
addresses, and the run is bounded by `--requests` (or `--duration`) and `--max-seconds`.
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

from tools.soak import soak_hostile, soak_mix, soak_requests
from tools.soak.soak_monitor import HealthSampler, percentile


KEEPALIVE_EXPIRY_S = 2.0  # an idle pooled connection is dropped after this (the server's --keep-alive-timeout is 5 s)


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    url: str
    num_requests: int = 2000
    concurrency: int = 16
    max_tokens: tuple[int, int] = (1, 16)
    max_prompt_words: int = 64
    cancel_frac: float = 0.2
    malformed_frac: float = 0.1
    recheck_frac: float = 0.0
    hostile_frac: float = 0.0
    bad_adapters: tuple[str, ...] = ()  # broken adapter folders under the server's --model-dir
    runtime_lora: bool = False  # the server answers /v1/load_lora_adapter
    warmup: int = 20  # requests before the RSS baseline (when rss_baseline_s is None)
    rss_baseline_s: float | None = None  # seconds into the run for the RSS baseline
    duration_s: float | None = None  # run for this long instead of num_requests
    protocols: tuple[str, ...] = soak_mix.PROTOCOLS
    seed: int = 0
    api_key: str | None = None
    pid: int | None = None
    idle_timeout_s: float = 120.0
    max_seconds: float = 3600.0
    request_timeout_s: float = 300.0
    health_interval_s: float = 0.25
    max_rss_growth_pct: float | None = None
    max_health_p99_ms: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.cancel_frac + self.malformed_frac + self.recheck_frac + self.hostile_frac <= 1:
            raise ValueError("SoakConfig.cancel_frac + malformed_frac + recheck_frac + hostile_frac must be in [0, 1]")
        if not 1 <= self.max_tokens[0] <= self.max_tokens[1]:
            raise ValueError(f"SoakConfig.max_tokens must be 1 <= LO <= HI; got {self.max_tokens}")
        if self.concurrency < 1 or self.num_requests < 0:
            raise ValueError("SoakConfig.concurrency must be >= 1 and num_requests >= 0")
        unknown = set(self.protocols) - set(soak_mix.PROTOCOLS)
        if unknown or not self.protocols:
            raise ValueError(f"SoakConfig.protocols must be some of {soak_mix.PROTOCOLS}; got {self.protocols}")


def require_loopback(url: str) -> None:
    """Raises ValueError unless every address `url`'s host resolves to is loopback."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"expected an http(s) URL; got {url!r}")
    infos = socket.getaddrinfo(parsed.hostname, parsed.port or 80, proto=socket.IPPROTO_TCP)
    addresses = {info[4][0] for info in infos}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"soak traffic goes to loopback only; {parsed.hostname!r} resolves to {sorted(addresses)}")


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


def _kind(u: float, config: SoakConfig) -> str:
    edges = (("malformed", config.malformed_frac), ("cancelled", config.cancel_frac),
             ("recheck", config.recheck_frac), ("hostile", config.hostile_frac))
    total = 0.0
    for kind, frac in edges:
        total += frac
        if u < total:
            return kind
    return "full"


class _Run:
    """The shared state of one soak: the mix, the counters, and the RSS baseline."""

    def __init__(self, config: SoakConfig, client: httpx.AsyncClient, model: str, adapters: tuple[str, ...]):
        self.config, self.client, self.model, self.adapters = config, client, model, adapters
        self.prefixes = soak_mix.shared_prefixes(config.seed)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.by_protocol: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.by_hostile: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.state_before: dict[str, Any] = {}
        self.state_after: dict[str, Any] = {}
        self.next_index = 0
        self.started = time.monotonic()
        self.rss_before: int | None = None
        self.transport_errors: list[str] = []  # the first few, named, for the report
        self.recheck_diffs: list[dict] = []  # every prefix-cache re-check whose outputs differed

    def _more(self) -> int | None:
        elapsed = time.monotonic() - self.started
        if elapsed >= self.config.max_seconds:
            return None
        if self.config.duration_s is not None:
            if elapsed >= self.config.duration_s:
                return None
        elif self.next_index >= self.config.num_requests:
            return None
        index, self.next_index = self.next_index, self.next_index + 1
        return index

    async def one(self, index: int) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}-{index}")
        kind, protocol = _kind(rng.random(), config), "llamacpp"
        try:
            if kind == "malformed":
                call, raw = soak_mix.malformed_call(rng, self.model, config.protocols)
                protocol, outcome = call.protocol, await soak_requests.malformed(self.client, call, raw)
            elif kind == "hostile":
                hostile = soak_hostile.hostile_call(rng, self.model, config.bad_adapters, config.runtime_lora)
                protocol, outcome = hostile.kind, await soak_requests.hostile(self.client, hostile)
            elif kind == "recheck":
                outcome = await soak_requests.recheck(self.client, rng, self.model, self.prefixes,
                                                       self.recheck_diffs)
            else:
                call = soak_mix.valid_call(rng, self.model, config.max_tokens, config.max_prompt_words,
                                           self.prefixes, self.adapters, config.protocols)
                protocol = call.protocol
                outcome = await (soak_requests.full(self.client, call) if kind == "full"
                                 else soak_requests.cancelled(self.client, call, rng))
        except httpx.HTTPError as e:
            outcome = f"transport-error:{type(e).__name__}"
            if len(self.transport_errors) < 10:
                self.transport_errors.append(f"request {index} ({kind}, {protocol}): {type(e).__name__}: {e!r}")
        self.outcomes[outcome] += 1
        self.by_kind[kind][outcome] += 1
        (self.by_hostile if kind == "hostile" else self.by_protocol)[protocol][outcome] += 1

    async def worker(self) -> None:
        config = self.config
        while (index := self._more()) is not None:
            baseline_due = (time.monotonic() - self.started >= config.rss_baseline_s
                            if config.rss_baseline_s is not None else index == config.warmup and config.warmup)
            if baseline_due and self.rss_before is None:
                self.rss_before = -1  # claimed; one worker takes it
                self.rss_before = read_rss(await _stats(self.client), config.pid)
            await self.one(index)


async def _models(client: httpx.AsyncClient) -> tuple[str, tuple[str, ...]]:
    """The served model's id, and the LoRA adapters `/v1/models` lists beside it."""
    data = (await client.get("/v1/models")).json()["data"]
    return data[0]["id"], tuple(m["id"] for m in data[1:] if m.get("parent"))


async def _soak(config: SoakConfig) -> dict:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # Pooled connections expire well before the server's keep-alive timeout (5 s): httpx's
    # default expiry is also 5 s, and a request sent on a connection the server is closing
    # that moment fails with "Server disconnected" (HTTP/1.1's keep-alive race, which
    # clients like the OpenAI SDK retry), a client artifact the soak would count as ours.
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits,
                                 timeout=config.request_timeout_s) as client:
        model, adapters = await _models(client)
        first = await _stats(client)
        state_before = await soak_hostile.state_of(client)
        rss_start = read_rss(first, config.pid)
        run = _Run(config, client, model, adapters)
        if not config.warmup and config.rss_baseline_s is None:
            run.rss_before = rss_start
        with HealthSampler(config.url, headers, config.health_interval_s) as health_sampler:
            await asyncio.gather(*(run.worker() for _ in range(config.concurrency)))
            elapsed_s = time.monotonic() - run.started
            idle = await _wait_idle(client, config.idle_timeout_s)
        health = (await client.get("/health")).status_code
        run.state_before, run.state_after = state_before, await soak_hostile.state_of(client)
        rss_after = read_rss(idle, config.pid)
    if run.rss_before in (None, -1):
        run.rss_before = rss_start
    return _report(config, run, idle, health, rss_start, rss_after, elapsed_s, health_sampler)


def _failures(config: SoakConfig, report: dict, run: _Run, idle: dict, health: int) -> list[str]:
    failures = []
    if report["num_5xx"]:
        failures.append(f"{report['num_5xx']} 5xx / stream errors")
    bad_malformed = sum(n for k, n in run.by_kind["malformed"].items() if not (k.startswith("4") and k[3:] == ""))
    if bad_malformed:
        failures.append(f"{bad_malformed} malformed requests not answered with a 4xx in their envelope")
    bad_hostile = {k: n for k, n in run.by_kind["hostile"].items() if k not in ("4xx", "2xx-allowed")}
    if bad_hostile:
        failures.append(f"hostile requests not refused with a 4xx in their envelope: {bad_hostile} "
                        f"(by kind: {dict(run.by_hostile)})")
    if run.state_after != run.state_before:
        failures.append(f"the server changed under the soak: {run.state_before} -> {run.state_after}")
    named = sorted(k for k in run.outcomes if k.startswith(("transport-error", "200-empty")) or k == "200-no-done")
    bad_other = sum(run.outcomes[k] for k in named)
    if bad_other:
        failures.append(f"{bad_other} transport errors or incomplete responses ({', '.join(named)}): "
                        f"{run.transport_errors}")
    if run.outcomes["recheck-mismatch"]:
        failures.append(f"{run.outcomes['recheck-mismatch']} prefix-cached greedy outputs differ from cold ones "
                        f"other than at a near tie: {run.recheck_diffs}")
    if report["leaked_blocks"]:
        failures.append(f"{report['leaked_blocks']} KV blocks leaked")
    if idle["generating_now"] or idle["queue_depth"]:
        failures.append(f"not idle: generating_now={idle['generating_now']} queue_depth={idle['queue_depth']}")
    if health != 200:
        failures.append(f"/health answered {health} after the soak")
    if report["health"]["non_200"]:
        failures.append(f"/health answered non-200 {report['health']['non_200']} times during the soak")
    if config.duration_s is None and report["requests"] < config.num_requests:
        failures.append(f"only {report['requests']} of {config.num_requests} requests ran within "
                        f"{config.max_seconds} s")
    growth = report["rss_growth_pct"]
    if config.max_rss_growth_pct is not None and growth is not None and growth > config.max_rss_growth_pct:
        failures.append(f"RSS grew {growth:.1f}% (limit {config.max_rss_growth_pct}%)")
    p99 = report["health"]["p99_ms"]
    if config.max_health_p99_ms is not None and p99 is not None and p99 > config.max_health_p99_ms:
        failures.append(f"/health p99 {p99:.1f} ms (limit {config.max_health_p99_ms} ms)")
    return failures


def _report(config: SoakConfig, run: _Run, idle: dict, health: int, rss_start: int | None,
            rss_after: int | None, elapsed_s: float, sampler: HealthSampler) -> dict:
    num_done = sum(run.outcomes.values())
    rss_before = run.rss_before
    growth_pct = 100.0 * (rss_after - rss_before) / rss_before if rss_before and rss_after else None
    latencies = sampler.latencies_ms
    report = {
        "requests": num_done, "elapsed_s": round(elapsed_s, 2), "concurrency": config.concurrency,
        "requests_per_s": round(num_done / elapsed_s, 2) if elapsed_s else None,
        "by_status": dict(sorted(run.outcomes.items())),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(run.by_kind.items())},
        "by_protocol": {k: dict(sorted(v.items())) for k, v in sorted(run.by_protocol.items())},
        "by_hostile": {k: dict(sorted(v.items())) for k, v in sorted(run.by_hostile.items())},
        "server_state_before": run.state_before, "server_state_after": run.state_after,
        "adapters": list(run.adapters),
        "transport_errors": list(run.transport_errors),
        "recheck_diffs": list(run.recheck_diffs),
        "num_5xx": sum(n for k, n in run.outcomes.items() if k.startswith("5")),
        "kv_blocks_total": idle["kv_blocks_total"], "kv_blocks_free": idle["kv_blocks_free"],
        "leaked_blocks": idle["kv_blocks_total"] - idle["kv_blocks_free"], "aborted": idle.get("aborted"),
        "spec_decode": {k: idle[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                             "spec_decode_num_accepted_tokens") if k in idle},
        "health_after": health,
        "health": {"samples": len(latencies), "p50_ms": _round(percentile(latencies, 50)),
                   "p99_ms": _round(percentile(latencies, 99)), "max_ms": _round(max(latencies, default=None)),
                   "non_200": sampler.non_200},
        "rss_start_bytes": rss_start, "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
        "rss_max_bytes": max(sampler.rss_bytes, default=None),
        "rss_growth_pct": None if growth_pct is None else round(growth_pct, 2),
    }
    report["failures"] = _failures(config, report, run, idle, health)
    report["ok"] = not report["failures"]
    return report


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


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
    p.add_argument("--duration", type=float, default=None, help="run this many seconds (instead of --requests)")
    p.add_argument("--concurrency", type=int, default=16, help="keep it at or below the server's --max-queue")
    p.add_argument("--max-tokens", type=_range, default=(1, 16), help="LO,HI for full requests")
    p.add_argument("--max-prompt-words", type=int, default=64)
    p.add_argument("--cancel-frac", type=float, default=0.2)
    p.add_argument("--malformed-frac", type=float, default=0.1)
    p.add_argument("--recheck-frac", type=float, default=0.05, help="prefix-cached vs cold greedy re-checks")
    p.add_argument("--hostile-frac", type=float, default=0.0, help="hostile requests (tools/soak/soak_hostile.py)")
    p.add_argument("--runtime-lora", action="store_true", help="the server has --enable-runtime-lora: "
                   "hostile adapter loads too")
    p.add_argument("--bad-adapters", default="", help="comma-separated broken adapter folders under the server's "
                   "--model-dir (python -m tools.soak.soak_hostile GOOD_ADAPTER OUT_DIR writes them)")
    p.add_argument("--protocols", default=",".join(soak_mix.PROTOCOLS), help="comma-separated subset")
    p.add_argument("--warmup", type=int, default=20, help="requests before the RSS baseline")
    p.add_argument("--rss-baseline", type=float, default=None, help="seconds in for the RSS baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", type=int, default=None, help="read RSS from /proc/PID (default: /admin/stats)")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for the server to go idle")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="stop sending after this long")
    p.add_argument("--health-interval", type=float, default=0.25, help="seconds between /health samples")
    p.add_argument("--max-rss-growth-pct", type=float, default=None, help="fail above this RSS growth")
    p.add_argument("--max-health-p99-ms", type=float, default=None, help="fail above this /health p99")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    try:
        config = SoakConfig(
            url=args.url, num_requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
            max_prompt_words=args.max_prompt_words, cancel_frac=args.cancel_frac,
            malformed_frac=args.malformed_frac, recheck_frac=args.recheck_frac, warmup=args.warmup,
            hostile_frac=args.hostile_frac, runtime_lora=args.runtime_lora,
            bad_adapters=tuple(name for name in args.bad_adapters.split(",") if name),
            rss_baseline_s=args.rss_baseline, duration_s=args.duration,
            protocols=tuple(args.protocols.split(",")), seed=args.seed, api_key=args.api_key, pid=args.pid,
            idle_timeout_s=args.idle_timeout, max_seconds=args.max_seconds,
            health_interval_s=args.health_interval, max_rss_growth_pct=args.max_rss_growth_pct,
            max_health_p99_ms=args.max_health_p99_ms)
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
