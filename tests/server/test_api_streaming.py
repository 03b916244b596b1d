"""Streaming and cancellation end to end: SSE framing, incremental deltas, usage chunks,
/v1/cancel, client disconnects (streaming and not) returning every KV block, and 32
concurrent streams. Real Hypercorn server, real engine on a tiny Llama."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import CONTEXT_TOKENS, ServerThread, parse_sse, tiny_engine, wait_for

# ~2-4 s of decoding: outlasts anything a test does mid-stream; cancelled long before the end
LONG = dict(prompt="Hello world", max_tokens=CONTEXT_TOKENS - 16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def stats(http) -> dict:
    return http.get("/admin/stats").json()


def all_blocks_free(http) -> bool:
    s = stats(http)
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["generating_now"] == 0


def test_sse_framing(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0,
                                           "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.text.endswith("data: [DONE]\n\n")
    for block in r.text.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, f"one data line per event: {block!r}"
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    ids = {e["id"] for e in events[:-1]}
    assert len(ids) == 1 and all(e["request_id"] == e["id"] for e in events[:-1])
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_stream_text_equals_the_whole_text(http):
    body = {"prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    events = parse_sse(http.post("/v1/completions", json={**body, "stream": True}).text)[:-1]
    assert len(events) > 2, "streamed incrementally, not in one piece"
    assert "".join(e["choices"][0]["text"] for e in events) == whole


def test_one_finish_reason_per_choice_and_usage_only_when_asked(http):
    body = {"prompt": ["Hello", "Numbers: 1 2"], "n": 3, "max_tokens": 6, "temperature": 0.9, "seed": 4,
            "ignore_eos": True, "stream": True}
    events = parse_sse(http.post("/v1/completions", json=body).text)[:-1]
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert sorted(finishes) == list(range(6)), "2 prompts x n=3: each choice finishes exactly once"
    assert not any("usage" in e for e in events)
    events = parse_sse(http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}}).text)
    assert events[-1] == "[DONE]"
    usage = [e for e in events[:-1] if "usage" in e]
    assert len(usage) == 1 and usage[0] is events[-2] and usage[0]["choices"] == []
    assert usage[0]["usage"]["completion_tokens"] == 6 * 6


def test_openai_client_streaming(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=5,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_echo_streams_the_prompt_first(http):
    events = parse_sse(http.post("/v1/completions", json={
        "prompt": "Hello world", "max_tokens": 3, "temperature": 0, "echo": True, "stream": True}).text)
    assert events[0]["choices"][0]["text"] == "Hello world"


def test_cancel_endpoint_ends_the_stream_with_cancelled(http, server):
    before = stats(http)["aborted"]
    with httpx.Client(base_url=server, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            request_id = httpx.Response(200, content=first[6:]).json()["request_id"]
            c = http.post("/v1/cancel", json={"request_id": request_id})
            assert c.status_code == 200 and c.json() == {"request_id": request_id, "cancelled": True}
            rest = parse_sse("\n\n".join(lines) + "\n\n")
    assert rest[-1] == "[DONE]"
    reasons = [ch["finish_reason"] for e in rest[:-1] for ch in e["choices"] if ch["finish_reason"]]
    assert reasons == ["cancelled"]
    wait_for(lambda: stats(http)["aborted"] == before + 1)
    wait_for(lambda: all_blocks_free(http))
    again = http.post("/v1/cancel", json={"request_id": request_id})
    assert again.status_code == 404 and again.json()["cancelled"] is False
    assert again.json()["error"]["param"] == "request_id"


def test_stream_disconnect_cancels_and_frees_blocks(http, server):
    before = stats(http)["aborted"]
    with httpx.Client(base_url=server, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would already close the connection
            next(line for line in lines if line.startswith("data: "))
            assert stats(http)["kv_blocks_free"] < stats(http)["kv_blocks_total"], "the row holds blocks"
        # leaving the block closes the connection mid-stream
    wait_for(lambda: stats(http)["aborted"] == before + 1)
    wait_for(lambda: all_blocks_free(http))
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_non_streaming_disconnect_cancels_and_frees_blocks(http, server):
    before = stats(http)["aborted"]
    errors = []

    def impatient() -> None:
        try:
            httpx.post(server + "/v1/completions", json=LONG, timeout=0.1)
        except httpx.TimeoutException as e:  # the client gives up and closes the connection
            errors.append(e)

    thread = threading.Thread(target=impatient)
    thread.start()
    thread.join(10)
    assert errors, "the request should outlive the client's 0.1 s timeout"
    wait_for(lambda: stats(http)["aborted"] == before + 1)
    wait_for(lambda: all_blocks_free(http))
    recent = stats(http)["recent"][-1]
    assert recent["status"] == 499 and recent["stream"] is False


def test_32_concurrent_streams(server, http):
    """32 streams open at once: each reads its first chunk, then all wait at a barrier, so
    every connection is mid-stream at the same moment before any reads further."""
    barrier = asyncio.Barrier(32)
    body = {"max_tokens": 48, "temperature": 0.8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int]:
        async with client.stream("POST", "/v1/completions",
                                 json={**body, "prompt": f"Hello {i}", "seed": i}) as r:
            data = _aiter_data(r.aiter_lines())
            head = [await anext(data)]
            await barrier.wait()
            rest = [line async for line in data]
        events = parse_sse("\n\n".join(head + rest) + "\n\n")
        assert events[-1] == "[DONE]"
        text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
        return text, events[-2]["usage"]["completion_tokens"]

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 120)

    results = asyncio.run(main())
    assert [tokens for _, tokens in results] == [48] * 32
    # Seeded rows sample the same alone or batched (the batcher's contract): re-run two alone.
    for i in (0, 31):
        alone = http.post("/v1/completions", json={**body, "stream": False, "stream_options": None,
                                                   "prompt": f"Hello {i}", "seed": i}).json()
        assert alone["choices"][0]["text"] == results[i][0]
    wait_for(lambda: all_blocks_free(http))


async def _aiter_data(lines):
    async for line in lines:
        if line.startswith("data: "):
            yield line
