"""What routers and autoscalers read of a replica: vLLM's gauges and latency histograms (vLLM's
names and buckets, counting what the ferrox_* twins count) and the free KV tokens on /metrics
(parsed with prometheus_client's own parser), /version, SGLang's /server_info, /model_info,
/v1/loads and /get_load. Real Hypercorn server, real engine on the tiny Llama (16-position blocks)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine, wait_for

BLOCK = 16  # the harness engine's block size


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        yield url


def vllm_samples(http) -> dict[str, tuple[dict, float]]:
    """vllm:* samples by name -> (labels, value), from the real Prometheus text parser."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                out[sample.name] = (sample.labels, sample.value)
    return out


def value(http, name: str) -> float:
    return vllm_samples(http)[name][1]


def test_cache_config_info_names_block_size_and_blocks(http):
    samples = vllm_samples(http)
    labels, one = samples["vllm:cache_config_info"]
    stats = http.get("/admin/stats").json()
    assert one == 1.0, "an info gauge, as vLLM's"
    assert labels["block_size"] == str(BLOCK) and labels["num_gpu_blocks"] == str(stats["kv_blocks_total"])
    model = http.get("/v1/models").json()["data"][0]["id"]
    running_labels, _ = samples["vllm:num_requests_running"]
    assert running_labels == {"model_name": model, "engine": "0"}, "vLLM's labels on every gauge"
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in samples, f"/metrics lacks {name}"


def test_a_running_stream_shows_in_every_load_dialect(server, http):
    wait_for(lambda: value(http, "vllm:num_requests_running") == 0)
    body = {"prompt": "Count", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, timeout=30) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept: dropping the iterator would close the connection
        next(lines)  # the first token is out: the row holds its slot and its blocks
        assert value(http, "vllm:num_requests_running") == 1
        stats = http.get("/admin/stats").json()
        total = stats["kv_blocks_total"]
        usage = value(http, "vllm:kv_cache_usage_perc")
        # 1 prompt token + 1500 to generate reserve ceil(1501 / 16) = 94 blocks up front.
        assert usage >= 94 / total, f"the admitted row's reservation counts: {usage} * {total} blocks"
        loads = http.get("/v1/loads").json()
        assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
        rank = loads["loads"][0]
        assert rank["num_running_reqs"] == 1 and rank["num_waiting_reqs"] == 0
        assert rank["max_total_num_tokens"] == total * BLOCK
        assert rank["num_used_tokens"] >= 94 * BLOCK
        assert http.get("/get_load").json()["load"] == 1
    # Leaving the stream disconnects: the request is aborted and its slot freed.
    wait_for(lambda: value(http, "vllm:num_requests_running") == 0)
    assert http.get("/get_load").json()["load"] == 0


def test_prefix_cache_counters_count_tokens_as_vllms_do(http):
    prompt = random.Random(24).sample(range(10, 380), 40)  # 2 full blocks + 8 tokens
    queries, hits = value(http, "vllm:prefix_cache_queries_total"), value(http, "vllm:prefix_cache_hits_total")
    for _ in range(2):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
    assert value(http, "vllm:prefix_cache_queries_total") - queries == 2 * 40, "every prompt token is looked up"
    assert value(http, "vllm:prefix_cache_hits_total") - hits == 2 * BLOCK, "the second prompt hits 2 full blocks"
    rank = http.get("/v1/loads").json()["loads"][0]
    stats = http.get("/admin/stats").json()
    assert rank["cache_hit_rate"] == pytest.approx(stats["prefix_cache_hits"] / stats["prefix_cache_queries"])


def test_sglang_identity_probes(http):
    model = http.get("/v1/models").json()["data"][0]
    info = http.get("/server_info").json()
    assert http.get("/get_server_info").json() == info, "the old name answers the same"
    assert info["served_model_name"] == model["id"] and info["dp_size"] == 1 and info["tp_size"] == 1
    assert info["context_length"] == model["max_model_len"]
    assert info["max_total_tokens"] == http.get("/admin/stats").json()["kv_blocks_total"] * BLOCK
    model_info = http.get("/model_info").json()
    assert model_info == http.get("/get_model_info").json()
    assert model_info["is_generation"] is True and model_info["architectures"] == ["LlamaForCausalLM"]
    assert json.loads(http.get("/version").text)["version"], "vLLM's /version: a router's runtime probe"


def test_probe_polls_are_not_counted_as_requests(http):
    before = http.get("/admin/stats").json()["requests_total"]
    for path in ("/version", "/server_info", "/get_server_info", "/model_info", "/v1/loads", "/get_load"):
        assert http.get(path).status_code == 200, path
    assert http.get("/admin/stats").json()["requests_total"] == before


# vLLM's buckets as vllm/v1/metrics/loggers.py lists them, written out here so a drift in
# api/telemetry.py's copies is caught.
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
}
VLLM_BUCKETS["vllm:request_queue_time_seconds"] = VLLM_BUCKETS["vllm:e2e_request_latency_seconds"]
TWINS = {"vllm:time_to_first_token_seconds": "ferrox_time_to_first_token_seconds",
         "vllm:inter_token_latency_seconds": "ferrox_inter_token_latency_seconds",
         "vllm:e2e_request_latency_seconds": "ferrox_e2e_request_latency_seconds",
         "vllm:request_queue_time_seconds": "ferrox_queue_time_seconds"}


def histograms(http) -> dict[str, dict]:
    """Histogram families by name -> {"buckets": [le...], "count": n, "labels": {...}}."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.type != "histogram":
            continue
        entry = {"buckets": [], "count": 0.0, "labels": {}}
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                entry["buckets"].append(float(sample.labels["le"]))
            elif sample.name.endswith("_count"):
                entry["count"], entry["labels"] = sample.value, labels
        out[family.name] = entry
    return out


def test_latency_histograms_under_vllms_names_and_buckets_beside_ours(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    wait_for(lambda: value(http, "vllm:num_requests_running") == 0)
    before = histograms(http)
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = histograms(http)
    for name, buckets in VLLM_BUCKETS.items():
        assert after[name]["buckets"] == buckets, f"{name} keeps vLLM's buckets"
        assert after[name]["labels"] == {"model_name": model, "engine": "0"}, f"{name} is labelled as vLLM's"
        ours = TWINS[name]
        grew = after[name]["count"] - before.get(name, {"count": 0.0})["count"]
        assert grew == after[ours]["count"] - before[ours]["count"] > 0, f"{name} counts what {ours} counts"
    # 5 tokens: one time to first token, 4 inter-token gaps, one whole request, one queue wait.
    itl = after["vllm:inter_token_latency_seconds"]["count"] - before.get(
        "vllm:inter_token_latency_seconds", {"count": 0.0})["count"]
    assert itl == 4, "one gap per token after the first"


def test_free_kv_tokens_is_the_free_blocks_in_positions(server, http):
    def free_tokens() -> float:
        families = text_string_to_metric_families(http.get("/metrics").text)
        return next(f.samples[0].value for f in families if f.name == "ferrox_kv_free_tokens")

    wait_for(lambda: value(http, "vllm:num_requests_running") == 0)
    stats = http.get("/admin/stats").json()
    assert free_tokens() == stats["kv_blocks_free"] * BLOCK == stats["kv_blocks_total"] * BLOCK, "idle: all free"
    body = {"prompt": "Count", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, timeout=30) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        # 1 prompt token + 1500 to generate reserve ceil(1501 / 16) = 94 blocks up front.
        assert free_tokens() <= (stats["kv_blocks_total"] - 94) * BLOCK, "the running row's reservation is not free"
    wait_for(lambda: free_tokens() == stats["kv_blocks_total"] * BLOCK)
