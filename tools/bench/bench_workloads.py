"""Prefix-sharing workloads for tools/bench/bench_serving.py, and the TTFT summaries they are judged by.

`random` (bench_serving's default) sends unrelated prompts. The two workloads here send
prompts that share prefixes, the traffic prefix caching is for:

- `shared-prefix`: `num_prefixes` distinct prefixes of `prefix_len` tokens (a system
  prompt, tool definitions, a document), each request one of them followed by a distinct
  question of `input_len` tokens. Request i uses prefix i mod num_prefixes, so the first
  `num_prefixes` requests are the *cold* ones and every later one follows a request that
  sent its prefix before (*warm*). Completions send `prefix + "\\n" + question` as the
  prompt; chat sends the prefix as the system message and the question as the user's.
- `multi-turn`: `num_requests` conversations of `num_turns` turns each (chat only): an
  optional system prompt of `prefix_len` tokens, then per turn a user message of
  `input_len` tokens; every turn resends the whole conversation so far, the server's own
  replies included. Conversations run concurrently (at most `max_concurrency`), the turns
  of one conversation one after the other.

Summaries (added to the result JSON as `workload_summary`): for shared-prefix, TTFT of the
cold and warm requests; for multi-turn, TTFT by turn, so turn 8 can be compared with turn 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import time
from typing import Any, Awaitable, Callable, Sequence

import httpx
import numpy as np

from tools.bench.bench_prompts import BenchRequest, TokenCounter, synthetic_requests

WORKLOADS = ("random", "shared-prefix", "multi-turn")
# Seed offsets per kind of text: with the same --seed, a random-workload prompt, a prefix, a
# question and a system prompt must not start alike, or one run's prompts would hit the
# cache another run of the same session left behind.
_PREFIX_SEED, _QUESTION_SEED, _SYSTEM_SEED, _TURN_SEED = 1_000_003, 2_000_003, 3_000_017, 4_000_037


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One multi-turn conversation: its system prompt (maybe empty) and user messages."""

    index: int
    system: str
    user_turns: tuple[str, ...]
    output_len_tokens: int

    def messages(self, turn: int, replies: Sequence[str]) -> tuple[dict, ...]:
        """The whole conversation up to `turn`'s user message, `replies` the earlier answers."""
        out: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        for user, reply in zip(self.user_turns[:turn], replies):
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        out.append({"role": "user", "content": self.user_turns[turn]})
        return tuple(out)


def _texts(counter: TokenCounter, num: int, num_tokens: int, seed: int) -> list[tuple[str, int | None]]:
    return [(r.prompt, r.prompt_len_tokens) for r in synthetic_requests(counter, num, num_tokens, 1, 0.0, seed)]


def shared_prefix_requests(counter: TokenCounter, num: int, num_prefixes: int, prefix_len: int, input_len: int,
                           output_len: int, endpoint: str, seed: int) -> list[BenchRequest]:
    """`num` requests, request i = prefix (i mod num_prefixes) + a question of its own."""
    prefixes = _texts(counter, num_prefixes, prefix_len, seed + _PREFIX_SEED)
    questions = _texts(counter, num, input_len, seed + _QUESTION_SEED)
    requests = []
    for i, (question, _) in enumerate(questions):
        prefix, _ = prefixes[i % num_prefixes]
        if endpoint == "chat":
            messages = ({"role": "system", "content": prefix}, {"role": "user", "content": question})
            requests.append(BenchRequest("", None, output_len, messages=messages, group=i % num_prefixes,
                                         turn=int(i >= num_prefixes)))
        else:
            prompt = prefix + "\n" + question
            count = counter.count(prompt) if counter.is_exact else None
            requests.append(BenchRequest(prompt, count, output_len, group=i % num_prefixes,
                                         turn=int(i >= num_prefixes)))
    return requests


def conversations(counter: TokenCounter, num: int, num_turns: int, prefix_len: int, input_len: int,
                  output_len: int, seed: int) -> list[Conversation]:
    """`num` conversations of `num_turns` user messages, each with its own system prompt."""
    rng = random.Random(seed + _TURN_SEED)
    systems = _texts(counter, num, prefix_len, seed + _SYSTEM_SEED) if prefix_len else [("", 0)] * num
    out = []
    for index in range(num):
        turns = _texts(counter, num_turns, input_len, rng.randrange(1 << 30))
        out.append(Conversation(index, systems[index][0], tuple(t for t, _ in turns), output_len))
    return out


async def run_conversations(cfg: Any, convs: Sequence[Conversation],
                            send: Callable[[httpx.AsyncClient, BenchRequest], Awaitable[Any]],
                            desc: str) -> tuple[list[BenchRequest], list[Any], float]:
    """Multi-turn: each conversation sends its turns in order, every turn the whole
    conversation so far (its replies from `send`'s results); at most `cfg.max_concurrency`
    conversations at once. Returns the requests as sent and their results, conversation by
    conversation, and the wall time."""
    from tqdm import tqdm

    in_flight = cfg.max_concurrency or len(convs)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    gate = asyncio.Semaphore(in_flight)
    bar = tqdm(total=sum(len(c.user_turns) for c in convs), desc=desc, disable=not cfg.progress, file=sys.stderr)

    async def one(client: httpx.AsyncClient, conv: Conversation) -> list[tuple[BenchRequest, Any]]:
        sent = []
        async with gate:
            replies: list[str] = []
            for turn in range(len(conv.user_turns)):
                req = BenchRequest("", None, conv.output_len_tokens, messages=conv.messages(turn, replies),
                                   group=conv.index, turn=turn)
                result = await send(client, req)
                sent.append((req, result))
                replies.append(result.text)
                bar.update(1)
        return sent

    # trust_env=False: a proxy from the environment must never see loopback traffic.
    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=httpx.Timeout(cfg.timeout_s),
                                 trust_env=False) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, conv) for conv in convs))
        duration_s = time.perf_counter() - start
    bar.close()
    pairs = [pair for sent in done for pair in sent]
    return [q for q, _ in pairs], [r for _, r in pairs], duration_s


def _ttft_stats(ttfts_s: Sequence[float]) -> dict[str, float | None]:
    if not ttfts_s:
        return {"n": 0, "mean_ms": None, "median_ms": None, "p90_ms": None}
    ms = np.asarray(ttfts_s, dtype=np.float64) * 1e3
    return {"n": len(ms), "mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)),
            "p90_ms": float(np.percentile(ms, 90))}


def summarize(workload: str, requests: Sequence[BenchRequest], results: Sequence[Any]) -> dict[str, Any] | None:
    """TTFT of cold vs warm requests (shared-prefix) or by turn (multi-turn); None for random."""
    ok = [(q, r) for q, r in zip(requests, results) if r.success and r.ttft_s is not None]
    if workload == "shared-prefix":
        return {"cold_ttft": _ttft_stats([r.ttft_s for q, r in ok if q.turn == 0]),
                "warm_ttft": _ttft_stats([r.ttft_s for q, r in ok if q.turn > 0])}
    if workload == "multi-turn":
        num_turns = max((q.turn for q in requests), default=-1) + 1
        return {"ttft_by_turn": [_ttft_stats([r.ttft_s for q, r in ok if q.turn == t]) for t in range(num_turns)]}
    return None


def format_summary(summary: dict[str, Any] | None) -> list[str]:
    """Table lines for bench_serving's report."""
    if summary is None:
        return []

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = ["{:-^60}".format("TTFT by workload phase"), f"{'':<30}{'n':>6}{'median ms':>12}{'p90 ms':>12}"]
    if "cold_ttft" in summary:
        rows = [("Cold requests (first use)", summary["cold_ttft"]), ("Warm requests", summary["warm_ttft"])]
    else:
        rows = [(f"Turn {turn}", s) for turn, s in enumerate(summary["ttft_by_turn"], 1)]
    for name, s in rows:
        lines.append(f"{name:<30}{s['n']:>6}{ms(s['median_ms']):>12}{ms(s['p90_ms']):>12}")
    return lines
