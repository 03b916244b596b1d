"""How the soak sends one request of each kind, and how it judges the answer.

Each function sends one request on the soak's shared client and returns its outcome key:
the status as text ("200", "400"), or a name for what went wrong ("5xx-stream-error",
"200-no-done", "200-empty:choices", "400-no-envelope", "recheck-mismatch", "cancelled").
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


async def recheck(client: httpx.AsyncClient, rng: random.Random, model: str, prefixes: list[str]) -> str:
    """Greedy text over a shared prefix: read from the prefix cache vs computed cold."""
    text = f"{rng.choice(prefixes)} {' '.join(rng.choice(soak_mix.WORDS) for _ in range(rng.randint(1, 8)))}"
    body = {"model": model, "prompt": text, "n_predict": 8, "temperature": 0.0, "ignore_eos": True}
    replies = []
    for cache in (True, True, False):
        r = await client.post("/completion", json={**body, "cache_prompt": cache})
        if r.status_code != 200:
            return str(r.status_code)
        replies.append(r.json())
    cached, cold = replies[1], replies[2]
    if cached["content"] != cold["content"]:
        return "recheck-mismatch"
    return "200-cached" if cached.get("tokens_cached") else "200"


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
