"""Schema-driven fuzzing of every route in /openapi.json with schemathesis, against a real server.

The document the server serves (api/openapi.py) is loaded into schemathesis; for each
operation, Hypothesis draws bodies, path and query values that fit its schema (positive)
and, for operations with a body, bodies that break it (negative), derandomized so a run
is the same every time. Each response must: not be a 5xx (a 501 only where the document
lists it), have a status the document lists, have a content type and body that fit the
document (the error statuses carry their protocol's envelope: OpenAI's, Anthropic's
under /v1/messages, llama.cpp's on /completion), and, for a body that breaks the schema,
be a 4xx. After every operation the server must still answer /health, and once idle, every
KV block is back in the budget.

The server is the shared tiny engine with small limits (16 output tokens, n <= 2), so no
drawn request runs long. Routes that change what the server serves (unload, sleep,
prepare-stop, cache rebuild: `x-ferrox-destructive`) are fuzzed on their own server, last.
The CI size is FUZZ_EXAMPLES examples per operation and mode; `FERROX_FUZZ_EXAMPLES=200`
runs the longer fuzz docs/operations.md describes.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from api.app import create_app
from api.config import ServerConfig
from api.openapi import DESTRUCTIVE, build_spec
from api.state import VERSION
from tests.support.server_harness import ServerThread, tiny_engine, wait_for

FUZZ_EXAMPLES = int(os.environ.get("FERROX_FUZZ_EXAMPLES", "4"))
SPEC = build_spec(VERSION)
# The fuzzed server has no API key (tests/server/test_api_security.py covers the key on every
# route): without the document's global bearer requirement, negative cases do not "break"
# the request by leaving out an Authorization header the server never asks for.
SCHEMA = schemathesis.openapi.from_dict({**SPEC, "security": []})
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
LABELS = [op.label for op in OPERATIONS if op.path not in DESTRUCTIVE]
DESTRUCTIVE_LABELS = [op.label for op in OPERATIONS if op.path in DESTRUCTIVE]
CONFIG = dict(max_output_tokens=16, max_n=2, max_logprobs=4, max_prompt_tokens=512)


def _server_config() -> ServerConfig:
    return ServerConfig(**CONFIG)


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with ServerThread(create_app(engine, _server_config())) as url:
        yield url, engine


def test_the_served_document_is_the_fuzzed_one_and_names_every_route(server):
    url, _ = server
    assert httpx.get(url + "/openapi.json").json() == SPEC
    app = create_app(lambda: None, _server_config())
    routes = {(method.lower(), rule.rule.replace("<path:", "{").replace("<", "{").replace(">", "}"))
              for rule in app.url_map.iter_rules() for method in rule.methods - {"HEAD", "OPTIONS"}
              if not rule.rule.startswith("/static/") and not rule.endpoint.startswith("web.")}  # pages, not API
    documented = {(method, path) for path, ops in SPEC["paths"].items() for method in ops}
    assert routes - documented == set(), "routes missing from /openapi.json"
    assert documented - routes == set(), "/openapi.json documents routes the app lacks"


def _fuzz(url: str, label: str, mode: GenerationMode) -> None:
    operation = SCHEMA.find_operation_by_label(label)
    documented = set(operation.definition.raw["responses"])
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    if mode == GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)

    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=url, timeout=60)
        status = response.status_code
        assert status < 500 or (status == 501 and "501" in documented), (
            f"{label} answered {status}: {response.text[:500]}\n{case.as_curl_command()}")
        case.validate_response(response, checks=checks)

    run()
    assert httpx.get(url + "/health", timeout=30).status_code == 200, f"/health after fuzzing {label}"


@pytest.mark.parametrize("label", LABELS)
def test_fuzz_route(server, label):
    url, _ = server
    _fuzz(url, label, GenerationMode.POSITIVE)
    if "requestBody" in SCHEMA.find_operation_by_label(label).definition.raw:
        _fuzz(url, label, GenerationMode.NEGATIVE)


def test_no_kv_block_leaks_after_the_fuzz(server):
    url, engine = server

    def idle():
        s = httpx.get(url + "/admin/stats").json()
        return s["generating_now"] == 0 and s["queue_depth"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]

    wait_for(idle, timeout_s=30)


@pytest.mark.parametrize("label", DESTRUCTIVE_LABELS)
def test_fuzz_destructive_route(label):
    """Each on a fresh server over a fresh engine (a sleep or unload would stop the shared one)."""
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from tests.support.server_harness import api_checkpoint

    engine = Engine.load(EngineConfig(model=str(api_checkpoint()), dtype="float32", block_size=16, kv_blocks=64,
                                      max_seqs=2, max_queue=8, prefill_chunk=32, max_context=256))
    engine.warmup()
    engine.start()
    try:
        with ServerThread(create_app(engine, _server_config())) as url:
            operation = SCHEMA.find_operation_by_label(label)
            documented = set(operation.definition.raw["responses"])

            @settings(max_examples=2, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=operation.as_strategy())
            def run(case):
                response = case.call(base_url=url, timeout=60)
                assert response.status_code < 500 or str(response.status_code) in documented, response.text[:500]
                case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                                          response_schema_conformance])

            run()
            assert httpx.get(url + "/admin/stats", timeout=30).status_code == 200
    finally:
        engine.shutdown()
