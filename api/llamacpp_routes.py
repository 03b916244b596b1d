"""The llama.cpp adapter: `POST /completion` (and `/completions`), llama.cpp server's native route.

llama.cpp's wire format only; the generation core (`api/generation.py`) does the rest.
Request (llama.cpp's names and defaults): `prompt` (a string, tokenized with the
tokenizer's special tokens, or token ids as given), `n_predict` (-1 or absent: the room
left in the context; 0: evaluate the prompt only), `temperature` 0.8, `top_k` 40, `top_p`
0.95, `min_p` 0.05, `repeat_penalty` 1.0 (over prompt and output, vLLM's rule: there is no
`repeat_last_n` window), `presence_penalty`, `frequency_penalty`, `seed` (-1: random; the
engine draws it, and `generation_settings.seed` reports the one drawn), `stop`,
`ignore_eos`, `stream`, `cache_prompt` (default true: the prefix cache serves what it can
of the prompt and `tokens_cached` says how many tokens; false: the prompt is computed
whole, `tokens_cached` 0, its blocks still cached for later requests), `return_tokens`
(false: `tokens` is empty, as llama.cpp sends it; true: the generated token ids).

Reply: flat JSON `{"content", "stop": true, "stop_type", "stopping_word", "tokens_predicted",
"tokens_evaluated", "timings", "generation_settings", ...}`; `stop_type` is `eos` (end of
generation), `word` (a stop string, named in `stopping_word` from the engine's
`RowEvent.stop_string`), `limit` (n_predict reached) or `cancelled` (ferrox's: `/v1/cancel`
with the `X-Request-Id` header's id). `timings` splits the request at its first token:
`prompt_*` is the prompt's own time (the wait for admission excluded), `predicted_*` the
rest. A stream is bare `data: {"content", "stop": false, ...}` events, then one event
with `stop: true` and the totals; no `[DONE]`.

Errors, on these paths (`api/app.py` picks the envelope by route): llama.cpp's
`{"error": {"code": <status>, "message", "type"}}`, types `invalid_request_error`,
`exceed_context_size_error`, `authentication_error`,
`not_found_error`, `unavailable_error`, `server_error`.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import Field, field_validator
from quart import Blueprint, Response, current_app, request

from api import generation
from api.errors import APIError
from api.generation import GenerationRun, RowOutput
from api.limits import check_asked_tokens, check_prompt_tokens, check_stop_strings, check_token_ids, max_tokens
from api.offload import parse_body_off_loop
from api.priority import request_priority
from api.prompts import check_model, encode
from api.protocol import StrictBody, dumps
from api.sse import KEEP_ALIVE_COMMENT, sse_response
from api.state import json_response, state_of
from ferrox_jax.request import Job, RowEvent, RowSampling

blueprint = Blueprint("llamacpp", __name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}


def error_response(e: APIError) -> tuple[int, dict]:
    """llama.cpp's envelope: the status repeated as `code`, its error type names."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
    error: dict[str, Any] = {"code": e.status, "message": e.message, "type": kind}
    if e.code == "context_length_exceeded":
        error["type"] = "exceed_context_size_error"
    return e.status, {"error": error}


class LlamaCompletionRequest(StrictBody):
    prompt: Any = Field(..., description="a string or a list of token ids")
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int = -1
    stop: list[str] = []
    ignore_eos: bool = False
    stream: bool = False
    cache_prompt: bool = True
    return_tokens: bool = False
    model: str | None = None  # a LoRA adapter's name runs the request with it (api/lora_routes.py)
    priority: int | None = None  # lower first under --scheduling-policy priority (api/priority.py)

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str) and v:
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise ValueError("prompt must be a non-empty string or a list of token ids (one prompt per request)")


@blueprint.post("/completion")
@blueprint.post("/completions")
async def completion() -> Response:
    state = state_of(current_app)
    body: LlamaCompletionRequest = await parse_body_off_loop(await request.get_data(), LlamaCompletionRequest)
    engine = state.require_engine()
    priority = request_priority(body.priority, engine)
    check_model(body.model, engine)
    check_stop_strings(body.stop, state.config)
    tok = engine.tokenizer
    ids = await encode(tok, body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    check_token_ids(ids, tok.vocab_size, "prompt")
    check_prompt_tokens(len(ids), state.config, "prompt")
    asked = None if body.n_predict == -1 else body.n_predict
    check_asked_tokens(asked, state.config, "n_predict")
    limit = max(1, max_tokens(asked, len(ids), engine.max_context, state.config, "prompt"))
    sampling = RowSampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                           seed=body.seed if body.seed >= 0 else None, repetition_penalty=body.repeat_penalty,
                           presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)
    api_id = f"cmpl-{uuid.uuid4().hex}"
    job = Job(request_id=api_id, prompt_token_ids=tuple(ids), max_tokens=limit, sampling=sampling,
              stop=tuple(body.stop), ignore_eos=body.ignore_eos,
              reads_prefix_cache=body.cache_prompt, priority=priority)
    run = GenerationRun(state, "/completion", api_id, [job], stream=body.stream, drop_output=asked == 0,
                        engine=engine, model=body.model)
    settings = {"n_predict": body.n_predict, "n_ctx": engine.max_context, "temperature": body.temperature,
                "top_k": body.top_k, "top_p": body.top_p, "min_p": body.min_p, "repeat_penalty": body.repeat_penalty,
                "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                "seed": body.seed, "stop": body.stop, "ignore_eos": body.ignore_eos, "stream": body.stream,
                "cache_prompt": body.cache_prompt}
    reply = _Completion(run, engine.model_name, settings, body.return_tokens)
    generation.start(run)
    if run.stream:
        return sse_response(generation.stream(run, reply.frames, keepalive=KEEP_ALIVE_COMMENT, end=reply.end,
                                              error=lambda e: _data(error_response(e)[1])), api_id)
    await generation.collect(run, reply.fold)
    return json_response(reply.final(), headers={"X-Request-Id": api_id})


def stop_type(event: RowEvent) -> tuple[str, str]:
    """(stop_type, stopping_word) for a row's last event."""
    if event.finish_reason == "stop":
        return ("word", event.stop_string) if event.stop_string is not None else ("eos", "")
    if event.finish_reason == "length":
        return "limit", ""
    return event.finish_reason or "none", ""


def _data(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


class _Completion:
    """One run's events as llama.cpp's completion, whole or as its stream."""

    def __init__(self, run: GenerationRun, model: str, settings: dict, return_tokens: bool = False) -> None:
        self.run, self.model, self.settings = run, model, settings
        self.return_tokens = return_tokens
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.stop_type, self.stopping_word = "none", ""

    def fold(self, output: RowOutput) -> None:
        event = output.event
        if event.text:
            self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        if event.finish_reason is not None:
            self.stop_type, self.stopping_word = stop_type(event)

    def _timings(self) -> dict:
        run = self.run
        prompt_n, predicted_n = run.num_prompt_tokens, run.num_completion_tokens
        prompt_ms, predicted_ms = run.prefill_s * 1e3, run.decode_s * 1e3
        return {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": prompt_n / (prompt_ms / 1e3) if prompt_ms else 0.0,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
                "predicted_per_second": predicted_n / (predicted_ms / 1e3) if predicted_ms else 0.0}

    def final(self, content: str | None = None) -> dict:
        """The whole reply; `content=""` for a stream's last event (its text went already)."""
        text = "".join(self.text) if content is None else content
        tokens = self.token_ids if self.return_tokens and content is None else []
        settings = self.settings
        drawn = self.run.jobs[0].sampling.seed  # what the engine drew for `seed: -1` (None: answered from cache)
        if settings["seed"] < 0 and drawn is not None:
            settings = {**settings, "seed": drawn}
        return {"index": 0, "content": text, "tokens": tokens, "id_slot": 0, "stop": True, "model": self.model,
                "tokens_predicted": self.run.num_completion_tokens, "tokens_evaluated": self.run.num_prompt_tokens,
                "tokens_cached": self.run.num_cached_tokens, "truncated": False, "has_new_line": "\n" in text,
                "stop_type": self.stop_type, "stopping_word": self.stopping_word,
                "generation_settings": settings, "timings": self._timings()}

    def frames(self, output: RowOutput) -> list[bytes]:
        self.fold(output)
        event = output.event
        if not event.text and not event.token_ids:
            return []
        tokens = list(event.token_ids) if self.return_tokens else []
        return [_data({"index": 0, "content": event.text, "tokens": tokens, "stop": False,
                       "id_slot": 0, "tokens_predicted": self.run.num_completion_tokens,
                       "tokens_evaluated": self.run.num_prompt_tokens})]

    def end(self) -> list[bytes]:
        return [_data(self.final(content=""))]
