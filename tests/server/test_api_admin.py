"""Observability end to end: /health states (loading -> ready, unavailable), /metrics names,
/admin/stats fields and the `recent` ring, /openapi.json, tokenize/detokenize routes."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.config import ServerConfig
from api.telemetry import BATCHER_STATS_FIELDS
from tests.support.server_harness import ServerThread, tiny_engine, wait_for

CONTRACT_METRICS = [
    "ferrox_prefill_chunks_total", "ferrox_prefill_tokens_total", "ferrox_decode_steps_total",
    "ferrox_scheduler_queue_depth", "ferrox_scheduler_queue_rejected_total", "ferrox_kv_blocks_total",
    "ferrox_kv_blocks_free", "ferrox_kv_block_size", "ferrox_kv_rejected_too_large_total",
    "ferrox_kv_rejected_context_length_total", "ferrox_scheduler_aborted_total", "ferrox_requests_total",
    "ferrox_request_errors_total",
]
OUR_METRICS = [
    "ferrox_kv_blocks_peak", "ferrox_kv_usage_fraction", "ferrox_requests_running", "ferrox_requests_waiting",
    "ferrox_recompiles_after_warmup_total", "ferrox_synthetic_weights", "ferrox_weights_bytes",
    "ferrox_kv_cache_bytes",
]
HISTOGRAMS = ["ferrox_time_to_first_token_seconds", "ferrox_inter_token_latency_seconds",
              "ferrox_e2e_request_latency_seconds", "ferrox_queue_time_seconds"]
SERVER_FIELDS = ["uptime_seconds", "requests_total", "errors_total", "tokens_prompt_total",
                 "tokens_generated_total", "last_request_age_seconds", "generating_now", "recent"]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, ServerConfig())) as url:
        yield url


def samples(text: str) -> dict[str, float]:
    return {s.name + ("" if not s.labels else str(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_when_ready(http, engine):
    r = http.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["state"] == "ready" and body["model"] == engine.model_name
    assert body["version"] and body["uptime_seconds"] >= 0
    info = body["model_info"]  # beside `model`, which stays the id clients compare
    assert info["id"] == engine.model_name and info["synthetic_weights"] is False
    assert info["weights_bytes"] == engine.weights_bytes and info["kv_bytes"] == engine.model_card.kv_bytes


def test_metrics_names_and_values(http):
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "stream": True})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = samples(r.text)
    for name in CONTRACT_METRICS + OUR_METRICS:
        assert name in values, f"/metrics lacks {name}"
    for name in HISTOGRAMS:
        assert f"{name}_count" in values and f"{name}_bucket[('le', '+Inf')]" in values
    assert values["ferrox_time_to_first_token_seconds_count"] >= 1
    assert values["ferrox_inter_token_latency_seconds_count"] >= 3, "4 tokens give 3 gaps"
    stats = http.get("/admin/stats").json()
    assert values["ferrox_kv_blocks_total"] == stats["kv_blocks_total"]
    assert values["ferrox_kv_block_size"] == 16
    assert values["ferrox_synthetic_weights"] == 0, "real weights: 0 (1 under --load-format dummy)"
    assert values["ferrox_weights_bytes"] == stats["model_info"]["weights_bytes"] > 0
    assert values["ferrox_decode_steps_total"] <= stats["decode_steps"], "a snapshot, never ahead"


def test_admin_stats_fields_and_recent_ring(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    request_id = r.json()["id"]
    stats = http.get("/admin/stats").json()
    for name in BATCHER_STATS_FIELDS + tuple(SERVER_FIELDS):
        assert name in stats, f"/admin/stats lacks {name}"
    assert len(BATCHER_STATS_FIELDS) == 12
    last = stats["recent"][-1]
    assert last["id"] == request_id and last["route"] == "/v1/completions" and last["status"] == 200
    assert last["completion_tokens"] == 3 and last["stream"] is False
    assert last["ttft_ms"] > 0 and last["duration_ms"] >= last["ttft_ms"]
    assert stats["last_request_age_seconds"] >= 0 and stats["generating_now"] == 0


def test_recent_ring_keeps_the_last_200(http):
    for _ in range(205):
        http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
    assert len(http.get("/admin/stats").json()["recent"]) == 200


def test_openapi_describes_the_routes(http):
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/cancel", "/v1/tokenize",
                 "/v1/detokenize", "/tokenizer_info", "/health", "/metrics", "/admin/stats"):
        assert path in spec["paths"], path
    request_schema = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert request_schema["schema"]["$ref"] == "#/components/schemas/CompletionRequest"
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "logprobs", "echo", "stream"} <= set(props)


def test_tokenize_and_detokenize_round_trip(http):
    for route in ("/v1/tokenize", "/tokenize"):
        out = http.post(route, json={"prompt": "Hello world!"}).json()
        assert out["count"] == len(out["tokens"]) > 0
    detokenized = http.post("/detokenize", json={"tokens": out["tokens"]}).json()
    assert detokenized == {"prompt": "Hello world!", "text": "Hello world!"}, "vLLM's field and ours"
    assert http.post("/v1/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_tokenizer_info_describes_the_tokenizer_as_transformers_loads_it(http):
    import transformers

    from tests.support.server_harness import CONTEXT_TOKENS, api_checkpoint

    reference = transformers.AutoTokenizer.from_pretrained(api_checkpoint())
    info = http.get("/tokenizer_info").json()
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
        assert info[name] == getattr(reference, name), name
    assert info["eos_token_id"] == reference.eos_token_id and info["eos_token_id"] in info["stop_token_ids"]
    assert info["added_tokens_decoder"] == {str(i): t.content for i, t in reference.added_tokens_decoder.items()}
    assert info["add_bos_token"] is False and info["add_eos_token"] is False, "this tokenizer adds neither"
    assert info["model_max_length"] == CONTEXT_TOKENS and info["vocab_size"] == len(reference)
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"


class Borrowed:
    """The shared engine, lent to an app that would shut down an engine its loader made."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def shutdown(self, *args, **kwargs) -> None:
        pass


def test_health_loading_then_ready(engine):
    release = threading.Event()

    def loader():
        release.wait(30)
        return Borrowed(engine)

    server = ServerThread(create_app(loader, ServerConfig()))
    url = server.start(wait_ready=False)
    try:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["state"] == "loading" and r.headers["retry-after"] == "1"
        assert r.json()["model_info"] is None, "nothing to describe before the engine loads"
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        release.set()
        wait_for(lambda: httpx.get(url + "/health").status_code == 200)
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


def test_health_unavailable_when_loading_fails():
    def loader():
        raise FileNotFoundError("model path does not exist: /nowhere")

    server = ServerThread(create_app(loader, ServerConfig()))
    url = server.start(wait_ready=False)
    try:
        wait_for(lambda: httpx.get(url + "/health").json()["state"] == "unavailable")
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "/nowhere" in r.json()["reason"]
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        server.stop()


def test_drain_finishes_in_flight_streams_and_refuses_new_work(engine):
    import asyncio

    from api.app import drain

    app = create_app(engine, ServerConfig())
    server = ServerThread(app)
    url = server.start()
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            body = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                done = asyncio.run_coroutine_threadsafe(drain(app, 30.0), server._loop)
                health = client.get("/health")
                assert health.status_code == 503 and health.json()["state"] == "draining"
                refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "draining"
                rest = "\n".join(lines)
            assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest, \
                "the stream started before the drain runs to its end"
            done.result(10)
    finally:
        server.stop()
