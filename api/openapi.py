"""The OpenAPI 3.1 document `/openapi.json` serves: every route, its body, its errors' envelope.

Complete enough that a schema-driven fuzzer (schemathesis, tests/server/test_fuzz_schemathesis.py)
drives every route with real bodies: each POST names its request schema (the pydantic
model the handler parses, or a small JSON schema for the handlers that read a dict), each
operation lists the statuses it answers and, for each error status, the envelope of its
protocol (OpenAI `ErrorResponse`; Anthropic's `{"type": "error", "error": {...}}` under
/v1/messages; llama.cpp's `{"error": {"code", "message", "type"}}` on /completion,
/completions and /slots). Streaming routes declare `text/event-stream` beside JSON.
Route modules are imported when the document is built, not at import time (they import
this package's state). The web pages (`--web-ui`) are not API routes and are left out.
"""

from __future__ import annotations

from typing import Any

ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
LLAMACPP_ERROR = {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "object", "required": ["code", "message", "type"],
              "properties": {"code": {"type": "integer"}, "message": {"type": "string"},
                             "type": {"type": "string"}}}}}

_WHY = {"400": "invalid request", "401": "invalid or missing API key",
        "403": "forbidden by a server setting, or sent by a page on another origin",
        "404": "unknown model, adapter, task or request", "409": "conflicts with work in progress",
        "413": "body too large", "415": "body not declared as JSON",
        "421": "a Host name this server does not answer to", "429": "rate limited",
        "501": "not supported by this server", "503": "overloaded, loading, sleeping or draining"}
_BODY_ERRORS = ("400", "413")  # every route with a body
_ALWAYS = ("401", "421", "429", "503")
_WRITES = ("403", "415")  # every route but GET: the browser rules of api/same_origin.py
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _obj(required: tuple[str, ...] = (), **properties: Any) -> dict:
    return {"type": "object", "properties": properties, "required": list(required)}


_STR = {"type": "string"}
LORA_LOAD = _obj(("lora_name", "lora_path"), lora_name=_STR, lora_path=_STR)
LORA_UNLOAD = _obj(("lora_name",), lora_name=_STR)
MODEL_LOAD = _obj(("model",), model=_STR)
PREPARE_STOP = _obj(wait={"type": "boolean"}, timeout_s={"type": "number", "minimum": 0})
CACHE_REBUILD = _obj(kv_blocks={"type": "integer"}, block_size={"type": "integer"},
                     kv_memory_gib={"type": "number"}, max_seqs={"type": "integer"})


def _routes() -> list[tuple]:
    """(method, path, summary, request schema, 200 schema, envelope, extra statuses, options)."""
    from api import protocol
    from api.anthropic_routes import CountTokensRequest, MessagesRequest
    from api.embeddings_routes import EmbeddingRequest
    from api.llamacpp_routes import LlamaCompletionRequest
    from api.rerank_routes import RerankRequest, ScoreRequest
    from api.responses_routes import ResponsesRequest

    p = protocol
    o, a, l = "openai", "anthropic", "llamacpp"
    stream = {"stream": True}
    routes = [
        ("get", "/v1/models", "List the served model and its adapters", None, p.ModelList, o, (), {}),
        ("get", "/v1/models/{name}", "One model card (the served model or an adapter)", None, None, o, ("404",), {}),
        ("post", "/v1/completions", "Text completion (stream with `stream: true`)", p.CompletionRequest,
         p.CompletionResponse, o, ("404",), stream),
        ("post", "/v1/chat/completions", "Chat completion (stream with `stream: true`)", p.ChatCompletionRequest,
         p.ChatCompletionResponse, o, ("404",), stream),
        ("post", "/v1/cancel", "Cancel an in-flight request by its request_id", p.CancelRequest, p.CancelResponse,
         o, ("404",), {}),
        ("post", "/v1/responses", "OpenAI Responses (stream with `stream: true`)", ResponsesRequest, None, o,
         ("404",), stream),
        ("get", "/v1/responses/{response_id}", "An in-flight response", None, None, o, ("404",), {}),
        ("post", "/v1/responses/{response_id}/cancel", "Cancel an in-flight response", None, None, o, ("404",), {}),
        ("post", "/v1/messages", "Anthropic Messages (stream with `stream: true`)", MessagesRequest, None, a,
         ("404",), stream),
        ("post", "/v1/messages/count_tokens", "Anthropic token count", CountTokensRequest, None, a, ("404",), {}),
        ("post", "/v1/embeddings", "Embeddings (mean or last pooling, L2-normalised)", EmbeddingRequest, None, o,
         ("404",), {}),
        ("post", "/v1/rerank", "Rerank documents against a query", RerankRequest, None, o, ("404",), {}),
        ("post", "/rerank", "Rerank documents against a query", RerankRequest, None, o, ("404",), {}),
        ("post", "/v1/score", "Score text pairs", ScoreRequest, None, o, ("404",), {}),
        ("post", "/completion", "llama.cpp native completion", LlamaCompletionRequest, None, l, ("404",), stream),
        ("post", "/completions", "llama.cpp native completion", LlamaCompletionRequest, None, l, ("404",), stream),
        ("get", "/slots", "llama.cpp's slots", None, None, l, (), {"query": {"fail_on_no_slot": _STR}}),
        ("post", "/v1/tokenize", "Tokenize a prompt (or chat messages)", p.TokenizeRequest, p.TokenizeResponse, o,
         ("404",), {}),
        ("post", "/tokenize", "Tokenize a prompt (or chat messages)", p.TokenizeRequest, p.TokenizeResponse, o,
         ("404",), {}),
        ("post", "/v1/detokenize", "Token ids to text", p.DetokenizeRequest, p.DetokenizeResponse, o, ("404",), {}),
        ("post", "/detokenize", "Token ids to text", p.DetokenizeRequest, p.DetokenizeResponse, o, ("404",), {}),
        ("get", "/tokenizer_info", "The tokenizer's configuration (vLLM's shape)", None, None, o, (), {}),
        ("get", "/v1/stream/{request_id}", "Resume a resumable stream (Last-Event-ID)", None, None, o, ("404",),
         {"sse": True}),
        ("get", "/v1/stream/{request_id}/poll", "A resumable stream's events as JSON", None, None, o, ("404",), {}),
        ("post", "/v1/load_lora_adapter", "Load a PEFT adapter from --model-dir", LORA_LOAD, None, o,
         ("403", "404", "409", "501"), {"text": True}),
        ("post", "/v1/unload_lora_adapter", "Unload an adapter", LORA_UNLOAD, None, o, ("403", "404", "501"),
         {"text": True}),
        ("get", "/health", "Liveness/readiness: 200 only when ready", None, None, o, (), {"open": True}),
        ("get", "/metrics", "Prometheus metrics", None, None, o, (), {"open": True, "plain": True}),
        ("get", "/admin/stats", "Batcher and server counters as JSON", None, None, o, (), {}),
        ("get", "/v1/stats", "Windowed throughput, latency, KV and memory", None, None, o, ("400",),
         {"query": {"window": {"type": "integer"}}}),
        ("get", "/v1/requests", "The recent-request ring, paged by since and limit", None, None, o, ("400",),
         {"query": {"since": {"type": "integer"}, "limit": {"type": "integer"}}}),
        ("get", "/v1/cache/status", "Prefix-cache occupancy", None, None, o, (), {}),
        ("get", "/cache/stats", "Prefix-cache counters", None, None, o, (), {}),
        ("get", "/admin/models", "Local checkpoints and the loaded model", None, None, o, (), {}),
        ("post", "/admin/models/load", "Load a listed checkpoint in the background (202 + task)", MODEL_LOAD, None,
         o, ("404", "409", "501"), {"accepted": True}),
        ("post", "/admin/models/unload", "Unload the model (generation then answers 503)", None, None, o, ("409",),
         {"destructive": True}),
        ("get", "/admin/tasks", "Model load and unload tasks", None, None, o, (), {}),
        ("get", "/admin/tasks/{task_id}", "One load or unload task", None, None, o, ("404",), {}),
        ("post", "/admin/tasks/{task_id}/cancel", "Cancel a pending or running load", None, None, o, ("404", "409"),
         {}),
        ("get", "/admin/download", "Always 501: checkpoints must be local", None, None, o, ("501",), {}),
        ("post", "/admin/download", "Always 501: checkpoints must be local", None, None, o, ("501",), {}),
        ("post", "/v1/cache/rebuild", "Rebuild the KV cache with a new geometry", CACHE_REBUILD, None, o,
         ("400", "409"), {"destructive": True}),
        ("post", "/v1/admin/prepare-stop", "Seal the server for a rolling restart (then 503 draining)",
         PREPARE_STOP, None, o, (), {"destructive": True, "accepted": True}),
        ("post", "/sleep", "Free the engine's device memory (generation answers 503 until /wake_up)", None, None, o,
         ("400",), {"destructive": True, "query": {"level": {"type": "integer"}}}),
        ("post", "/wake_up", "Bring a sleeping engine back", None, None, o, (), {"destructive": True}),
        ("get", "/is_sleeping", "Whether the engine sleeps", None, None, o, (), {}),
        # what routers poll (api/router_routes.py)
        ("get", "/version", "The server version (vLLM's shape)", None, None, o, (), {}),
        ("get", "/server_info", "Model, parallelism and capacity (SGLang's shape)", None, None, o, (), {}),
        ("get", "/get_server_info", "Model, parallelism and capacity (SGLang's shape)", None, None, o, (), {}),
        ("get", "/model_info", "The model (SGLang's shape)", None, None, o, (), {}),
        ("get", "/get_model_info", "The model (SGLang's shape)", None, None, o, (), {}),
        ("get", "/v1/loads", "Load per data-parallel rank (SGLang's shape)", None, None, o, (), {}),
        ("get", "/get_load", "Running plus waiting requests as one number", None, None, o, (), {}),
        ("get", "/openapi.json", "This document", None, None, o, (), {}),
    ]
    return routes


DESTRUCTIVE = {"/admin/models/unload", "/v1/cache/rebuild", "/v1/admin/prepare-stop", "/sleep", "/wake_up"}


def build_spec(version: str) -> dict:
    """OpenAPI 3.1 document built from the pydantic models' JSON schemas."""
    from api import protocol

    schemas: dict = {"AnthropicError": ANTHROPIC_ERROR, "LlamaCppError": LLAMACPP_ERROR}
    _add_schema(protocol.ErrorResponse, schemas)
    paths: dict = {}
    for method, path, summary, req, resp, envelope, extra, options in _routes():
        paths.setdefault(path, {})[method] = _operation(method, path, summary, req, resp, envelope, extra,
                                                        options, schemas)
    return {
        "openapi": "3.1.0",
        "info": {"title": "ferrox_jax", "version": version,
                 "description": "OpenAI-compatible LLM inference server on JAX"},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


def _operation(method: str, path: str, summary: str, req: Any, resp: Any, envelope: str, extra: tuple,
               options: dict, schemas: dict) -> dict:
    op: dict = {"summary": summary, "operationId": f"{method} {path}", "responses": {}}
    if req is not None:
        schema = {"$ref": _add_schema(req, schemas)} if isinstance(req, type) else req
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    parameters = [{"name": name, "in": "path", "required": True, "schema": _STR}
                  for name in _path_names(path)]
    parameters += [{"name": name, "in": "query", "required": False, "schema": schema}
                   for name, schema in options.get("query", {}).items()]
    if parameters:
        op["parameters"] = parameters
    op["responses"]["200"] = _ok(resp, options, schemas)
    if options.get("accepted"):
        op["responses"]["202"] = {"description": "accepted; runs in the background",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}
    error = {"$ref": "#/components/schemas/" + {"openai": "ErrorResponse", "anthropic": "AnthropicError",
                                                 "llamacpp": "LlamaCppError"}[envelope]}
    statuses = set(extra) | set(_ALWAYS) | (set(_BODY_ERRORS) if req is not None else set())
    statuses |= set(_WRITES) if method != "get" else set()
    if options.get("open"):
        op["security"] = []  # never behind the API key
        statuses -= {"401", "429"}
    for status in sorted(statuses):
        op["responses"][status] = {"description": _WHY[status], "content": {"application/json": {"schema": error}}}
    if path in DESTRUCTIVE:
        op["x-ferrox-destructive"] = True  # changes what the server serves; fuzzed apart (see the test)
    return op


def _ok(resp: Any, options: dict, schemas: dict) -> dict:
    if options.get("plain"):
        return {"description": "OK", "content": {"text/plain": {"schema": _STR}}}
    if options.get("sse"):
        return {"description": "OK", "content": _SSE}
    content: dict = {"application/json": {"schema": {"$ref": _add_schema(resp, schemas)} if resp else {}}}
    if options.get("stream"):
        content.update(_SSE)
    if options.get("text"):
        content = {"text/plain": {"schema": _STR}}
    return {"description": "OK", "content": content}


def _path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


def _add_schema(model: type, schemas: dict) -> str:
    ref = "#/components/schemas/{model}"
    schema = model.model_json_schema(ref_template=ref)
    for name, sub in schema.pop("$defs", {}).items():
        schemas[name] = sub
    schemas[model.__name__] = schema
    return ref.format(model=model.__name__)
