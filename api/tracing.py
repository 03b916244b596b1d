"""OpenTelemetry traces of generation requests: one span per request, one child per phase.

Off by default, and then nothing here runs: `create_app` builds a `Tracing` only when
`--otlp-traces-endpoint` is set, and only then are the OpenTelemetry SDK and its OTLP
exporter imported (the `otel` extra). A request then costs one `None` check. On or off,
there is no per-token work: the spans are built once, when the request is recorded
(`GenerationRun.close`), from timestamps the generation core keeps anyway: when the
request started and was submitted, the scheduler's own queue time (the job's first
`RowEvent.queue_s`), the first and the last token. The engine has no OpenTelemetry in it.

    POST /v1/chat/completions   SERVER    start of the handler's run -> recorded
      queue                     INTERNAL  submitted -> admitted (submitted + queue time)
      prefill                   INTERNAL  admitted -> first token
      decode                    INTERNAL  first token -> last token
      grammar compile           INTERNAL  the output constraint's compile, when the request has one

Embeddings, rerank and score requests run through the same core and are traced alike.

The root span's parent is the incoming request's W3C `traceparent` (and `tracestate`) when it
has one, so a gateway's trace continues through this server; without one the span starts a
trace. Attributes follow the GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.request.max_tokens` / `temperature` / `top_p` / `top_k` /
`seed` / `choice.count`, `gen_ai.response.id` / `model` / `finish_reasons`,
`gen_ai.usage.input_tokens` / `output_tokens`), the HTTP ones (`http.request.method`,
`http.route`, `http.response.status_code`; status ERROR at 500 and above) and vLLM's latency
attributes (`gen_ai.latency.time_in_queue`, `time_to_first_token`, `e2e`, in seconds).

Export: a batch span processor (a background thread; a slow collector never blocks a
request) to an OTLP exporter over `http/protobuf` (the endpoint is a URL; one without a
path gets OTLP's `/v1/traces`) or `grpc` (`host:port` or a URL; plain text unless the URL
says https). Each app has its own TracerProvider, so nothing global is set and several
servers in one process trace apart; shutting the app down flushes what is queued.
"""

from __future__ import annotations

import time
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

# A run below is an `api.generation.GenerationRun`, read only; not imported, even for its
# type: `api.config` imports this module to check the settings, and the generation core
# imports the config through the app state.
GenerationRun = Any
PROTOCOLS = ("http/protobuf", "grpc")
SERVICE_NAME = "ferrox"
# gen_ai.operation.name by route: the chat wires, embeddings, and for the rest (completions,
# llama.cpp's /completion, rerank and score, which score prompts) text_completion.
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/messages": "chat", "/v1/responses": "chat",
               "/v1/embeddings": "embeddings"}


class TracingUnavailable(ValueError):
    """Tracing was asked for but the OpenTelemetry SDK or its exporter is not installed."""


def _load_sdk(protocol: str) -> dict[str, Any]:
    """The SDK's pieces, imported now (never when tracing is off)."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        package = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else \
            "opentelemetry-exporter-otlp-proto-http"
        raise TracingUnavailable(
            f"ServerConfig.otlp_traces_endpoint needs the OpenTelemetry SDK and its OTLP exporter "
            f"({e.name or 'a module'} is missing): install the server's otel extra "
            f"(pip install 'ferrox-jax[otel]', or opentelemetry-sdk and {package}), or leave the endpoint unset"
        ) from None
    return dict(trace=trace, Resource=Resource, TracerProvider=TracerProvider, BatchSpanProcessor=BatchSpanProcessor,
                Propagator=TraceContextTextMapPropagator, Exporter=OTLPSpanExporter)


def check_available(protocol: str) -> None:
    """Raises TracingUnavailable now (at start-up) if tracing over `protocol` cannot run."""
    _load_sdk(protocol)


def exporter_endpoint(endpoint: str, protocol: str) -> str:
    """The URL the exporter is given: OTLP/HTTP's `/v1/traces` when the URL has no path."""
    if protocol != "http/protobuf":
        return endpoint
    parts = urlsplit(endpoint)
    return urlunsplit(parts._replace(path="/v1/traces")) if parts.path in ("", "/") else endpoint


class Tracing:
    """The app's tracer: OTLP export, and the spans of one finished run (`record`)."""

    def __init__(self, endpoint: str, protocol: str = "http/protobuf") -> None:
        sdk = _load_sdk(protocol)
        self._trace = sdk["trace"]
        self._provider = sdk["TracerProvider"](resource=sdk["Resource"].create({"service.name": SERVICE_NAME}))
        kwargs: dict[str, Any] = {"endpoint": exporter_endpoint(endpoint, protocol)}
        if protocol == "grpc":
            kwargs["insecure"] = not endpoint.startswith("https://")
        self._provider.add_span_processor(sdk["BatchSpanProcessor"](sdk["Exporter"](**kwargs)))
        self._tracer = self._provider.get_tracer("ferrox_jax.api")
        self._propagator = sdk["Propagator"]()

    def parent(self, headers: Mapping[str, str]) -> Any:
        """The trace context a request's `traceparent` / `tracestate` headers carry (an empty
        context when they carry none, or a malformed one)."""
        return self._propagator.extract({key.lower(): value for key, value in headers.items()})

    def record(self, run: GenerationRun, ended_at: float) -> None:
        """The spans of `run`, which ended at `ended_at` (monotonic seconds)."""
        offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock, as the spans carry it

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        kind = self._trace.SpanKind
        root = self._tracer.start_span(f"POST {run.route}", context=run.trace_parent, kind=kind.SERVER,
                                       start_time=ns(run.started_at), attributes=attributes(run, ended_at))
        inside = self._trace.set_span_in_context(root)
        for name, start, end in phases(run):
            self._tracer.start_span(name, context=inside, kind=kind.INTERNAL, start_time=ns(start)).end(ns(end))
        if run.status >= 500:
            root.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        root.end(ns(ended_at))

    def flush(self, timeout_ms: int = 30_000) -> bool:
        """Export what is queued now; True when it all went."""
        return self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush and stop the export thread (the app's end)."""
        self._provider.shutdown()


def phases(run: GenerationRun) -> list[tuple[str, float, float]]:
    """(name, start, end) of the run's child spans, in monotonic seconds, the empty ones left out."""
    out = []
    if run.grammar_compile_s is not None:
        out.append(("grammar compile", run.grammar_compile_s[0], run.grammar_compile_s[1]))
    if run.num_submitted and run.cache_status != "hit":  # a cache hit never queued nor computed
        admitted = run.submitted_at + run.queue_s
        out.append(("queue", run.submitted_at, admitted))
        if run.first_token_at is not None:
            out.append(("prefill", admitted, max(admitted, run.first_token_at)))
            if run.last_token_at is not None and run.last_token_at > run.first_token_at:
                out.append(("decode", run.first_token_at, run.last_token_at))
    return out


def attributes(run: GenerationRun, ended_at: float) -> dict[str, Any]:
    """The root span's attributes (module docstring)."""
    job = run.jobs[0]
    sampling = job.sampling
    engine = run.engine
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": _OPERATIONS.get(run.route, "text_completion"),
        "gen_ai.provider.name": SERVICE_NAME,
        "gen_ai.request.model": run.model or (engine.model_name if engine is not None else ""),
        "gen_ai.request.max_tokens": job.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.choice.count": job.n,
        "gen_ai.response.id": run.api_id,
        "gen_ai.usage.input_tokens": run.num_prompt_tokens,
        "gen_ai.usage.output_tokens": run.num_completion_tokens,
        "gen_ai.response.finish_reasons": [reason or "" for reason in run.finish_reasons],
        "gen_ai.latency.time_in_queue": run.queue_s,
        "gen_ai.latency.e2e": ended_at - run.started_at,
        "http.request.method": "POST",
        "http.route": run.route,
        "http.response.status_code": run.status,
    }
    if engine is not None:
        attrs["gen_ai.response.model"] = engine.model_name
    if sampling.top_k:
        attrs["gen_ai.request.top_k"] = sampling.top_k
    if sampling.seed is not None:
        attrs["gen_ai.request.seed"] = sampling.seed
    if run.first_token_at is not None:
        attrs["gen_ai.latency.time_to_first_token"] = run.first_token_at - run.submitted_at
    return attrs
