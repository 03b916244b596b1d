"""An urgent request's time to first token on a server full of long low-priority streams,
against the same request on the idle server (`--scheduling-policy priority`).

    ferrox serve --scheduling-policy priority --max-seqs 32 --port 8391 &
    python -m tools.bench.bench_priority --base-url http://127.0.0.1:8391 --busy 32 --pairs 5 \\
        --result-json results/priority.json

Rounds alternate, idle then busy, `--pairs` times (a shared CPU moves single runs by
+-25 %, so both kinds sample the same stretch of load):

  * idle: the urgent request (priority -1, a fresh `--prompt-len`-token prompt of token
    ids, so nothing is in the prefix cache; greedy, streamed, `--urgent-tokens` tokens)
    arrives at an idle server; its TTFT is the time to its first chunk with a choice.
  * busy: `--busy` streams of priority 10 start (short distinct prompts, greedy,
    `ignore_eos`, `--busy-tokens` each: long enough to outlast the round) and the round
    waits until every one has streamed 3 chunks, so all of the server's rows are decoding;
    then the same kind of urgent request arrives and its TTFT is taken the same way. The
    server preempts a low-priority stream for it (the round reports the preemptions from
    /admin/stats). The busy streams are then closed (the server cancels them) and the
    round waits for the server to be idle again.

It is a tool, not a test. `--same-level` sends the busy round's urgent request at priority
10 too: nothing is preempted and it waits for a row (what fcfs would do), for comparison.
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

from api.config import is_loopback
from tools.bench.bench_burst import _model_id, _stream


async def _urgent_ttft(client: httpx.AsyncClient, url: str, body: dict) -> float:
    arrivals: list[float] = []
    t0 = time.perf_counter()
    await _stream(client, url, body, arrivals)
    return arrivals[0] - t0


async def _stats(client: httpx.AsyncClient, base_url: str) -> dict:
    response = await client.get(base_url.rstrip("/") + "/admin/stats")
    response.raise_for_status()
    return response.json()


async def run_round(base_url: str, model: str, *, busy: int, prompt_len: int, busy_tokens: int, urgent_tokens: int,
                    urgent_priority: int, vocab: tuple[int, int], seed: int, timeout_s: float) -> dict:
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    urgent = {"model": model, "prompt": [rng.randrange(*vocab) for _ in range(prompt_len)],
              "max_tokens": urgent_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
              "priority": urgent_priority}
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=busy + 8)) as client:
        before = (await _stats(client, base_url)).get("num_preemptions", 0)
        started = [asyncio.Event() for _ in range(busy)]
        streams = [asyncio.create_task(_stream(
            client, url, {"model": model, "prompt": [rng.randrange(*vocab) for _ in range(16)],
                          "max_tokens": busy_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                          "priority": 10}, [], started[i], min_chunks=3)) for i in range(busy)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout_s)
        ttft = await asyncio.wait_for(_urgent_ttft(client, url, urgent), timeout_s)
        still_running = sum(not task.done() for task in streams)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        after = await _stats(client, base_url)
        deadline = time.monotonic() + timeout_s
        while after["running_rows"] or after["queue_depth"]:  # the cancels land within a tick or two
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not go idle after the busy streams were closed")
            await asyncio.sleep(0.1)
            after = await _stats(client, base_url)
    return {"kind": "busy" if busy else "idle", "seed": seed, "ttft_s": ttft,
            "preemptions": after.get("num_preemptions", 0) - before, "busy_streams_running_after": still_running}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8383")
    parser.add_argument("--busy", type=int, default=32, help="low-priority streams running in a busy round")
    parser.add_argument("--busy-tokens", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=64, help="the urgent request's prompt, in tokens")
    parser.add_argument("--urgent-tokens", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5, help="idle and busy rounds, alternating")
    parser.add_argument("--same-level", action="store_true", help="busy rounds' urgent request at priority 10")
    parser.add_argument("--seed", type=int, default=0, help="round r uses seed + r: fresh prompts every round")
    parser.add_argument("--vocab-range", default="1000,40000", help="token ids drawn from this range")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    host = urlsplit(args.base_url).hostname
    if not is_loopback(host):
        raise SystemExit(f"--base-url must be a loopback address; got {host!r}")
    vocab = tuple(int(x) for x in args.vocab_range.split(","))
    model = asyncio.run(_model_id(args.base_url))
    rounds = []
    for r in range(2 * args.pairs):
        busy = args.busy if r % 2 else 0
        rounds.append(asyncio.run(run_round(
            args.base_url, model, busy=busy, prompt_len=args.prompt_len, busy_tokens=args.busy_tokens,
            urgent_tokens=args.urgent_tokens, urgent_priority=10 if busy and args.same_level else -1,
            vocab=vocab, seed=args.seed + r, timeout_s=args.timeout_s)))
        print(json.dumps(rounds[-1]))
    summary = {}
    for kind in ("idle", "busy"):
        ttfts = [r["ttft_s"] for r in rounds if r["kind"] == kind]
        summary[kind] = {"best_s": min(ttfts), "median_s": statistics.median(ttfts), "worst_s": max(ttfts)}
    summary["busy_over_idle_best"] = summary["busy"]["best_s"] / summary["idle"]["best_s"]
    summary["busy_over_idle_median"] = summary["busy"]["median_s"] / summary["idle"]["median_s"]
    ratios = [b["ttft_s"] / a["ttft_s"] for a, b in zip(rounds[::2], rounds[1::2])]
    summary["pair_ratios"] = ratios
    print(json.dumps(summary, indent=1))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({"args": vars(args) | {"result_json": str(args.result_json)},
                                                "rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
