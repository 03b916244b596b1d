"""OpenTelemetry tracing against an in-process OTLP/HTTP collector: a tiny HTTP server that
decodes each `ExportTraceServiceRequest` (opentelemetry-proto) the real server's exporter
posts (and an OTLP/gRPC one for the grpc exporter). One span per request with its queue /
prefill / decode (and grammar compile) children inside it, the caller's W3C `traceparent`
as the parent, the GenAI attributes equal to the reply's own numbers; off by default with
no OpenTelemetry module imported; a clear start-up error when it is asked for and the SDK
is missing. Real Hypercorn server, the tiny engine."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from api.app import create_app
from api.config import ServerConfig
from api.state import state_of
from tests.support.server_harness import ServerThread, tiny_engine, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.paths: list[str] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                collector.paths.append(self.path)
                collector.spans += [span for rs in request.resource_spans for ss in rs.scope_spans
                                    for span in ss.spans]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, response_id: str) -> tuple[Span, list[Span]]:
        """The root span whose gen_ai.response.id is `response_id`, and its children."""
        root = next(s for s in self.spans if attrs(s).get("gen_ai.response.id") == response_id)
        return root, [s for s in self.spans if s.parent_span_id == root.span_id]


def attrs(span: Span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = [v.string_value for v in value.array_value.values] if kind == "array_value" \
            else getattr(value, kind)
    return out


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.server.shutdown()


@pytest.fixture(scope="module")
def app(collector):
    return create_app(tiny_engine(), ServerConfig(otlp_traces_endpoint=collector.url))


@pytest.fixture(scope="module")
def server(app):
    with ServerThread(app) as url:
        yield url


def traced(app, collector, response_id: str) -> tuple[Span, list[Span]]:
    assert state_of(app).tracing.flush(), "the exporter delivered the spans"
    wait_for(lambda: any(attrs(s).get("gen_ai.response.id") == response_id for s in collector.spans))
    return collector.trace(response_id)


def test_a_chat_request_is_one_span_with_its_phases_under_the_callers_trace(app, collector, http):
    r = http.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT}, json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "top_k": 7, "seed": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    reply = r.json()
    root, children = traced(app, collector, reply["id"])
    assert collector.paths[0] == "/v1/traces", "an endpoint without a path gets OTLP's"
    assert root.name == "POST /v1/chat/completions" and root.kind == Span.SPAN_KIND_SERVER
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID, "the caller's trace continues"
    a = attrs(root)
    model = http.get("/v1/models").json()["data"][0]["id"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == a["gen_ai.response.model"] == model
    assert a["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"],
            a["gen_ai.request.top_k"], a["gen_ai.request.seed"]) == (5, 0.5, pytest.approx(0.9), 7, 3)
    assert (a["http.route"], a["http.response.status_code"]) == ("/v1/chat/completions", 200)
    assert [c.name for c in children] == ["queue", "prefill", "decode"]
    for child in children:
        assert child.trace_id == root.trace_id and child.kind == Span.SPAN_KIND_INTERNAL
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano \
            <= root.end_time_unix_nano, f"{child.name} lies inside the request"
    queue, prefill, decode = children
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano and \
        prefill.end_time_unix_nano == decode.start_time_unix_nano, "the phases follow each other"
    assert a["gen_ai.latency.time_to_first_token"] * 1e9 == pytest.approx(
        decode.start_time_unix_nano - queue.start_time_unix_nano, abs=1e3), "TTFT = queue + prefill"


def test_without_traceparent_a_request_starts_a_trace_and_errors_are_marked(app, collector, http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                           "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    root, children = traced(app, collector, r.json()["id"])
    assert root.parent_span_id == b"" and root.trace_id.hex() != TRACE_ID
    assert attrs(root)["gen_ai.operation.name"] == "text_completion"
    assert [c.name for c in children][0] == "grammar compile", "a constrained request shows its compile"
    bad = http.post("/v1/chat/completions", headers={"traceparent": "00-zz-not-a-trace-01"},
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert bad.status_code == 200, "a malformed traceparent is ignored, not an error"
    root, _ = traced(app, collector, bad.json()["id"])
    assert root.parent_span_id == b""


@pytest.mark.parametrize("path, body, key", [
    ("/v1/messages", {"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}, "id"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}, "id")])
def test_every_wire_is_traced(app, collector, http, path, body, key):
    if path == "/v1/messages":
        body["model"] = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post(path, json=body, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200, r.text
    root, children = traced(app, collector, r.json()[key])
    assert root.name == f"POST {path}" and root.parent_span_id.hex() == PARENT_ID
    assert attrs(root)["gen_ai.usage.output_tokens"] >= 1 and "prefill" in [c.name for c in children]


def test_embeddings_are_traced_as_embeddings(app, collector, http):
    r = http.post("/v1/embeddings", json={"input": "Hi"})
    assert r.status_code == 200, r.text
    assert state_of(app).tracing.flush()
    wait_for(lambda: any(attrs(s).get("http.route") == "/v1/embeddings" for s in collector.spans))
    root = next(s for s in collector.spans if attrs(s).get("http.route") == "/v1/embeddings")
    children = [s for s in collector.spans if s.parent_span_id == root.span_id]
    assert attrs(root)["gen_ai.operation.name"] == "embeddings" and root.name == "POST /v1/embeddings"
    assert [c.name for c in children] == ["queue"], "a pooling job samples nothing: no prefill-to-token phases"


def test_the_grpc_exporter_reaches_a_grpc_collector():
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    spans: list[Span] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the service's name)
            spans.extend(span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans)
            return ExportTraceServiceResponse()

    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    try:
        app = create_app(tiny_engine(), ServerConfig(otlp_traces_endpoint=f"127.0.0.1:{port}",
                                                     otlp_traces_protocol="grpc"))
        with ServerThread(app) as url:
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                           headers={"traceparent": TRACEPARENT}, timeout=60)
            assert r.status_code == 200, r.text
            assert state_of(app).tracing.flush()
        wait_for(lambda: any(attrs(s).get("gen_ai.response.id") == r.json()["id"] for s in spans))
        root = next(s for s in spans if attrs(s).get("gen_ai.response.id") == r.json()["id"])
        assert root.name == "POST /v1/completions" and root.parent_span_id.hex() == PARENT_ID
    finally:
        receiver.stop(0)


def test_tracing_off_imports_no_opentelemetry():
    code = ("import sys\nfrom api.app import create_app\nfrom api.config import ServerConfig\n"
            "import api.generation, api.tracing\nServerConfig()\n"
            "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\nassert not loaded, loaded\n"
            "ServerConfig(otlp_traces_endpoint='http://127.0.0.1:4318')\n"
            "assert 'opentelemetry.sdk.trace' in sys.modules, 'the negative control: on, the SDK is imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_missing_sdk_is_a_clear_start_up_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ValueError, match=r"ServerConfig.otlp_traces_endpoint needs the OpenTelemetry SDK .*"
                                         r"pip install 'ferrox-jax\[otel\]'"):
        ServerConfig(otlp_traces_endpoint="http://127.0.0.1:4318")
    from api.settings import name_settings

    try:
        ServerConfig(otlp_traces_endpoint="http://127.0.0.1:4318")
    except ValueError as e:
        assert name_settings(str(e)).startswith("--otlp-traces-endpoint (FERROX_OTLP_TRACES_ENDPOINT) needs")


@pytest.mark.parametrize("fields, says", [
    (dict(otlp_traces_protocol="thrift"), "otlp_traces_protocol must be one of"),
    (dict(otlp_traces_endpoint="collector:4318"), "must be an http:// or https:// URL")])
def test_bad_tracing_settings_are_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        ServerConfig(**fields)
