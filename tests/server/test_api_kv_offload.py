"""The host KV tier (`--kv-offload-gib`) through the server: a prompt the device cache evicted
is served from host memory on its next request (`cached_tokens`), the same greedy text, and
the per-tier counters in `/metrics` and `/admin/stats`. Real Hypercorn server, real engine
on a tiny Llama (16-position blocks)."""

from __future__ import annotations

import random

import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine

BLOCK = 16
PROMPT = 50  # 3 full blocks of 16 before the last token: 48 tokens a hit can serve
MAX_TOKENS = 6  # ceil(56 / 16) = 4 blocks per request
NUM_PROMPTS = 6  # 6 x 3 named blocks = 18 blocks of working set, over the device's 8


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine(kv_blocks=9, max_seqs=2, kv_offload_gib=0.01)  # 8 usable blocks: 2 requests at once
    with ServerThread(create_app(engine, ServerConfig())) as url:
        yield url


def metric(http, name):
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"/metrics lacks {name}")


def complete(http, prompt):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_evicted_prompts_come_back_from_the_host_tier(http):
    prompts = [random.Random(i).sample(range(10, 380), PROMPT) for i in range(NUM_PROMPTS)]
    first = [complete(http, p) for p in prompts]
    assert all(cached == 0 for _, cached in first), "the first pass shares nothing"
    host_before = metric(http, "ferrox_prefix_cache_hits_host_total")
    # Requests one at a time, 4 blocks each in 8: the first prompts' blocks left the device long ago.
    second = [complete(http, p) for p in prompts]
    assert [text for text, _ in second] == [text for text, _ in first], "a host-tier hit changed greedy text"
    assert second[0][1] == 3 * BLOCK, "the first prompt was served from cache (host tier) on its replay"
    host_hits = metric(http, "ferrox_prefix_cache_hits_host_total") - host_before
    assert host_hits >= 3 * BLOCK, host_hits
    stats = http.get("/admin/stats").json()
    assert stats["prefix_cache_hits"] == stats["prefix_cache_hits_device"] + stats["prefix_cache_hits_host"]
    assert stats["kv_offload_blocks_total"] == metric(http, "ferrox_kv_offload_blocks_total") > 0
    assert stats["kv_offload_blocks_restored"] * BLOCK == stats["prefix_cache_hits_host"]
    assert stats["kv_offload_blocks_stored"] >= NUM_PROMPTS * 3 - 2 * 3, "all but the last two prompts' blocks"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"


def test_a_cache_rebuild_starts_with_an_empty_host_tier(http):
    """After the test above (same module, same server): a rebuild builds a new engine whose
    tier is empty, so the first prompt's replay computes again and the tier fills anew."""
    prompt = random.Random(0).sample(range(10, 380), PROMPT)  # the first prompt above, in the tier now
    text, _ = complete(http, prompt)
    r = http.post("/v1/cache/rebuild", json={"kv_blocks": 10}, timeout=300)
    assert r.status_code == 200, r.text
    stats = http.get("/admin/stats").json()
    assert stats["kv_offload_blocks_total"] > 0, "the new engine keeps --kv-offload-gib"
    assert stats["kv_offload_blocks_cached"] == 0 and stats["prefix_cache_hits_host"] == 0
    assert complete(http, prompt) == (text, 0), "nothing cached on the new engine; the same greedy text"
