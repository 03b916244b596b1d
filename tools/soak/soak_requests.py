"""How the soak sends one request of each kind, and how it judges the answer.

Each function sends one request on the soak's shared client and returns its outcome key:
the status as text ("200", "400"), or a name for what went wrong ("5xx-stream-error",
"200-no-done", "200-empty:choices", "400-no-envelope", "recheck-mismatch", "recheck-near-tie",
"cancelled").
tools/soak/soak.py counts the keys by kind and protocol and decides from them whether the run
passed.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from tools.soak import soak_hostile, soak_mix


async def read_events(response: httpx.Response, stop_after: int | None = None) -> tuple[list, bool]:
    """(event name or None, data) pairs of an SSE body; True when we left after `stop_after` data events."""
    events: list[tuple[str | None, str]] = []
    name = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line[7:].strip()
        elif line.startswith("data: "):
            events.append((name, line[6:]))
            name = None
            if stop_after is not None and len(events) >= stop_after:
                return events, True
    return events, False


async def full(client: httpx.AsyncClient, call: soak_mix.Call) -> str:
    """Serve one request in full; returns the outcome key ("200", "5xx-stream-error", ...)."""
    if not call.stream:
        r = await client.post(call.path, json=call.body)
        if r.status_code == 200 and (missing := incomplete(call.protocol, r.json())):
            return f"200-empty:{missing}"
        return str(r.status_code)
    async with client.stream("POST", call.path, json=call.body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        events, _ = await read_events(r)
    return soak_mix.stream_verdict(call.protocol, events)


def incomplete(protocol: str, body: Any) -> str | None:
    """What a non-streamed 200 lacks to be a whole reply of its protocol (its end marker, as
    `soak_mix.stream_verdict` asks of a stream), or None. An empty `content` / `output` list
    is whole: a reply whose turn ends at once, or whose text all went to a parser that found
    nothing, has no blocks (Anthropic documents `content: []` with `end_turn`)."""
    if not isinstance(body, dict):
        return "body"
    if protocol in ("completions", "chat"):
        choices = body.get("choices")
        return None if choices and all(c.get("finish_reason") for c in choices) else "choices"
    if protocol == "responses":
        return None if isinstance(body.get("output"), list) and body.get("status") in ("completed", "incomplete") \
            else "output"
    if protocol == "messages":
        return None if isinstance(body.get("content"), list) and body.get("stop_reason") else "content"
    if protocol == "embeddings":
        return None if body.get("data") else "data"
    return None if "content" in body else "content"  # llama.cpp


async def cancelled(client: httpx.AsyncClient, call: soak_mix.Call, rng: random.Random) -> str:
    """Start a request and close the connection mid-flight."""
    if call.stream:
        async with client.stream("POST", call.path, json=call.body) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            events, left = await read_events(r, stop_after=rng.randint(1, 3))
        if left:
            return "cancelled"  # leaving the block closed the connection
        return soak_mix.stream_verdict(call.protocol, events)  # finished before we could leave
    try:
        r = await asyncio.wait_for(client.post(call.path, json=call.body), rng.uniform(0.01, 0.3))
    except TimeoutError:
        return "cancelled"
    return str(r.status_code)


async def malformed(client: httpx.AsyncClient, call: soak_mix.Call, raw: bytes) -> str:
    r = await client.post(call.path, content=raw, headers={"Content-Type": "application/json"})
    if 400 <= r.status_code < 500:
        try:
            body = r.json()
        except ValueError:
            body = None
        if not soak_mix.in_envelope(call.envelope, body):
            return f"{r.status_code}-no-envelope"
    return str(r.status_code)


NEAR_TIE_NATS = 0.02  # a greedy pick this close to the runner-up may flip with the step's batch


async def recheck(client: httpx.AsyncClient, rng: random.Random, model: str, prefixes: list[str],
                  mismatches: list[dict] | None = None) -> str:
    """Greedy text over a shared prefix: read from the prefix cache vs computed cold.

    The two may differ where greedy decoding meets a near tie: on the CPU the block kernels
    take a 16-bit activation path from 16 rows a step, so a token's logits move by ~1e-3
    with what else the step holds. A difference is judged at its first token: when the
    two picks are both among the top 5 there and their log-probabilities are within
    NEAR_TIE_NATS, it is "recheck-near-tie" (counted, not a failure); otherwise
    "recheck-mismatch". Details of each go to `mismatches`."""
    text = f"{rng.choice(prefixes)} {' '.join(rng.choice(soak_mix.WORDS) for _ in range(rng.randint(1, 8)))}"
    body = {"model": model, "prompt": text, "n_predict": 8, "temperature": 0.0, "ignore_eos": True,
            "return_tokens": True}
    replies = []
    for cache in (True, True, False):
        r = await client.post("/completion", json={**body, "cache_prompt": cache})
        if r.status_code != 200:
            return str(r.status_code)
        replies.append(r.json())
    cached, cold = replies[1], replies[2]
    if cached["tokens"] != cold["tokens"]:
        detail = await _divergence(client, model, text, cached["tokens"], cold["tokens"])
        detail.update(prompt=text, cached=cached["content"], cold=cold["content"],
                      tokens_cached=cached.get("tokens_cached"))
        if mismatches is not None:
            mismatches.append(detail)
        gap = detail.get("gap_nats")
        return "recheck-near-tie" if gap is not None and gap <= NEAR_TIE_NATS else "recheck-mismatch"
    return "200-cached" if cached.get("tokens_cached") else "200"


async def _divergence(client: httpx.AsyncClient, model: str, text: str, a: list[int], b: list[int]) -> dict:
    """Where greedy outputs `a` and `b` of `text` part, and the log-probability gap there
    between their two picks (None when either is not among the top 5)."""
    j = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
    out: dict[str, Any] = {"position": j, "gap_nats": None}
    if j >= min(len(a), len(b)):
        return out
    r = await client.post("/tokenize", json={"model": model, "prompt": text})
    if r.status_code != 200:
        return out
    prompt_ids = r.json()["tokens"] + a[:j]
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt_ids, "max_tokens": 1,
                                                    "temperature": 0.0, "logprobs": 5})
    if r.status_code != 200:
        return out
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    picks = []
    for token in (a[j], b[j]):
        d = await client.post("/detokenize", json={"model": model, "tokens": [token]})
        picks.append(d.json().get("prompt") if d.status_code == 200 else None)
    out["picks"], out["top5"] = picks, top
    if picks[0] != picks[1] and all(p in top for p in picks):
        out["gap_nats"] = round(abs(top[picks[0]] - top[picks[1]]), 5)
    return out


async def hostile(client: httpx.AsyncClient, call: soak_hostile.HostileCall) -> str:
    """A hostile request: "4xx" when refused in its route's envelope, "2xx-allowed" when one
    that may be served was; anything else (a 2xx it must not get, a 5xx, no envelope) by status."""
    r = await client.request(call.method, call.path, content=call.content, headers=call.headers)
    if 400 <= r.status_code < 500:
        try:
            body = r.json()
        except ValueError:
            body = None
        return "4xx" if soak_mix.in_envelope(call.envelope, body) else f"{r.status_code}-no-envelope"
    if r.status_code < 300 and call.may_succeed:
        return "2xx-allowed"
    return str(r.status_code)
