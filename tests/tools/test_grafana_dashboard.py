"""docs/grafana-dashboard.json: generated from tools/docs/grafana_dashboard.py, and every metric
its queries name is one a running server exports at /metrics (Grafana itself is not
installable here: Debian has no Grafana package and PyPI no Grafana server; so the queries
are checked against what the server really exports, not rendered).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.config import ServerConfig
from tests.support.server_harness import ServerThread, tiny_engine
from tools.docs import grafana_dashboard

# PromQL words that look like metric names in an expression.
PROMQL_WORDS = {"sum", "rate", "by", "le", "histogram_quantile", "instance", "label_values", "irate", "avg", "max",
                "min", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (label names, functions and keywords left out)."""
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_labels)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_ranges))
    return {n for n in names if n not in PROMQL_WORDS and not n.startswith("__")}


def exported_samples(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture(scope="module")
def exported():
    with ServerThread(create_app(tiny_engine(), ServerConfig())) as url:
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)  # fill the histograms
        yield exported_samples(url)


def dashboard() -> dict:
    return json.loads(grafana_dashboard.OUT.read_text())


def test_the_file_is_the_generators_output():
    assert grafana_dashboard.main(["--check"]) == 0, "run python -m tools.docs.grafana_dashboard"


def test_every_queried_metric_is_exported(exported):
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    queried = set().union(*(metric_names(e) for e in exprs))
    assert {"ferrox_tokens_generated_total", "ferrox_time_to_first_token_seconds_bucket",
            "ferrox_kv_blocks_cached", "ferrox_prefix_cache_hits_total"} <= queried
    assert not queried - exported, f"the dashboard queries metrics /metrics does not export: {queried - exported}"
    variable = dashboard()["templating"]["list"][0]["query"]["query"]
    assert metric_names(variable) <= exported


def test_the_name_check_catches_a_misspelt_metric(exported):
    assert metric_names('sum(rate(ferrox_tokens_generatd_total{instance=~"$instance"}[5m]))') - exported == \
        {"ferrox_tokens_generatd_total"}


def test_panels_are_well_formed():
    board = dashboard()
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["type"] in ("stat", "timeseries")
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, f"{p['title']} overflows the 24-column grid"
        assert [t["refId"] for t in p["targets"]] == [chr(ord("A") + i) for i in range(len(p["targets"]))]
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert '{instance=~"$instance"}' in expr, f"{p['title']}: every query follows the instance variable"
    assert board["__inputs"][0]["name"] == "DS_PROMETHEUS"
