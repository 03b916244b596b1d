"""Writes docs/grafana-dashboard.json: a Grafana dashboard over ferrox's `/metrics`.

    python -m tools.docs.grafana_dashboard            # rewrite docs/grafana-dashboard.json
    python -m tools.docs.grafana_dashboard --check    # exit 1 if the file differs from this spec

The panels are the live dashboard's (`api/web/`), read from a Prometheus server that
scrapes `/metrics`: output and prompt tokens/s, TTFT and inter-token latency percentiles,
end-to-end and queue-time percentiles, running rows and queue depth, KV blocks used /
cached / free, the prefix-cache hit rate, request and error rates, refusals, and the
start-up facts (weights and KV bytes, recompiles after warm-up, synthetic weights).
Every query sums over the instances the `instance` variable selects, so one dashboard
shows a single server or a fleet of replicas. Import it in Grafana (Dashboards -> New ->
Import) and pick the Prometheus data source at the `DS_PROMETHEUS` prompt.

tests/tools/test_grafana_dashboard.py checks that the file is this spec's output and that every
metric a query names is one a running server exports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = '{instance=~"$instance"}'  # every query's selector
RATE = "$__rate_interval"


def rate(metric: str) -> str:
    return f"sum(rate({metric}{SEL}[{RATE}]))"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{SEL}[{RATE}])))"


def gauge(metric: str) -> str:
    return f"sum({metric}{SEL})"


def percentiles(histogram: str) -> list[tuple[str, str]]:
    return [(f"p{round(q * 100)}", quantile(q, histogram)) for q in (0.5, 0.9, 0.99)]


# (title, unit, [(legend, expr)], width, kind)
ROWS: list[list[tuple[str, str, list[tuple[str, str]], int, str]]] = [
    [
        ("Output tokens/s", "none", [("output", rate("ferrox_tokens_generated_total"))], 4, "stat"),
        ("Prompt tokens/s", "none", [("prompt", rate("ferrox_prefill_tokens_total"))], 4, "stat"),
        ("Running rows", "none", [("running", gauge("ferrox_requests_running"))], 4, "stat"),
        ("Queue depth", "none", [("waiting", gauge("ferrox_scheduler_queue_depth"))], 4, "stat"),
        ("KV blocks used", "percentunit",
         [("used", f"1 - {gauge('ferrox_kv_blocks_free')} / {gauge('ferrox_kv_blocks_total')}")], 4, "stat"),
        ("Prefix-cache hit rate", "percentunit",
         [("hits", f"{rate('ferrox_prefix_cache_hits_total')} / {rate('ferrox_prefix_cache_queries_total')}")],
         4, "stat"),
    ],
    [
        ("Throughput", "tokens/s (rate)", [("output", rate("ferrox_tokens_generated_total")),
                                            ("prompt", rate("ferrox_prefill_tokens_total"))], 12, "timeseries"),
        ("Time to first token", "s", percentiles("ferrox_time_to_first_token_seconds"), 12, "timeseries"),
    ],
    [
        ("Inter-token latency", "s", percentiles("ferrox_inter_token_latency_seconds"), 12, "timeseries"),
        ("End-to-end latency and queue time", "s",
         [("e2e p50", quantile(0.5, "ferrox_e2e_request_latency_seconds")),
          ("e2e p99", quantile(0.99, "ferrox_e2e_request_latency_seconds")),
          ("queue p50", quantile(0.5, "ferrox_queue_time_seconds")),
          ("queue p99", quantile(0.99, "ferrox_queue_time_seconds"))], 12, "timeseries"),
    ],
    [
        ("Scheduler", "none", [("running rows", gauge("ferrox_requests_running")),
                               ("queue depth", gauge("ferrox_scheduler_queue_depth"))], 12, "timeseries"),
        ("KV blocks", "none", [("used", f"{gauge('ferrox_kv_blocks_total')} - {gauge('ferrox_kv_blocks_free')}"),
                               ("cached", gauge("ferrox_kv_blocks_cached")),
                               ("free", gauge("ferrox_kv_blocks_free")),
                               ("peak", gauge("ferrox_kv_blocks_peak"))], 12, "timeseries"),
    ],
    [
        ("Prefix-cache hit rate", "percentunit",
         [("hit rate", f"{rate('ferrox_prefix_cache_hits_total')} / {rate('ferrox_prefix_cache_queries_total')}")],
         8, "timeseries"),
        ("Requests and errors", "reqps", [("requests", rate("ferrox_requests_total")),
                                          ("errors", rate("ferrox_request_errors_total"))], 8, "timeseries"),
        ("Refusals and cancellations", "reqps",
         [("queue full", rate("ferrox_scheduler_queue_rejected_total")),
          ("too large", rate("ferrox_kv_rejected_too_large_total")),
          ("context length", rate("ferrox_kv_rejected_context_length_total")),
          ("cancelled", rate("ferrox_scheduler_aborted_total"))], 8, "timeseries"),
    ],
    [
        ("Weights", "bytes", [("weights", gauge("ferrox_weights_bytes"))], 6, "stat"),
        ("KV cache", "bytes", [("KV cache", gauge("ferrox_kv_cache_bytes"))], 6, "stat"),
        ("Recompiles after warm-up", "none", [("recompiles", gauge("ferrox_recompiles_after_warmup_total"))],
         6, "stat"),
        ("Synthetic weights", "none", [("synthetic", gauge("ferrox_synthetic_weights"))], 6, "stat"),
    ],
]

ROW_HEIGHT = {"stat": 4, "timeseries": 8}


def panel(panel_id: int, x: int, y: int, title: str, unit: str, targets: list[tuple[str, str]], width: int,
          kind: str) -> dict:
    axis_unit = unit if unit in ("s", "bytes", "percentunit", "reqps", "none") else "none"
    out = {
        "id": panel_id, "type": kind, "title": title, "datasource": DATASOURCE,
        "gridPos": {"h": ROW_HEIGHT[kind], "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": axis_unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for i, (legend, expr) in enumerate(targets)],
    }
    if kind == "timeseries":
        out["fieldConfig"]["defaults"]["custom"] = {"lineWidth": 2, "fillOpacity": 8, "showPoints": "never"}
        out["options"] = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                          "tooltip": {"mode": "multi"}}
        if axis_unit != unit:
            out["fieldConfig"]["defaults"]["custom"]["axisLabel"] = unit
    else:
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value", "graphMode": "area"}
    return out


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    for row in ROWS:
        x = 0
        for title, unit, targets, width, kind in row:
            panels.append(panel(next_id, x, y, title, unit, targets, width, kind))
            next_id += 1
            x += width
        y += max(ROW_HEIGHT[kind] for *_, kind in row)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus",
                      "description": "the Prometheus server that scrapes ferrox's /metrics"}],
        "__requires": [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
                       {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}],
        "title": "ferrox_jax", "uid": "ferrox-jax", "description": "ferrox_jax serving: throughput, latency, "
        "scheduler, KV cache (generated by tools/docs/grafana_dashboard.py)",
        "tags": ["ferrox", "llm", "inference"], "timezone": "browser", "schemaVersion": 39, "version": 1,
        "editable": True, "graphTooltip": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{
            "name": "instance", "label": "instance", "type": "query", "datasource": DATASOURCE,
            "query": {"query": "label_values(ferrox_kv_blocks_total, instance)", "refId": "instance"},
            "definition": "label_values(ferrox_kv_blocks_total, instance)", "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}}]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not this spec's output")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python -m tools.docs.grafana_dashboard", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(dashboard()['panels'])} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
