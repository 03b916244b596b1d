"""Serving benchmark: drive an OpenAI-compatible server and report what `vllm bench serve` does.

    python -m tools.bench.bench_serving --base-url http://127.0.0.1:8383 --label ferrox \\
        --input-len 128 --output-len 128 --num-requests 64 --max-concurrency 8 \\
        --result-json results/ferrox-c8.json

Any server works (ours, llama.cpp's, vLLM's): the client speaks plain HTTP + SSE through
httpx, streams every request and times it from the client side. It is a tool, not a test:
tests/tools/test_bench_serving.py checks what it parses and counts, never its timings.

One run, in order:
  1. Prompts (tools/bench/bench_prompts.py): synthetic prompts of exact token counts, counted
     with `--tokenizer-model default|PATH` (our `models.tokenizer`, the same prompts for
     every server), else the server's tokenize route, else one token per word (a
     documented approximation); or `--dataset` JSONL lines `{"prompt", "output_len"}`.
     `--workload shared-prefix` or `multi-turn` sends prompts that share prefixes instead
     (tools/bench/bench_workloads.py): N prefixes of `--prefix-len` tokens each followed by
     distinct questions, or conversations of `--num-turns` turns that resend the whole
     conversation every turn; the report adds TTFT of cold vs warm requests, or by turn.
  2. Warm-up: `--warmup-requests` requests at the same concurrency, not counted (for the
     prefix workloads, with prefixes of their own).
  3. The measured phase: `--num-requests` requests, at most `--max-concurrency` in flight
     and arriving as a Poisson process of `--request-rate` per second (seeded), either or
     both; a tqdm bar counts finished requests.
  4. Report (tools/bench/bench_report.py): a table on stdout and, with `--result-json`, every metric, every parameter,
     `--label`, a timestamp and per-request lengths/latencies in one JSON file.
     `python -m tools.bench.plot_bench` plots several such files.

Output length is pinned with `max_tokens` plus `ignore_eos` and `min_tokens` (turn either off
with `--no-ignore-eos` / `--no-min-tokens` for a server that rejects them); the tokens that
actually came back are counted from `usage.completion_tokens` (asked for with
`stream_options.include_usage`), else as the number of chunks carrying text, and requests
whose count differs from what was asked are counted in `num_output_len_mismatch`.

Metric definitions (as vLLM's): TTFT is request start to the first chunk with text; ITL the
gaps between successive text chunks; TPOT per request (e2e - TTFT) / (output tokens - 1);
e2el request start to the end of the stream. Throughputs divide by the measured phase's
wall time. Only loopback hosts are accepted unless `--allow-remote`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import httpx

from api.config import is_loopback  # the same check the server applies to its bind address
from tools.bench import bench_workloads
from tools.bench.bench_prompts import BenchRequest, dataset_requests, make_counter, synthetic_requests
from tools.bench.bench_report import build_result, compute_metrics, format_table



@dataclasses.dataclass(frozen=True)
class BenchConfig:
    base_url: str
    label: str
    endpoint: str = "completions"                 # "completions" or "chat"
    model: str | None = None                      # None: the first id of GET /v1/models
    input_len: int = 128                          # synthetic prompt tokens
    output_len: int = 128                         # max_tokens asked per request
    range_ratio: float = 0.0                      # lengths uniform in len * [1 - r, 1 + r]
    dataset: str | None = None                    # JSONL {"prompt", "output_len"} instead
    num_requests: int = 64
    max_concurrency: int | None = None            # None: no cap on requests in flight
    request_rate: float = math.inf                # Poisson arrivals per second; inf: all at once
    warmup_requests: int = 0
    seed: int = 0
    ignore_eos: bool = True
    min_tokens: bool = True                       # send min_tokens = max_tokens
    include_usage: bool = True                    # ask for stream_options.include_usage
    extra_body: str | None = None                 # JSON object merged into every request body
    tokenizer_model: str | None = None            # "default" or a path: count tokens locally
    server_tokenize: bool = True                  # else the one-token-per-word approximation
    timeout_s: float = 600.0                      # per request, start to end of stream
    allow_remote: bool = False
    progress: bool = True
    result_json: str | None = None
    workload: str = "random"                      # "random", "shared-prefix", "multi-turn"
    num_prefixes: int = 4                         # shared-prefix: distinct prefixes
    prefix_len: int = 1200                        # shared-prefix / multi-turn system prompt tokens
    num_turns: int = 8                            # multi-turn: turns per conversation (num_requests conversations)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat'; got {self.endpoint!r}")
        if self.workload not in bench_workloads.WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(bench_workloads.WORKLOADS)}; got {self.workload!r}")
        if self.workload == "multi-turn" and self.endpoint != "chat":
            raise ValueError("the multi-turn workload sends chat messages: use --endpoint chat")
        if self.workload != "random" and self.dataset is not None:
            raise ValueError("--dataset replaces the synthetic prompts of the random workload only")
        for name in ("num_prefixes", "num_turns"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if self.prefix_len < 0 or (self.workload == "shared-prefix" and self.prefix_len == 0):
            raise ValueError(f"prefix_len must be positive (>= 0 for multi-turn); got {self.prefix_len}")
        for name in ("input_len", "output_len", "num_requests", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1); got {self.range_ratio}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be positive; got {self.max_concurrency}")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be positive; got {self.request_rate}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0; got {self.warmup_requests}")
        host = urlsplit(self.base_url).hostname
        if not self.allow_remote and not is_loopback(host):
            raise ValueError(f"base_url host {host!r} is not loopback; pass --allow-remote to bench it")

    @property
    def route(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len_tokens: int | None = None   # usage.prompt_tokens, else the composed length
    output_tokens: int = 0                 # usage.completion_tokens, else text chunks
    output_tokens_from: str = "chunks"     # "usage" or "chunks"
    num_text_chunks: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    e2el_s: float | None = None
    finish_reason: str | None = None
    text_chars: int = 0
    text: str = ""                         # the reply (multi-turn sends it back next turn)
    cached_tokens: int | None = None       # usage.prompt_tokens_details.cached_tokens, when sent
    error: str | None = None


# ---------------------------------------------------------------- one streamed request


def request_body(cfg: BenchConfig, model: str | None, req: BenchRequest) -> dict:
    body: dict[str, Any] = {"max_tokens": req.output_len_tokens, "stream": True, "temperature": 0.0}
    if model is not None:
        body["model"] = model
    if req.messages is not None:
        body["messages"] = list(req.messages)
    elif cfg.endpoint == "completions":
        body["prompt"] = req.prompt
    else:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.min_tokens:
        body["min_tokens"] = req.output_len_tokens
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.extra_body:
        body.update(json.loads(cfg.extra_body))
    return body


def chunk_text(chunk: dict) -> tuple[str, str | None]:
    """(text, finish_reason) of a completions or chat chunk's first choice."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or "", choice.get("finish_reason")


def sse_payloads(line: str) -> str | None:
    """The data of one SSE line; None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


async def send_request(client: httpx.AsyncClient, cfg: BenchConfig, model: str | None,
                       req: BenchRequest) -> RequestResult:
    """Stream one request and time it; errors end up in the result, never raised."""
    result = RequestResult(prompt_len_tokens=req.prompt_len_tokens)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(cfg.timeout_s):
            await _stream_into(result, client, cfg.route, request_body(cfg, model, req), start)
    except TimeoutError:
        result.error = f"timeout after {cfg.timeout_s} s"
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a chunk that is not JSON
        result.error = f"{type(e).__name__}: {e}"
    result.e2el_s = time.perf_counter() - start
    result.success = result.error is None
    return result


async def _stream_into(result: RequestResult, client: httpx.AsyncClient, route: str, body: dict,
                       start: float) -> None:
    last_text_at = start
    saw_done = False
    async with client.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            raw = (await response.aread()).decode("utf-8", "replace")
            result.error = f"HTTP {response.status_code}: {_error_message(raw)}"
            return
        async for line in response.aiter_lines():
            data = sse_payloads(line)
            if data is None or not data:
                continue
            now = time.perf_counter()
            if data == "[DONE]":
                saw_done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict) or "error" in chunk:
                result.error = f"stream error: {_error_message(data)}"
                return
            text, finish = chunk_text(chunk)
            if text:
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last_text_at)
                last_text_at = now
                result.num_text_chunks += 1
                result.text_chars += len(text)
                result.text += text
            result.finish_reason = finish or result.finish_reason
            usage = chunk.get("usage")
            if usage:
                result.output_tokens_from = "usage"
                result.output_tokens = usage.get("completion_tokens", 0)
                result.prompt_len_tokens = usage.get("prompt_tokens", result.prompt_len_tokens)
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    result.cached_tokens = details["cached_tokens"]
    if result.output_tokens_from == "chunks":
        result.output_tokens = result.num_text_chunks
    if not saw_done:
        result.error = "stream ended without data: [DONE]"


def _error_message(raw: str) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return raw[:300]


# ---------------------------------------------------------------- a phase of many requests


async def run_phase(cfg: BenchConfig, model: str | None, requests: Sequence[BenchRequest], seed: int,
                    desc: str) -> tuple[list[RequestResult], float]:
    """Send every request under the concurrency cap and arrival process; (results, wall s)."""
    from tqdm import tqdm

    in_flight = cfg.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    # trust_env=False: a proxy from the environment must never see loopback traffic.
    timeout = httpx.Timeout(cfg.timeout_s)
    gate = asyncio.Semaphore(in_flight)
    rng = random.Random(seed)
    bar = tqdm(total=len(requests), desc=desc, disable=not cfg.progress, file=sys.stderr)

    async def one(client: httpx.AsyncClient, req: BenchRequest) -> RequestResult:
        async with gate:
            result = await send_request(client, cfg, model, req)
        bar.update(1)
        return result

    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout, trust_env=False) as client:
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(client, req)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))  # Poisson: exponential gaps
        results = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - start
    bar.close()
    return results, duration_s


# ---------------------------------------------------------------- CLI


def served_model(http: httpx.Client) -> str | None:
    try:
        return http.get("/v1/models").json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        return None


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Prompts, warm-up, the measured phase; prints the table, returns (and saves) the result."""
    with httpx.Client(base_url=cfg.base_url, timeout=60.0, trust_env=False) as http:
        model = cfg.model or served_model(http)
        counter = make_counter(http, cfg.tokenizer_model, cfg.server_tokenize)
        warmup, measured = _requests(cfg, counter)
        convs = []  # multi-turn: composed here, while the tokenizer's client is open
        if cfg.workload == "multi-turn":
            convs = bench_workloads.conversations(counter, cfg.num_requests, cfg.num_turns, cfg.prefix_len,
                                                  cfg.input_len, cfg.output_len, cfg.seed)
    if warmup:
        asyncio.run(run_phase(cfg, model, warmup, cfg.seed + 1, "warmup"))
    if convs:
        async def send(client: httpx.AsyncClient, req: BenchRequest) -> RequestResult:
            return await send_request(client, cfg, model, req)

        measured, results, duration_s = asyncio.run(bench_workloads.run_conversations(cfg, convs, send, cfg.label))
    else:
        results, duration_s = asyncio.run(run_phase(cfg, model, measured, cfg.seed, cfg.label))
    metrics = compute_metrics(measured, results, duration_s)
    metrics["workload_summary"] = bench_workloads.summarize(cfg.workload, measured, results)
    print(format_table(cfg, metrics))
    result = build_result(cfg, model, counter.source, measured, results, metrics)
    if cfg.result_json:
        Path(cfg.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.result_json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _requests(cfg: BenchConfig, counter: Any) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up, measured) requests; multi-turn builds its measured turns as it goes. The
    prefix workloads' warm-up requests get prefixes of their own (another seed), so they
    leave nothing in a cache that the measured requests could hit."""
    total = cfg.warmup_requests + cfg.num_requests
    if cfg.dataset is not None:
        rows = dataset_requests(cfg.dataset, counter)
        rows = (rows * math.ceil(total / len(rows)))[:total]
        return rows[:cfg.warmup_requests], rows[cfg.warmup_requests:]
    if cfg.workload == "random":
        rows = synthetic_requests(counter, total, cfg.input_len, cfg.output_len, cfg.range_ratio, cfg.seed)
        return rows[:cfg.warmup_requests], rows[cfg.warmup_requests:]
    warmup = synthetic_requests(counter, cfg.warmup_requests, cfg.input_len, cfg.output_len, 0.0, cfg.seed + 7919)
    if cfg.workload == "multi-turn":
        return warmup, []
    measured = bench_workloads.shared_prefix_requests(counter, cfg.num_requests, cfg.num_prefixes, cfg.prefix_len,
                                                      cfg.input_len, cfg.output_len, cfg.endpoint, cfg.seed)
    return warmup, measured


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(prog="python -m tools.bench.bench_serving", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8383", help="server root (a trailing /v1 is dropped)")
    p.add_argument("--label", default=None, help="server name in results and plots (default: the host:port)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model field sent (default: first id of /v1/models)")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random lengths in len*[1-r, 1+r]; 0 = fixed")
    p.add_argument("--dataset", default=None, help='JSONL of {"prompt": str, "output_len": int} lines')
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s (inf: all at once)")
    p.add_argument("--warmup-requests", type=int, default=0, help="sent first, not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--min-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="send min_tokens = max_tokens")
    p.add_argument("--include-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for stream_options.include_usage (token counts from usage)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--tokenizer-model", default=None, help='"default" or a .gguf/HF folder: count prompt tokens '
                   "locally with models.tokenizer (identical prompts for every server)")
    p.add_argument("--server-tokenize", action=argparse.BooleanOptionalAction, default=True,
                   help="use the server's tokenize route when there is no --tokenizer-model")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request, start to end of stream")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--result-json", default=None, help="write every metric and parameter here")
    p.add_argument("--workload", choices=bench_workloads.WORKLOADS, default="random",
                   help="random prompts, N shared prefixes + distinct questions, or multi-turn chats")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=1200,
                   help="shared-prefix: prefix tokens; multi-turn: system prompt tokens (0: none)")
    p.add_argument("--num-turns", type=int, default=8,
                   help="multi-turn: turns per conversation (--num-requests conversations)")
    a = p.parse_args(argv)
    base_url = a.base_url.rstrip("/").removesuffix("/v1")
    return BenchConfig(
        base_url=base_url, label=a.label or urlsplit(base_url).netloc, endpoint=a.endpoint, model=a.model,
        input_len=a.input_len, output_len=a.output_len, range_ratio=a.range_ratio, dataset=a.dataset,
        num_requests=a.num_requests, max_concurrency=a.max_concurrency, request_rate=a.request_rate,
        warmup_requests=a.warmup_requests, seed=a.seed, ignore_eos=a.ignore_eos, min_tokens=a.min_tokens,
        include_usage=a.include_usage, extra_body=a.extra_body, tokenizer_model=a.tokenizer_model,
        server_tokenize=a.server_tokenize, timeout_s=a.timeout, allow_remote=a.allow_remote,
        progress=not a.no_progress, result_json=a.result_json, workload=a.workload,
        num_prefixes=a.num_prefixes, prefix_len=a.prefix_len, num_turns=a.num_turns)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"bench_serving: {e}", file=sys.stderr)
        return 2
    result = run_benchmark(cfg)
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
