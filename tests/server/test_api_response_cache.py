"""The whole-response cache (`--response-cache`) over a real server and the official
clients: greedy and seeded repeats are hits that reach no engine, a hit streams the same
events as its miss, sampled requests are skips, the bounds evict the least recently used,
an unload clears it, `/metrics` and `/cache/stats` count it, and its byte count is what
its entries really take (tracemalloc). One server for the module, over the shared tiny
engine (no engine of its own)."""

from __future__ import annotations

import gc
import json
import tracemalloc

import anthropic
import openai
import pytest

from api.app import create_app
from api.config import ServerConfig
from api.state import state_of
from tests.support.server_harness import ServerThread, parse_sse, tiny_engine

MAX_ENTRIES = 3


@pytest.fixture(scope="module")
def app():
    return create_app(tiny_engine(), ServerConfig(response_cache=True, response_cache_max_entries=MAX_ENTRIES))


@pytest.fixture(scope="module")
def server(app):
    with ServerThread(app) as url:
        yield url


def chat(http, model, content, **extra):
    r = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": content}],
                                                "max_tokens": 5, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def generated(http) -> int:
    return http.get("/admin/stats").json()["tokens_generated"]


def test_a_greedy_repeat_is_a_hit_that_reaches_no_engine(http, model):
    first = chat(http, model, "cache me")
    assert first.headers["ferrox-cache"] == "miss" and first.json()["ferrox_cache"] == "miss"
    before = generated(http)
    second = chat(http, model, "cache me")
    assert second.headers["ferrox-cache"] == "hit" and second.json()["ferrox_cache"] == "hit"
    assert generated(http) == before, "a hit samples nothing"
    assert second.json()["choices"] == first.json()["choices"]
    assert second.json()["usage"] == first.json()["usage"]
    assert second.json()["id"] != first.json()["id"], "a hit is still its own request"


def test_the_official_client_reads_the_header(client, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "cache me"}], max_tokens=5, temperature=0)
    assert raw.headers["ferrox-cache"] == "hit" and raw.parse().choices[0].message.content


def _stream(http, model, content):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        status = r.headers["ferrox-cache"]
        events = parse_sse(r.read().decode())
    for e in events:  # what differs between two requests by design
        if isinstance(e, dict):
            e.pop("id"), e.pop("request_id"), e.pop("created")
    return status, events


def test_a_hit_streams_the_same_events_as_its_miss(http, model):
    miss_status, miss = _stream(http, model, "stream me")
    hit_status, hit = _stream(http, model, "stream me")
    assert (miss_status, hit_status) == ("miss", "hit")
    assert hit == miss and len(miss) > 3 and miss[-1] == "[DONE]"


def test_sampled_requests_skip_and_seeded_ones_are_cached(http, model):
    assert chat(http, model, "dice", temperature=1.0).headers["ferrox-cache"] == "skip"
    assert chat(http, model, "dice", temperature=1.0).headers["ferrox-cache"] == "skip"
    first = chat(http, model, "dice", temperature=1.0, seed=7)
    second = chat(http, model, "dice", temperature=1.0, seed=7)
    assert (first.headers["ferrox-cache"], second.headers["ferrox-cache"]) == ("miss", "hit")
    assert second.json()["choices"] == first.json()["choices"]
    assert chat(http, model, "dice", temperature=1.0, seed=8).headers["ferrox-cache"] == "miss", "another seed"


def test_other_routes_hit_too(server, model):
    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    ask = dict(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 0})
    first = claude.messages.with_raw_response.create(**ask)
    second = claude.messages.with_raw_response.create(**ask)
    assert (first.headers["ferrox-cache"], second.headers["ferrox-cache"]) == ("miss", "hit")
    assert second.parse().content == first.parse().content


def test_the_cache_is_bounded_and_counted(http, model):
    stats = http.get("/cache/stats").json()["response_cache"]
    assert stats["enabled"] and stats["entries"] <= MAX_ENTRIES
    for i in range(MAX_ENTRIES + 1):
        chat(http, model, f"fill {i}")
    assert chat(http, model, "fill 0").headers["ferrox-cache"] == "miss", "the least recently used went first"
    stats = http.get("/cache/stats").json()["response_cache"]
    assert stats["entries"] == MAX_ENTRIES
    metrics = {line.split()[0]: float(line.split()[1]) for line in http.get("/metrics").text.splitlines()
               if line.startswith("ferrox_cache_")}
    assert metrics["ferrox_cache_hits_total"] == stats["hits"] and metrics["ferrox_cache_entries"] == MAX_ENTRIES
    assert metrics["ferrox_cache_misses_total"] == stats["misses"] and stats["skips"] >= 2


def test_an_unload_clears_the_cache(app, http, model):
    chat(http, model, "before the swap")
    assert chat(http, model, "before the swap").headers["ferrox-cache"] == "hit"
    assert http.post("/admin/models/unload").status_code == 200
    state_of(app).set_engine(tiny_engine())  # the same model back: what it cached is still gone
    assert chat(http, model, "before the swap").headers["ferrox-cache"] == "miss"


def test_errors_carry_no_marker(http, model):
    r = http.post("/v1/chat/completions", json={"model": model, "messages": [], "max_tokens": 1})
    assert r.status_code == 400 and "ferrox-cache" not in r.headers and "ferrox_cache" not in r.json()
    assert json.loads(r.text)["error"]["param"] == "messages"


def test_the_key_names_the_model_and_ignores_a_greedy_seed():
    from types import SimpleNamespace

    from api.response_cache import ResponseCache, run_key
    from ferrox_jax.request import Job, RowSampling

    def run(model: str, seed: int, temperature: float = 0.0, request_id: str = "a", **adapter):
        job = Job(request_id=request_id, prompt_token_ids=(1, 2, 3), max_tokens=4,
                  sampling=RowSampling(temperature=temperature, seed=seed), **adapter)
        return SimpleNamespace(engine=SimpleNamespace(model_name=model, checkpoint_path="/ckpt"), jobs=(job,),
                               drop_output=False, seeded=False)

    assert run_key(run("m", 1)) == run_key(run("m", 2, request_id="b")), "greedy: seed and id change nothing"
    assert run_key(run("m", 1)) != run_key(run("other", 1)), "another model's answer is never served"
    assert run_key(run("m", 1, 1.0)) != run_key(run("m", 2, 1.0)), "sampled: the seed is part of the input"
    lora = dict(adapter_name="sql", adapter_key="sql#1")  # a job names its adapter; the engine picks the slot
    assert run_key(run("m", 1, **lora)) != run_key(run("m", 1)), "an adapter's answer is not the base model's"
    assert run_key(run("m", 1, **lora)) != run_key(run("m", 1, **{**lora, "adapter_key": "sql#2"})), "reloaded"
    cache = ResponseCache(max_entries=8, max_bytes=1024)
    assert cache.lookup(run("m", 1, 1.0))[0] == "skip", "sampled without a seed the client named"


def test_counted_bytes_match_what_a_logprob_heavy_entry_takes(http, app):
    """The cache's byte count against tracemalloc: what the process still holds after a
    miss with logprobs 20, echo and n 4 is (all but a few KiB) the entry the cache keeps."""
    body = {"prompt": "count my bytes " * 20, "max_tokens": 160, "logprobs": 20, "echo": True, "n": 4,
            "temperature": 0, "ignore_eos": True}
    cache = state_of(app).response_cache
    for _ in range(2):  # warm what a repeat allocates once: token texts, prefix blocks, the step shapes of a
        cache.clear()   # prompt served from the prefix cache (a compile the first time)
        assert http.post("/v1/completions", json=body).status_code == 200
    cache.clear()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["ferrox-cache"] == "miss", r.text[:200]
        del r  # the reply's body is the client's, not the cache's
        gc.collect()
        real = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(cache) == 1
    assert real / 1.5 <= cache.num_bytes <= real * 1.5, \
        f"the cache counts {cache.num_bytes} bytes for an entry that holds {real}"
