"""The serving benchmark's report: vLLM's metrics over a run's results, the table, the JSON.

`tools/bench/bench_serving.py` drives the server and hands its per-request results here:
`compute_metrics` (the definitions are vLLM's, listed in bench_serving's docstring),
`format_table` (stdout) and `build_result` (everything one `--result-json` file holds).
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from tools.bench import bench_workloads
from tools.bench.bench_prompts import BenchRequest

if TYPE_CHECKING:
    from tools.bench.bench_serving import BenchConfig, RequestResult

# Every metric of a result, in order (compute_metrics asserts it).
RESULT_METRICS = (
    "duration_s", "completed", "num_failed", "total_input_tokens", "total_output_tokens",
    "num_output_len_mismatch", "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p90", "p99")),
    "errors",
)
_MAX_ERRORS_KEPT = 5


def _stats(prefix: str, values_s: Sequence[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"{s}_{prefix}_ms": None for s in ("mean", "median", "std", "p90", "p99")}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
            f"std_{prefix}_ms": float(ms.std()), f"p90_{prefix}_ms": float(np.percentile(ms, 90)),
            f"p99_{prefix}_ms": float(np.percentile(ms, 99))}


def compute_metrics(requests: Sequence[BenchRequest], results: Sequence[RequestResult],
                    duration_s: float) -> dict[str, Any]:
    """The vLLM serving metrics over the successful requests; failures only counted."""
    ok = [(q, r) for q, r in zip(requests, results) if r.success]
    input_tokens = sum(r.prompt_len_tokens or 0 for _, r in ok)
    output_tokens = sum(r.output_tokens for _, r in ok)
    tpots = [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for _, r in ok
             if r.output_tokens > 1 and r.ttft_s is not None]
    metrics: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "num_failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "num_output_len_mismatch": sum(r.output_tokens != q.output_len_tokens for q, r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        **_stats("ttft", [r.ttft_s for _, r in ok if r.ttft_s is not None]),
        **_stats("tpot", tpots),
        **_stats("itl", [gap for _, r in ok for gap in r.itl_s]),
        **_stats("e2el", [r.e2el_s for _, r in ok]),
        "errors": [r.error for r in results if r.error][:_MAX_ERRORS_KEPT],
    }
    assert tuple(metrics) == RESULT_METRICS, "RESULT_METRICS lists every metric, in order"
    return metrics


def format_table(cfg: BenchConfig, metrics: dict[str, Any]) -> str:
    def num(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    rows = [("Label", cfg.label), ("Concurrency cap", cfg.max_concurrency or "none"),
            ("Request rate (req/s)", cfg.request_rate),
            ("Successful requests", metrics["completed"]), ("Failed requests", metrics["num_failed"]),
            ("Benchmark duration (s)", metrics["duration_s"]),
            ("Total input tokens", metrics["total_input_tokens"]),
            ("Total generated tokens", metrics["total_output_tokens"]),
            ("Output length mismatches", metrics["num_output_len_mismatch"]),
            ("Request throughput (req/s)", metrics["request_throughput"]),
            ("Output token throughput (tok/s)", metrics["output_throughput"]),
            ("Total token throughput (tok/s)", metrics["total_token_throughput"])]
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<44}{num(v):>16}" for k, v in rows]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{:-^60}".format(title))
        for stat, word in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{word} {name.upper()} (ms)':<44}{num(metrics[f'{stat}_{name}_ms']):>16}")
    lines += bench_workloads.format_summary(metrics.get("workload_summary"))
    for err in metrics["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def build_result(cfg: BenchConfig, model: str | None, tokens_from: str, requests: Sequence[BenchRequest],
                 results: Sequence[RequestResult], metrics: dict[str, Any]) -> dict[str, Any]:
    """Parameters, metrics and per-request detail: everything one JSON file holds."""
    params = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("progress", "result_json")}
    params["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate  # JSON has no inf
    now = datetime.now(timezone.utc)
    return {
        "timestamp": now.isoformat(timespec="seconds"), **params, "model": model,
        "prompt_tokens_from": tokens_from, **metrics,
        "input_lens": [r.prompt_len_tokens for r in results],
        "requested_output_lens": [q.output_len_tokens for q in requests],
        "output_lens": [r.output_tokens for r in results],
        "output_tokens_from": [r.output_tokens_from for r in results],
        "ttfts_ms": [None if r.ttft_s is None else r.ttft_s * 1e3 for r in results],
        "e2els_ms": [None if r.e2el_s is None else r.e2el_s * 1e3 for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "request_errors": [r.error for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "groups": [q.group for q in requests],
        "turns": [q.turn for q in requests],
    }
