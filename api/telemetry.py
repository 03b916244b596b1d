"""The server's own counters (beside the batcher's) and the Prometheus registry.

`ServerStats` counts what the HTTP layer sees: requests, errors, tokens, the `recent`
ring of the last 200 requests for `/admin/stats` and `/v1/requests` (each record numbered,
so clients page with `since`). `RateWindow` samples the engine's token counters once a
second so `/v1/stats` can report prefill and decode tokens/s over a recent window.
Everything here is touched only from the server's event loop, so it needs no lock.

`/metrics` is rendered from two sources at scrape time: the latest `BatcherStats`
snapshot the owner thread published (the contract's `ferrox_*` counters and gauges,
re-exported as they are, never re-counted here), and histograms the handlers observe
(time to first token, inter-token latency, end-to-end latency, queue time), each twice:
as `ferrox_*` and under vLLM's name and buckets (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`, labelled `model_name` and `engine` as vLLM labels them),
so dashboards, KEDA triggers and routers written against vLLM read a ferrox replica
unchanged (`Metrics.observe` feeds both from one measurement); `ferrox_kv_free_tokens` is the
free KV budget in token positions (free blocks x block size), the number an autoscaler or
a router compares with a prompt's length; plus three
gauges from the engine's model card: `ferrox_synthetic_weights` (1 when the weights are
random, `--load-format dummy`), `ferrox_weights_bytes` and `ferrox_kv_cache_bytes`. Each app
has its own `CollectorRegistry`, so several servers in one test process do not collide.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:  # the facade's module imports jax; a snapshot's type is all this needs of it
    from ferrox_jax.engine import BatcherStats

RECENT_SIZE = 200

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), kept equal so quantiles and
# `le=` thresholds mean the same on a ferrox replica as on a vLLM one.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)

# The twelve BatcherStats fields of the ferrox-server stats contract, in its order.
BATCHER_STATS_FIELDS = (
    "prefill_chunks", "prefill_tokens", "decode_steps", "queue_depth", "queue_rejected",
    "kv_blocks_total", "kv_blocks_free", "kv_block_size", "kv_rejected_too_large",
    "kv_rejected_context_length", "kv_blocks_peak", "aborted",
)

# (BatcherStats field, metric name without _total, kind, help)
_BATCHER_METRICS = (
    ("prefill_chunks", "ferrox_prefill_chunks", "counter", "prefill chunks run"),
    ("prefill_tokens", "ferrox_prefill_tokens", "counter", "prompt tokens prefilled"),
    ("decode_steps", "ferrox_decode_steps", "counter", "batched decode steps run"),
    ("queue_depth", "ferrox_scheduler_queue_depth", "gauge", "jobs waiting for admission"),
    ("queue_rejected", "ferrox_scheduler_queue_rejected", "counter", "jobs refused: waiting queue full"),
    ("kv_blocks_total", "ferrox_kv_blocks_total", "gauge", "KV blocks in the budget"),
    ("kv_blocks_free", "ferrox_kv_blocks_free", "gauge",
     "KV blocks not held or promised by admitted jobs (idle cached blocks count as free)"),
    ("kv_block_size", "ferrox_kv_block_size", "gauge", "token positions per KV block"),
    ("kv_rejected_too_large", "ferrox_kv_rejected_too_large", "counter",
     "jobs refused: more blocks than the whole budget"),
    ("kv_rejected_context_length", "ferrox_kv_rejected_context_length", "counter",
     "jobs refused: prompt + max_tokens above the context ceiling"),
    ("kv_blocks_peak", "ferrox_kv_blocks_peak", "gauge", "most KV blocks held at once, counted from the rows"),
    ("aborted", "ferrox_scheduler_aborted", "counter", "jobs the scheduler stopped on cancellation"),
    ("prefix_cache_queries", "ferrox_prefix_cache_queries", "counter",
     "prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "ferrox_prefix_cache_hits", "counter",
     "prompt tokens served from the prefix cache instead of computed"),
    ("kv_blocks_cached", "ferrox_kv_blocks_cached", "gauge", "KV blocks resident in the prefix cache"),
    # the sliding KV group of a model with sliding-window layers (ferrox_jax/kv_groups.py)
    ("kv_window_slots_total", "ferrox_kv_window_slots_total", "gauge", "sliding-window KV group: slots in its pool"),
    ("kv_window_slots_held", "ferrox_kv_window_slots_held", "gauge",
     "sliding-window KV group: slots the rows' windows reference"),
    ("kv_window_slots_free", "ferrox_kv_window_slots_free", "gauge",
     "sliding-window KV group: slots not held or reserved (parked ones count as free)"),
    ("kv_window_blocks_passed", "ferrox_kv_window_blocks_passed", "counter",
     "sliding-window KV group: block references dropped as rows moved past the window"),
    # the host KV tier under the prefix cache (--kv-offload-gib)
    ("prefix_cache_hits_device", "ferrox_prefix_cache_hits_device", "counter",
     "prompt tokens served from the device prefix cache"),
    ("prefix_cache_hits_host", "ferrox_prefix_cache_hits_host", "counter",
     "prompt tokens restored from the host KV tier instead of computed"),
    ("kv_offload_blocks_total", "ferrox_kv_offload_blocks_total", "gauge", "host KV tier slots (0: off)"),
    ("kv_offload_blocks_cached", "ferrox_kv_offload_blocks_cached", "gauge", "host KV tier slots holding a block"),
    ("kv_offload_blocks_stored", "ferrox_kv_offload_blocks_stored", "counter",
     "evicted prefix-cache blocks copied to host memory"),
    ("kv_offload_blocks_evicted", "ferrox_kv_offload_blocks_evicted", "counter",
     "host KV tier copies dropped for newer ones (LRU)"),
    ("kv_offload_blocks_restored", "ferrox_kv_offload_blocks_restored", "counter",
     "host KV tier copies restored into the device cache"),
    ("kv_offload_snapshots_total", "ferrox_kv_offload_snapshots_total", "gauge",
     "host KV tier slots for recurrent-state snapshots (0: none)"),
    ("kv_offload_snapshot_bytes", "ferrox_kv_offload_snapshot_bytes", "gauge",
     "host bytes of one recurrent-state snapshot in the host KV tier"),
    ("kv_offload_snapshots_cached", "ferrox_kv_offload_snapshots_cached", "gauge",
     "host KV tier snapshot slots holding a recurrent state"),
    ("kv_offload_snapshots_stored", "ferrox_kv_offload_snapshots_stored", "counter",
     "recurrent-state snapshots the device dropped, copied to host memory"),
    ("kv_offload_snapshots_restored", "ferrox_kv_offload_snapshots_restored", "counter",
     "host recurrent-state snapshots restored into a row's state on a prefix hit"),
    # the recurrent state pool (a model with linear-attention layers; all 0 for others)
    ("state_slots_total", "ferrox_state_slots_total", "gauge", "recurrent state slots rows can hold"),
    ("state_slots_held", "ferrox_state_slots_held", "gauge", "recurrent state slots held by admitted rows"),
    ("state_pool_bytes", "ferrox_state_pool_bytes", "gauge", "device bytes of the recurrent state pool"),
    ("state_snapshot_slots_total", "ferrox_state_snapshot_slots_total", "gauge",
     "recurrent state snapshot slots kept for prefix-cache hits"),
    ("state_snapshot_slots_held", "ferrox_state_snapshot_slots_held", "gauge",
     "recurrent state snapshots attached to cached blocks"),
    ("state_snapshots_taken", "ferrox_state_snapshots_taken", "counter", "recurrent state snapshots taken"),
    ("state_snapshots_restored", "ferrox_state_snapshots_restored", "counter",
     "prefix-cache hits that restored a recurrent state snapshot"),
    ("tokens_generated", "ferrox_tokens_generated", "counter",
     "tokens the engine sampled, counted every step (stop tokens included); ferrox_generation_tokens "
     "counts a request's tokens when it ends"),
    # structured output
    ("constrained_requests", "ferrox_constrained_requests", "counter",
     "jobs whose output a grammar constrains (response_format, guided_*, forced tool calls)"),
    ("grammar_mask_rows", "ferrox_grammar_mask_rows", "counter",
     "token masks computed, one per constrained row and step"),
    ("grammar_mask_s", "ferrox_grammar_mask_seconds", "counter", "host seconds spent computing token masks"),
    ("grammar_mask_fills", "ferrox_grammar_mask_fills", "counter",
     "mask computations, one per model call with a constrained row"),
    ("grammar_mask_fills_hidden", "ferrox_grammar_mask_fills_hidden", "counter",
     "mask computations that finished while the model call was still running"),
    ("grammar_errors", "ferrox_grammar_errors", "counter", "rows ended because their grammar rejected a sampled token"),
    ("encoder_runs", "ferrox_encoder_runs", "counter", "images the vision encoder computed"),
    ("encoder_cache_hits", "ferrox_encoder_cache_hits", "counter",
     "images whose soft tokens came from the encoder cache instead of the encoder"),
    ("image_tokens", "ferrox_image_tokens", "counter", "image soft tokens computed by forwards"),
)


def snapshot_or_zeros(stats: BatcherStats | None) -> BatcherStats:
    """`stats`, or a snapshot of zeros before an engine is loaded."""
    if stats is not None:
        return stats
    from ferrox_jax.engine import BatcherStats

    return BatcherStats()


def stats_dict(stats: BatcherStats | None) -> dict[str, Any]:
    """A BatcherStats snapshot as a dict (every field, the contract's twelve first); zeros
    before an engine is loaded."""
    d = dataclasses.asdict(snapshot_or_zeros(stats))
    ordered = {name: d.pop(name, 0) for name in BATCHER_STATS_FIELDS}
    ordered.update(d)
    return ordered


@dataclasses.dataclass
class RequestRecord:
    """One finished request, as shown in /admin/stats `recent`."""

    id: str
    route: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    ttft_ms: float | None
    duration_ms: float
    stream: bool
    seq: int = 0  # 1, 2, ... in the order requests finished (`/v1/requests?since=`)
    finished_at: float = 0.0  # Unix time


class ServerStats:
    """HTTP-side totals; event-loop only."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self.requests_total = 0  # every request except the observability routes
        self.errors_total = 0  # of those, answered >= 400 or ended by an error event
        self.tokens_prompt_total = 0
        self.tokens_generated_total = 0
        self.generating_now = 0  # generation requests between submit and their last event
        self.completed_total = 0  # generation requests recorded with a status below 400
        self.num_recorded = 0  # generation requests recorded (the last record's seq)
        self.last_request_at: float | None = None
        self.recent: collections.deque[RequestRecord] = collections.deque(maxlen=RECENT_SIZE)

    def on_request(self) -> None:
        self.requests_total += 1
        self.last_request_at = time.monotonic()

    def on_error(self) -> None:
        self.errors_total += 1

    def record(self, rec: RequestRecord) -> None:
        self.num_recorded += 1
        rec.seq, rec.finished_at = self.num_recorded, time.time()
        self.completed_total += rec.status < 400
        self.tokens_prompt_total += rec.prompt_tokens
        self.tokens_generated_total += rec.completion_tokens
        self.recent.append(rec)

    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    def as_dict(self) -> dict[str, Any]:
        age = None if self.last_request_at is None else time.monotonic() - self.last_request_at
        return {
            "uptime_seconds": round(self.uptime_s(), 3),
            "requests_total": self.requests_total,
            "errors_total": self.errors_total,
            "tokens_prompt_total": self.tokens_prompt_total,
            "tokens_generated_total": self.tokens_generated_total,
            "last_request_age_seconds": None if age is None else round(age, 3),
            "generating_now": self.generating_now,
            "recent": [dataclasses.asdict(r) for r in self.recent],
        }


class RateWindow:
    """Token counters sampled over time: (monotonic s, prefill tokens, generated tokens).

    Rates are measured between samples, not derived from per-request timings, so they
    count work done inside the window even for requests still running."""

    def __init__(self, keep_s: float = 120.0) -> None:
        self.keep_s = keep_s
        self.samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def sample(self, now: float, stats: BatcherStats | None) -> None:
        if stats is None:
            return
        point = (now, stats.prefill_tokens, stats.tokens_generated)
        if self.samples and (point[1] < self.samples[-1][1] or point[2] < self.samples[-1][2]):
            self.samples.clear()  # another engine (a model swap): its counters start again
        self.samples.append(point)
        while self.samples and now - self.samples[0][0] > self.keep_s:
            self.samples.popleft()

    def rates(self, now: float, window_s: float) -> tuple[float, float, float]:
        """(prefill tokens/s, decode tokens/s, seconds actually covered) over the last `window_s`."""
        inside = [p for p in self.samples if now - p[0] <= window_s]
        if len(inside) < 2:
            return 0.0, 0.0, 0.0
        (t0, p0, g0), (t1, p1, g1) = inside[0], inside[-1]
        span = t1 - t0
        return ((p1 - p0) / span, (g1 - g0) / span, span) if span > 0 else (0.0, 0.0, 0.0)


def lora_requests_info(d: dict[str, Any]) -> GaugeMetricFamily:
    """vLLM's `vllm:lora_requests_info`: one sample, the time of the snapshot, labelled with
    the adapters of running and of waiting requests (comma-separated) and max_lora."""
    family = GaugeMetricFamily("vllm:lora_requests_info", "running and waiting LoRA adapters",
                               labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    family.add_metric([",".join(d.get("running_lora_adapters") or ()), ",".join(d.get("waiting_lora_adapters") or ()),
                       str(d.get("max_loras") or 0)], time.time())
    return family


class _SnapshotCollector:
    """Renders the latest BatcherStats + ServerStats at scrape time."""

    def __init__(self, source: Callable[[], tuple[Any, ServerStats]],
                 model_card: Callable[[], Any] | None = None) -> None:
        self._source = source
        self._model_card = model_card

    def collect(self) -> Iterator[Any]:
        stats, server = self._source()
        card = self._model_card() if self._model_card is not None else None  # None until loaded
        yield GaugeMetricFamily("ferrox_synthetic_weights", "1 when the served weights are random "
                                "(--load-format dummy): outputs are meaningless",
                                value=float(bool(card is not None and card.synthetic_weights)))
        yield GaugeMetricFamily("ferrox_weights_bytes", "bytes of the model's arrays on the devices",
                                value=float(card.weights_bytes if card is not None else 0))
        yield GaugeMetricFamily("ferrox_kv_cache_bytes", "bytes of the KV cache (every block)",
                                value=float(card.kv_bytes if card is not None else 0))
        d = stats_dict(stats)
        for field, name, kind, doc in _BATCHER_METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=float(d.get(field) or 0))
        total, free = d.get("kv_blocks_total") or 0, d.get("kv_blocks_free") or 0
        yield GaugeMetricFamily("ferrox_kv_usage_fraction", "reserved KV blocks / total (0 when unbudgeted)",
                                value=(total - free) / total if total else 0.0)
        yield GaugeMetricFamily("ferrox_kv_free_tokens", "token positions in free KV blocks (kv_blocks_free x "
                                "block size): what a new request's prompt + max_tokens may still take",
                                value=float(free * (d.get("kv_block_size") or 0)))
        yield GaugeMetricFamily("ferrox_requests_waiting", "jobs waiting for admission",
                                value=float(d.get("queue_depth") or 0))
        yield GaugeMetricFamily("ferrox_requests_running", "rows holding a slot (prefilling or decoding)",
                                value=float(d.get("running_rows") or 0))
        yield lora_requests_info(d)
        yield CounterMetricFamily("ferrox_recompiles_after_warmup", "bucket compilations after warm-up",
                                  value=float(d.get("recompiles_after_warmup") or 0))
        faults = CounterMetricFamily("ferrox_step_faults", "engine steps that went wrong, by kind: the runner "
                                     "raised, a row's logits were non-finite, a step hung past the watchdog",
                                     labels=["kind"])
        for kind, count in snapshot_or_zeros(stats).step_faults_by_kind().items():
            faults.add_metric([kind], float(count))
        yield faults
        yield from _spec_decode_metrics(d)
        yield CounterMetricFamily("ferrox_requests", "HTTP requests (observability routes excluded)",
                                  value=float(server.requests_total))
        yield CounterMetricFamily("ferrox_request_errors", "requests answered >= 400 or ended by an error",
                                  value=float(server.errors_total))
        yield CounterMetricFamily("ferrox_prompt_tokens", "prompt tokens of served requests",
                                  value=float(server.tokens_prompt_total))
        yield CounterMetricFamily("ferrox_generation_tokens", "tokens generated for served requests",
                                  value=float(server.tokens_generated_total))


def _spec_decode_metrics(d: dict[str, Any]) -> Iterator[Any]:
    """Speculative decoding's counters under vLLM's names (0 while speculation is off)."""
    for field, doc in (("num_drafts", "row-steps that verified draft tokens"),
                       ("num_draft_tokens", "draft tokens verified"),
                       ("num_accepted_tokens", "draft tokens accepted")):
        yield CounterMetricFamily(f"vllm:spec_decode_{field}", doc, value=float(d.get(f"spec_decode_{field}") or 0))
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "draft tokens accepted, by draft position", labels=["position"])
    for position, count in enumerate(d.get("spec_decode_num_accepted_tokens_per_pos") or ()):
        per_pos.add_metric([str(position)], float(count))
    yield per_pos


class Metrics:
    """The app's Prometheus registry: snapshot counters plus latency histograms."""

    def __init__(self, source: Callable[[], tuple[Any, ServerStats]],
                 model_card: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(source, model_card))
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram("ferrox_time_to_first_token_seconds", "submit to first generated token",
                              buckets=latency, registry=self.registry)
        self.itl = Histogram("ferrox_inter_token_latency_seconds", "gap between generated tokens of a row",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                             registry=self.registry)
        self.e2e = Histogram("ferrox_e2e_request_latency_seconds", "submit to the last row's finish",
                             buckets=latency + (120.0, 300.0), registry=self.registry)
        # Observed from each job's first RowEvent, which carries the scheduler's own
        # measure of the wait (submit to admission).
        self.queue = Histogram("ferrox_queue_time_seconds", "time a job waited in the queue before admission",
                               buckets=latency, registry=self.registry)
        # The same four measurements under vLLM's names and buckets (vllm/v1/metrics/loggers.py:
        # the inter-token histogram shares the per-output-token buckets, queue time the request
        # latency buckets), so a PromQL query or a KEDA trigger written for vLLM reads these.
        labels = ("model_name", "engine")
        self._vllm = {
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=VLLM_TTFT_BUCKETS, registry=self.registry),
            "itl": Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=VLLM_ITL_BUCKETS, registry=self.registry),
            "e2e": Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=VLLM_REQUEST_BUCKETS, registry=self.registry),
            "queue": Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", labels,
                               buckets=VLLM_REQUEST_BUCKETS, registry=self.registry),
        }
        self._ours = {"ttft": self.ttft, "itl": self.itl, "e2e": self.e2e, "queue": self.queue}

    def observe(self, kind: str, seconds: float, model_name: str) -> None:
        """One measurement (`kind`: ttft, itl, e2e or queue) into its `ferrox_*` histogram and
        its `vllm:*` twin, labelled with the model that served it (engine 0: one engine per replica)."""
        self._ours[kind].observe(seconds)
        self._vllm[kind].labels(model_name, "0").observe(seconds)
