"""Prefix caching through the OpenAI routes: `usage.prompt_tokens_details.cached_tokens`
(whole and streamed), the Prometheus counters and `/admin/stats`. Real Hypercorn server,
real engine on a tiny Llama (16-position blocks)."""

from __future__ import annotations

import random

import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, parse_sse, tiny_engine

BLOCK = 16  # the harness engine's block size


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def fresh_ids(n, seed):
    """Token ids no other test sends (the harness engine, and its cache, are shared)."""
    return random.Random(seed).sample(range(10, 380), n)


def metric(http, name):
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"/metrics lacks {name}")


def complete(http, **body):
    r = http.post("/v1/completions", json={"temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_second_identical_prompt_reports_its_cached_tokens(http):
    prompt = fresh_ids(50, seed=1)  # 3 full blocks of 16 + 2 tokens
    hits_before = metric(http, "ferrox_prefix_cache_hits_total")
    queries_before = metric(http, "ferrox_prefix_cache_queries_total")
    first = complete(http, prompt=prompt, max_tokens=6)
    second = complete(http, prompt=prompt, max_tokens=6)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 * BLOCK}
    assert second["usage"]["prompt_tokens"] == 50, "prompt_tokens counts the whole prompt, cached or not"
    assert second["choices"][0]["text"] == first["choices"][0]["text"], "greedy text is the same after a hit"
    assert metric(http, "ferrox_prefix_cache_hits_total") - hits_before == 3 * BLOCK
    assert metric(http, "ferrox_prefix_cache_queries_total") - queries_before == 2 * 50
    recent = http.get("/admin/stats").json()["recent"][-1]
    assert recent["id"] == second["id"] and recent["cached_tokens"] == 3 * BLOCK


def test_streamed_usage_carries_cached_tokens(http):
    prompt = fresh_ids(40, seed=2)  # 2 full blocks + 8
    complete(http, prompt=prompt, max_tokens=2)
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                           "stream": True, "stream_options": {"include_usage": True}})
    usage = [e["usage"] for e in parse_sse(r.text)[:-1] if e.get("usage")]
    assert usage == [{"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
                      "prompt_tokens_details": {"cached_tokens": 2 * BLOCK}}]


def test_chat_turns_share_the_system_prompt(http, client, model):
    system = {"role": "system", "content": " ".join(f"rule{i}" for i in range(60))}
    turns = [[system, {"role": "user", "content": question}] for question in ("Hello there", "What now?")]
    rendered = [http.post("/v1/tokenize", json={"messages": t}).json()["tokens"] for t in turns]
    shared = next(i for i, (a, b) in enumerate(zip(*rendered)) if a != b)
    replies = [client.chat.completions.create(model=model, messages=t, max_tokens=3, temperature=0)
               for t in turns]
    assert replies[1].usage.prompt_tokens_details.cached_tokens == shared // BLOCK * BLOCK, (
        "the full blocks of the shared system prompt come from the cache")
    stream = client.chat.completions.create(model=model, messages=turns[1], max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    num_prompt = len(rendered[1])
    assert usage[0].prompt_tokens_details.cached_tokens == (num_prompt - 1) // BLOCK * BLOCK, (
        "the same turn again: every block before the one holding the last prompt token hits")


def test_every_wire_reports_the_cached_tokens_v1_requests_records(http, server):
    import anthropic
    import openai

    words = random.Random(7).choices(["paged", "block", "cache", "fox", "dog", "quick", "lazy", "world"], k=60)
    messages = [{"role": "user", "content": " ".join(words)}]
    ids = http.post("/v1/tokenize", json={"messages": messages}).json()["tokens"]
    expected = (len(ids) - 1) // BLOCK * BLOCK  # full blocks before the last prompt token, which is computed
    assert expected >= 2 * BLOCK
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})  # fills the cache
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    model = http.get("/v1/models").json()["data"][0]["id"]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    response = client.responses.create(model=model, input=messages[0]["content"], max_output_tokens=2)
    message = claude.messages.create(model=model, max_tokens=2, messages=messages)
    with claude.messages.stream(model=model, max_tokens=2, messages=messages) as stream:
        streamed = stream.get_final_message()
    llama = http.post("/completion", json={"prompt": ids, "n_predict": 2})
    reported = {
        chat.id: chat.usage.prompt_tokens_details.cached_tokens,
        response.id: response.usage.input_tokens_details.cached_tokens,
        message.id: message.usage.cache_read_input_tokens,
        streamed.id: streamed.usage.cache_read_input_tokens,
        llama.headers["x-request-id"]: llama.json()["tokens_cached"],
    }
    assert set(reported.values()) == {expected}, reported
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)
    assert streamed.usage.input_tokens == message.usage.input_tokens, "the stream's final usage is the whole's"
    records = {r["id"]: r["cached_tokens"] for r in http.get("/v1/requests", params={"limit": 200}).json()["data"]}
    assert {rid: records.get(rid) for rid in reported} == reported, "/v1/requests records the same counts"
