"""What routers in front of several replicas ask a worker: its identity and its load.

A replica behind a router is picked by a handful of numbers: how many requests run and
wait, how full the KV cache is, how often prompts hit the prefix cache. The routers
people run read them in two dialects, and this module answers both from the latest
`BatcherStats` snapshot (the same numbers `/admin/stats` shows; nothing is re-counted):

- **vLLM's**: the Prometheus gauges under `vllm:` names on `/metrics` (`VllmGauges`, for
  the Kubernetes Gateway API Inference Extension's endpoint picker, `vllm-router`, and
  SGLang's gateway `smg` once `/version` told it it talks to a vLLM-like worker), and
  `GET /version` (`{"version": ...}`).
- **SGLang's**: `GET /server_info` and `/model_info` (and their older `/get_*` names),
  the per-rank load document `GET /v1/loads` (`{"timestamp", "dp_rank_count", "loads":
  [one rank]}`) and the older scalar `GET /get_load` (`{"load": running + waiting}`).

Meanings follow vLLM's: *running* is rows holding a slot (prefilling or decoding),
*waiting* is jobs not yet admitted, and KV usage is the fraction of usable blocks held or
promised to admitted jobs. Admission here reserves prompt + `max_tokens` up front, so the
fraction counts promised blocks too: it is the number that says whether a new request
would be admitted now. Idle blocks kept only by the prefix cache count as free, as in
vLLM, where they are evictable. The prefix-cache counters count tokens (queried, and
served from cache), exactly as vLLM's `vllm:prefix_cache_queries` / `_hits` do.

These routes are polled every few seconds, so they are not counted as API requests
(`PROBE_PATHS`, excluded in `api/app.py` like `/health`).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from quart import Blueprint, Response, current_app

from api.state import VERSION, AppState, json_response, state_of
from api.telemetry import stats_dict

blueprint = Blueprint("router", __name__)

PROBE_PATHS = frozenset({"/version", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
                         "/v1/loads", "/get_load"})


def load_snapshot(state: AppState) -> dict[str, Any]:
    """The load numbers every dialect below renders, from the latest stats snapshot.

    Returns: running, waiting (requests), blocks_total, blocks_used, block_size,
      kv_usage (0..1), prefix_queries, prefix_hits (tokens), max_running (rows)."""
    d = stats_dict(state.engine_stats())
    total = d["kv_blocks_total"] or 0
    used = total - (d["kv_blocks_free"] or 0)
    engine = state.engine
    return {"running": d.get("running_rows") or 0, "waiting": d["queue_depth"] or 0,
            "blocks_total": total, "blocks_used": used, "block_size": d["kv_block_size"] or 0,
            "kv_usage": used / total if total else 0.0,
            "prefix_queries": d.get("prefix_cache_queries") or 0, "prefix_hits": d.get("prefix_cache_hits") or 0,
            "max_running": engine.config.max_seqs if engine is not None else 0}


class VllmGauges:
    """`/metrics` in vLLM's names, labelled `model_name` and `engine` as vLLM labels them."""

    def __init__(self, state: AppState) -> None:
        self._state = state

    def collect(self) -> Iterator[Any]:
        state = self._state
        load = load_snapshot(state)
        labels = {"model_name": state.engine.model_name if state.engine is not None else "", "engine": "0"}
        names, values = list(labels), list(labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, float(value))
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, float(value))
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", load["running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", load["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", load["kv_usage"])
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      load["prefix_queries"])
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      load["prefix_hits"])
        # vllm:num_preemptions_total: running requests preempted for more urgent ones (priority policy)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats_dict(state.engine_stats()).get("num_preemptions") or 0)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"])
        engine = state.engine
        if engine is not None:
            info.add_metric([str(load["block_size"]), str(load["blocks_total"]),
                             str(engine.config.prefix_caching), engine.model_card.kv_cache_dtype], 1.0)
        yield info


def server_info(state: AppState) -> dict[str, Any]:
    """SGLang's `/server_info`, the fields routers read (model identity, parallelism, capacity)."""
    engine = state.engine
    load = load_snapshot(state)
    info: dict[str, Any] = {"version": VERSION, "dp_size": 1, "pp_size": 1, "is_embedding": False,
                            "disaggregation_mode": "null", "max_running_requests": load["max_running"],
                            "max_total_tokens": load["blocks_total"] * load["block_size"]}
    if engine is not None:
        data, model = engine.config.mesh_shape
        info.update(model_path=engine.checkpoint_path, served_model_name=engine.model_name,
                    tp_size=model, context_length=engine.max_context, page_size=load["block_size"])
    return info


def model_info(state: AppState) -> dict[str, Any]:
    """SGLang's `/model_info`."""
    engine = state.engine
    if engine is None:
        return {"is_generation": True}
    return {"model_path": engine.checkpoint_path, "tokenizer_path": engine.checkpoint_path,
            "is_generation": True, "has_image_understanding": False, "has_audio_understanding": False,
            "architectures": [engine.model_card.architecture]}


def loads(state: AppState) -> dict[str, Any]:
    """SGLang's `/v1/loads`: one data-parallel rank (a ferrox replica is one engine)."""
    load = load_snapshot(state)
    _, decode_per_s, _ = state.rates.rates(time.monotonic(), 10)
    total_tokens = load["blocks_total"] * load["block_size"]
    rank = {"dp_rank": 0, "num_running_reqs": load["running"], "num_waiting_reqs": load["waiting"],
            "num_total_reqs": load["running"] + load["waiting"],
            "num_used_tokens": load["blocks_used"] * load["block_size"], "max_total_num_tokens": total_tokens,
            "token_usage": load["kv_usage"], "utilization": load["kv_usage"], "gen_throughput": decode_per_s,
            "cache_hit_rate": load["prefix_hits"] / load["prefix_queries"] if load["prefix_queries"] else 0.0,
            "max_running_requests": load["max_running"]}
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "dp_rank_count": 1,
            "loads": [rank]}


@blueprint.get("/version")
async def version() -> Response:
    return json_response({"version": VERSION})


@blueprint.get("/server_info")
@blueprint.get("/get_server_info")
async def get_server_info() -> Response:
    return json_response(server_info(state_of(current_app)))


@blueprint.get("/model_info")
@blueprint.get("/get_model_info")
async def get_model_info() -> Response:
    return json_response(model_info(state_of(current_app)))


@blueprint.get("/v1/loads")
async def get_loads() -> Response:
    return json_response(loads(state_of(current_app)))


@blueprint.get("/get_load")
async def get_load() -> Response:
    load = load_snapshot(state_of(current_app))
    return json_response({"load": load["running"] + load["waiting"], "num_reqs": load["running"],
                          "num_waiting_reqs": load["waiting"],
                          "num_tokens": load["blocks_used"] * load["block_size"]})
