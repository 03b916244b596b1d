"""/v1/stats (windowed throughput, latency, KV, memory) and /v1/requests (the recent ring,
paged). Real server, tiny Llama."""

from __future__ import annotations

import pytest

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine, wait_for


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def test_windowed_rates_follow_the_work_done(http):
    for _ in range(3):
        assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "temperature": 0,
                                                  "ignore_eos": True}).status_code == 200
    # the sampler runs once a second: wait until a sample after the work is in the window
    stats = wait_for(lambda: (s := http.get("/v1/stats", params={"window": 30}).json())["decode_tokens_per_s"] > 0
                     and s, timeout_s=5)
    assert stats["window_s"] == 30 and 0 < stats["window_covered_s"] <= 30
    assert stats["prefill_tokens_per_s"] > 0
    assert stats["requests"]["active"] == 0 and stats["requests"]["completed"] >= 3
    assert stats["latency_ms"]["p95"] >= stats["latency_ms"]["p50"] > 0
    assert stats["ttft_ms"]["mean"] > 0
    kv = stats["kv"]
    assert kv["blocks_used"] == kv["blocks_total"] - kv["blocks_free"] == 0, "idle: every block back"
    assert stats["memory"]["rss_bytes"] > 0 and isinstance(stats["memory"]["device"], dict)


def test_bad_window_is_a_400(http):
    r = http.get("/v1/stats", params={"window": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "window"


def test_requests_ring_pages_by_since_and_limit(http):
    start = http.get("/v1/requests", params={"limit": 200}).json()
    since = start["data"][-1]["seq"] if start["data"] else 0
    ids = [http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()["id"] for _ in range(5)]
    page = http.get("/v1/requests", params={"since": since, "limit": 3}).json()
    assert [r["id"] for r in page["data"]] == ids[:3] and page["has_more"] is True
    rest = http.get("/v1/requests", params={"since": page["next_since"], "limit": 3}).json()
    assert [r["id"] for r in rest["data"]] == ids[3:] and rest["has_more"] is False
    assert [r["seq"] for r in page["data"] + rest["data"]] == list(range(since + 1, since + 6))
    assert all(r["route"] == "/v1/completions" and r["finished_at"] > 0 for r in rest["data"])
