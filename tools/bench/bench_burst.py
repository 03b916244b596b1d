"""A burst of new prompts into a server that is busy decoding: how soon do they all start,
and what does the burst do to the rows already decoding?

    python -m tools.bench.bench_burst --base-url http://127.0.0.1:8383 --label ferrox \\
        --decode-rows 16 --burst 8 --prompt-len 512 --rounds 1 --result-json results/burst.json

One round, in order:
  1. `--decode-rows` streams start on short distinct prompts (greedy, `ignore_eos`, long
     `max_tokens`); the round waits until every one of them has streamed a few chunks.
  2. At t0, `--burst` requests with distinct `--prompt-len`-token prompts (token ids, so the
     lengths are exact on any server that takes token prompts; a fresh seed per round, so
     nothing is in a prefix cache) arrive at once, each asking for one token.
  3. Measured: each burst request's TTFT (t0 to its first chunk with a choice), the time
     until all of them have one, and every inter-chunk gap of the decoding streams between
     t0 and that moment.
  4. The decoding streams are closed (the server cancels them).

It is a tool, not a test; run it against two servers side by side, alternating rounds
(bench/unified_step/run.sh), since single runs on a shared CPU move by +-25 %.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from api.config import is_loopback


async def _stream(client: httpx.AsyncClient, url: str, body: dict, arrivals: list[float],
                  started: asyncio.Event | None = None, min_chunks: int = 0) -> None:
    """POSTs a streaming completion and records the arrival time of every chunk with a choice."""
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:]).get("choices"):
                arrivals.append(time.perf_counter())
                if started is not None and len(arrivals) >= min_chunks:
                    started.set()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run_round(base_url: str, model: str, *, decode_rows: int, burst: int, prompt_len: int,
                    vocab_low: int, vocab_high: int, seed: int, timeout_s: float) -> dict:
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=decode_rows + burst + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        decode_arrivals: list[list[float]] = [[] for _ in range(decode_rows)]
        started = [asyncio.Event() for _ in range(decode_rows)]
        decoders = []
        for i in range(decode_rows):
            prompt = [rng.randrange(vocab_low, vocab_high) for _ in range(16)]
            # Long enough to outlast the burst; small enough that every row is admitted at once
            # (admission reserves prompt + max_tokens of KV blocks).
            body = {"model": model, "prompt": prompt, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            decoders.append(asyncio.create_task(_stream(client, url, body, decode_arrivals[i], started[i],
                                                        min_chunks=3)))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout_s)
        t0 = time.perf_counter()
        burst_arrivals: list[list[float]] = [[] for _ in range(burst)]
        bodies = [{"model": model, "prompt": [rng.randrange(vocab_low, vocab_high) for _ in range(prompt_len)],
                   "max_tokens": 1, "temperature": 0, "stream": True} for _ in range(burst)]
        await asyncio.wait_for(asyncio.gather(*(_stream(client, url, body, burst_arrivals[i])
                                                for i, body in enumerate(bodies))), timeout_s)
        ttfts = [arrivals[0] - t0 for arrivals in burst_arrivals]
        t_all = t0 + max(ttfts)
        gaps = []
        for arrivals in decode_arrivals:
            inside = [t for t in arrivals if t0 <= t <= t_all]
            before = [t for t in arrivals if t < t0]
            points = ([before[-1]] if before else []) + inside
            gaps += [b - a for a, b in zip(points, points[1:])]
        for task in decoders:
            task.cancel()
        await asyncio.gather(*decoders, return_exceptions=True)
    return {"seed": seed, "all_first_tokens_s": max(ttfts), "ttft_p50_s": statistics.median(ttfts),
            "ttfts_s": ttfts, "decode_gap_p50_ms": _percentile(gaps, 50) * 1e3,
            "decode_gap_p99_ms": _percentile(gaps, 99) * 1e3, "num_decode_gaps": len(gaps)}


async def _model_id(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8383")
    parser.add_argument("--label", default="server")
    parser.add_argument("--decode-rows", type=int, default=16)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="round r uses seed + r: fresh prompts every round")
    parser.add_argument("--vocab-range", default="1000,40000", help="token ids drawn from this range")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    host = urlsplit(args.base_url).hostname
    if not is_loopback(host):
        raise SystemExit(f"--base-url must be a loopback address; got {host!r}")
    low, high = (int(x) for x in args.vocab_range.split(","))
    model = asyncio.run(_model_id(args.base_url))
    rounds = [asyncio.run(run_round(args.base_url, model, decode_rows=args.decode_rows, burst=args.burst,
                                    prompt_len=args.prompt_len, vocab_low=low, vocab_high=high,
                                    seed=args.seed + r, timeout_s=args.timeout_s))
              for r in range(args.rounds)]
    for r in rounds:
        print(f"{args.label}: all first tokens {r['all_first_tokens_s']:.2f} s, TTFT p50 {r['ttft_p50_s']:.2f} s, "
              f"decode gap p50 {r['decode_gap_p50_ms']:.0f} ms / p99 {r['decode_gap_p99_ms']:.0f} ms "
              f"({r['num_decode_gaps']} gaps)")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({"label": args.label, "base_url": args.base_url,
                                                "decode_rows": args.decode_rows, "burst": args.burst,
                                                "prompt_len": args.prompt_len, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
