"""The OpenAI routes: models, completions, chat completions, cancel, tokenize, detokenize.

A generation request goes: parse and validate (api/protocol.py) -> tokenize (chat:
render the checkpoint's template first) -> check the context (prompt alone at or over
the ceiling is a 400; prompt + max_tokens over it is clamped to the room left, the
ferrox-server contract) -> one `GenerationRequest` per prompt, submitted through a
`Generation` (api/bridge.py; admission refusals become 400/503 here) -> RowEvents
folded into choices (api/choices.py), returned whole or streamed as SSE chunks.

Whatever ends the handler — the last finish_reason, a client disconnect (Quart cancels
the task, or closes the stream body), an exception — its `finally` cancels the jobs that
are still open, so their KV blocks return to the budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from typing import Any, AsyncIterator

from quart import Blueprint, Response, current_app, request

from api.app import AppState, json_response, state_of
from api.bridge import Generation
from api.choices import ChatShape, Choice, CompletionShape, prompt_entries
from api.limits import (check_asked_tokens, check_common, check_logprobs, check_prompt_tokens, check_token_ids,
                        max_tokens)
from api.protocol import (APIError, CancelRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                          SamplingFields, TokenizeRequest, parse_body, parse_logit_bias, unavailable)
from api.sse import DONE, KEEPALIVE, event, sse_response
from api.telemetry import RequestRecord
from ferrox_jax.batcher import AdmissionError
from ferrox_jax.plan import SamplingParams
from ferrox_jax.request import GenerationRequest
from ferrox_jax.scheduler import blocks_to_reserve

blueprint = Blueprint("openai", __name__)

HEALTH_POLL_S = 5.0  # a non-streaming wait re-checks the engine this often
ENCODE_INLINE_CHARS = 16_384  # longer prompts are tokenized in a worker thread


def _state() -> AppState:
    return state_of(current_app)


async def _body(model: type) -> Any:
    return parse_body(await request.get_data(), model)


def _check_model(name: str | None, engine: Any) -> None:
    if name is not None and name != engine.model_name:
        raise APIError(404, f"model {name!r} not found; this server serves {engine.model_name!r}",
                       param="model", code="model_not_found")


# ---------------------------------------------------------------- small routes


@blueprint.get("/v1/models")
async def list_models() -> Response:
    engine = _state().require_engine()
    return json_response({"object": "list", "data": [_model_card(engine)]})


@blueprint.get("/v1/models/<path:name>")
async def get_model(name: str) -> Response:
    engine = _state().require_engine()
    _check_model(name, engine)
    return json_response(_model_card(engine))


def _model_card(engine: Any) -> dict:
    created = int(time.time() - _state().stats.uptime_s())
    return {"id": engine.model_name, "object": "model", "created": created, "owned_by": "ferrox",
            "max_model_len": engine.max_context}


@blueprint.post("/v1/tokenize")
@blueprint.post("/tokenize")
async def tokenize() -> Response:
    state = _state()
    body: TokenizeRequest = await _body(TokenizeRequest)
    engine = state.require_engine()
    _check_model(body.model, engine)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        text = _render_chat(engine, [m.template_dict() for m in body.messages], True)
        tokens = await _encode(engine.tokenizer, text, add_special_tokens=False)
    else:
        tokens = await _encode(engine.tokenizer, body.prompt, add_special_tokens=bool(body.add_special_tokens))
    return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_context})


@blueprint.post("/v1/detokenize")
@blueprint.post("/detokenize")
async def detokenize() -> Response:
    state = _state()
    body: DetokenizeRequest = await _body(DetokenizeRequest)
    engine = state.require_engine()
    _check_model(body.model, engine)
    check_token_ids(body.tokens, engine.tokenizer.vocab_size, "tokens")
    return json_response({"text": engine.tokenizer.decode(body.tokens)})


@blueprint.post("/v1/cancel")
async def cancel() -> Response:
    state = _state()
    body: CancelRequest = await _body(CancelRequest)
    generation = state.inflight.get(body.request_id)
    if generation is None:
        return json_response({"request_id": body.request_id, "cancelled": False,
                              "error": {"message": f"no request {body.request_id!r} in flight",
                                        "type": "invalid_request_error", "param": "request_id",
                                        "code": "not_found"}}, 404)
    generation.cancel()
    return json_response({"request_id": body.request_id, "cancelled": True})


# ---------------------------------------------------------------- validation helpers


async def _encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; long texts are encoded off the event loop (a 4 MiB body takes ~1 s)."""
    if len(text) < ENCODE_INLINE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


def _render_chat(engine: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    from models.tokenizer import ChatTemplateError

    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages", code="chat_template_error") from None


def _sampling(body: SamplingFields, engine: Any, logprobs: int | None) -> SamplingParams:
    # The batcher derives choice seeds in int32 range; keep the request's seed there too.
    seed = body.seed if body.seed is not None else random.getrandbits(31)
    top_k = body.top_k or 0
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if top_k < 0 else top_k,
        min_p=body.min_p or 0.0,
        seed=seed & 0x7FFFFFFF,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=parse_logit_bias(body.logit_bias, engine.tokenizer.vocab_size),
    )


def _job_request(job_id: str, prompt_ids: list[int], max_tokens: int, body: SamplingFields,
                 sampling: SamplingParams, prompt_logprobs: bool) -> GenerationRequest:
    return GenerationRequest(
        request_id=job_id, prompt_token_ids=tuple(prompt_ids), max_tokens=max_tokens, sampling=sampling,
        n=body.n or 1, stop=tuple(body.stop_list()), stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos), min_tokens=min(body.min_tokens or 0, max_tokens),
        prompt_logprobs=prompt_logprobs)


def _job_ids(api_id: str, num_jobs: int) -> list[str]:
    return [api_id] if num_jobs == 1 else [f"{api_id}-{j}" for j in range(num_jobs)]


# ---------------------------------------------------------------- the generation routes


@blueprint.post("/v1/completions")
async def completions() -> Response:
    state = _state()
    body: CompletionRequest = await _body(CompletionRequest)
    engine = state.require_engine()
    _check_model(body.model, engine)
    check_common(body, engine, state.config)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    check_logprobs(body.logprobs, state.config, "logprobs")
    check_asked_tokens(body.max_tokens if "max_tokens" in body.model_fields_set else None, state.config)
    tok = engine.tokenizer
    prompts = []
    for p in body.prompt_list():
        ids = await _encode(tok, p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        check_token_ids(ids, tok.vocab_size, "prompt")
        check_prompt_tokens(len(ids), state.config, "prompt")
        prompts.append(ids)
    sampling = _sampling(body, engine, body.logprobs)
    echo_logprobs = bool(body.echo) and body.logprobs is not None
    if (body.min_tokens or 0) > (body.max_tokens if body.max_tokens is not None else 16):
        raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    api_id = f"cmpl-{uuid.uuid4().hex}"
    # max_tokens 0 (lm-eval's echo + logprobs scoring): a job must sample at least one
    # token, so ask for one and drop it; with nothing to score, no job is submitted at all.
    zero_output = body.max_tokens == 0
    reqs = [_job_request(job_id, ids,
                         max(1, max_tokens(body.max_tokens, len(ids), engine.max_context, state.config, "prompt")),
                         body, sampling, echo_logprobs)
            for job_id, ids in zip(_job_ids(api_id, len(prompts)), prompts)]
    echoes = [tok.decode(ids, skip_special_tokens=False) if body.echo else "" for ids in prompts]
    shape = CompletionShape(state.tokens, body.logprobs)
    return await _serve(state, engine, "/v1/completions", api_id, reqs, body, shape, echoes, zero_output)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    state = _state()
    body: ChatCompletionRequest = await _body(ChatCompletionRequest)
    engine = state.require_engine()
    _check_model(body.model, engine)
    check_common(body, engine, state.config)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    check_logprobs(body.top_logprobs, state.config, "top_logprobs")
    asked_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    check_asked_tokens(asked, state.config, asked_param)
    text = _render_chat(engine, [m.template_dict() for m in body.messages], body.add_generation_prompt is not False)
    prompt_ids = await _encode(engine.tokenizer, text, add_special_tokens=False)
    if not prompt_ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    check_prompt_tokens(len(prompt_ids), state.config, "messages")
    if asked is not None and (body.min_tokens or 0) > asked:
        raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    limit = max_tokens(asked, len(prompt_ids), engine.max_context, state.config, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    api_id = f"chatcmpl-{uuid.uuid4().hex}"
    reqs = [_job_request(api_id, prompt_ids, limit, body, _sampling(body, engine, logprobs), False)]
    shape = ChatShape(state.tokens, logprobs)
    return await _serve(state, engine, "/v1/chat/completions", api_id, reqs, body, shape, [""], False)


async def _serve(state: AppState, engine: Any, route: str, api_id: str, reqs: list, body: SamplingFields,
                 shape: Any, echoes: list[str], zero_output: bool) -> Response:
    """Submit the jobs and answer whole or as a stream."""
    n = body.n or 1
    run = _Run(state, route, api_id, reqs, n, shape, echoes, stream=bool(body.stream), zero_output=zero_output)
    if zero_output and not any(r.prompt_logprobs for r in reqs) and not body.stream:
        return run.finish_without_engine()
    run.submit(engine)
    # Belt and braces for the stream body: if the client leaves after the handler returns
    # but before Quart starts iterating the body, the generator never runs its `finally`.
    # The connection's task ends either way, so its done-callback closes the run.
    asyncio.current_task().add_done_callback(lambda _task: run.close())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(run.stream(include_usage), api_id)
    return await run.whole(engine)


class _Run:
    """One API generation request in flight: its jobs, choices and bookkeeping."""

    def __init__(self, state: AppState, route: str, api_id: str, reqs: list, n: int, shape: Any,
                 echoes: list[str], stream: bool, zero_output: bool) -> None:
        self.state, self.route, self.api_id, self.reqs, self.n, self.shape = state, route, api_id, reqs, n, shape
        self.stream_mode = stream
        self.zero_output = zero_output  # max_tokens 0: drop the one token each job samples
        self.created = int(time.time())
        self.model = state.engine.model_name
        self.choices = [Choice(index=j * n + i, echo=echoes[j]) for j in range(len(reqs)) for i in range(n)]
        self.prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        self.generation: Generation | None = None
        self.jobs_seen: set[int] = set()
        self.status = 200
        self.closed = False
        self.started_at = time.monotonic()

    def submit(self, engine: Any) -> None:
        generation = Generation(engine.batcher, [r.request_id for r in self.reqs], self.n)
        try:
            generation.submit(self.reqs)
        except AdmissionError as e:
            raise _admission_error(e, engine, self.reqs) from None
        self.generation = generation
        self.state.inflight[self.api_id] = generation
        self.state.stats.generating_now += 1

    def _fold(self, job: int, ev: Any) -> tuple[Choice, list]:
        choice = self.choices[job * self.n + ev.index]
        if self.zero_output:
            reason = "length" if ev.finish_reason in ("stop", "length") else ev.finish_reason
            ev = dataclasses.replace(ev, token_ids=(), text="", logprobs=None, num_generated_tokens=0,
                                     finish_reason=reason)
        if getattr(ev, "prompt_logprobs", None) and choice.prompt_entries is None:
            entries = prompt_entries(self.reqs[job].prompt_token_ids, ev.prompt_logprobs)
            for c in self.choices[job * self.n:(job + 1) * self.n]:
                c.prompt_entries = entries
        if job not in self.jobs_seen:  # the job's first event carries its admission wait
            self.jobs_seen.add(job)
            if ev.queue_s is not None:
                self.state.metrics.queue.observe(ev.queue_s)
        return choice, choice.add(ev)

    def _usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _response(self, choices: list[dict]) -> dict:
        return {"id": self.api_id, "request_id": self.api_id, "object": self.shape.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": self._usage()}

    def finish_without_engine(self) -> Response:
        for c in self.choices:
            c.finish_reason = "length"
        self.close()
        return json_response(self._response([self.shape.final(c) for c in self.choices]))

    async def whole(self, engine: Any) -> Response:
        gen = self.generation
        timeout_s = self.state.config.request_timeout_s
        deadline = self.started_at + timeout_s
        try:
            while not gen.is_finished:
                left_s = deadline - time.monotonic()
                if left_s <= 0:  # the job is cancelled in `close` below
                    raise APIError(504, f"the request did not finish within {timeout_s:g} s "
                                        "(--request-timeout); it was cancelled", type="server_error",
                                   code="request_timeout")
                item = await gen.next_event(min(HEALTH_POLL_S, left_s))
                if item is None:
                    if engine.batcher.health() != "ready":
                        raise APIError(500, "the engine stopped while generating", type="server_error",
                                       code="engine_error")
                    continue
                self._fold(*item)
            if gen.abort_reason is not None:
                raise unavailable(gen.abort_reason, code="draining")
            failed = next((c for c in self.choices if c.finish_reason == "error"), None)
            if failed is not None:
                raise APIError(500, f"generation failed: {failed.error or 'engine error'}", type="server_error",
                               code="engine_error")
            return json_response(self._response([self.shape.final(c) for c in self.choices]))
        except BaseException as e:
            self.status = e.status if isinstance(e, APIError) else 499  # 499: client went away
            raise
        finally:
            self.close()

    async def stream(self, include_usage: bool) -> AsyncIterator[bytes]:
        gen = self.generation
        try:
            while not gen.is_finished:
                item = await gen.next_event(self.state.config.sse_keepalive_s)
                if item is None:
                    if engine_dead(self.state):
                        self.status = 500
                        yield event({"error": {"message": "the engine stopped while generating",
                                               "type": "server_error", "param": None, "code": "engine_error"}})
                        return
                    yield KEEPALIVE
                    continue
                job, ev = item
                choice, entries = self._fold(job, ev)
                if ev.finish_reason == "error":
                    self.status = 500
                    yield event({"error": {"message": f"generation failed: {ev.error or 'engine error'}",
                                           "type": "server_error", "param": None, "code": "engine_error"}})
                    return
                if ev.finish_reason == "cancelled" and gen.abort_reason is not None:
                    self.status = 503  # the server ended it (drain): say so, not "cancelled"
                    yield event({"error": {"message": gen.abort_reason, "type": "server_error", "param": None,
                                           "code": "draining"}})
                    return
                for delta in self.shape.deltas(choice, ev.text, entries, ev.finish_reason):
                    yield event(self._chunk([delta]))  # one choice per chunk, as OpenAI sends
            if include_usage:
                yield event({**self._chunk([]), "usage": self._usage()})
            yield DONE
        except BaseException:
            self.status = 499 if self.status == 200 else self.status
            raise
        finally:
            self.close()

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.api_id, "request_id": self.api_id, "object": self.shape.chunk_object,
                "created": self.created, "model": self.model, "choices": choices}

    def close(self) -> None:
        """Cancel what is still open and record the request; idempotent."""
        if self.closed:
            return
        self.closed = True
        gen = self.generation
        if gen is not None and not gen.is_finished and self.status == 200:
            self.status = 499  # left before its last event: the client went away
        if gen is not None:
            gen.cancel()
            self.state.inflight.pop(self.api_id, None)
            self.state.stats.generating_now -= 1
        if self.status >= 500 and self.stream_mode:
            self.state.stats.on_error()  # a stream's status line said 200; count its failure here
        self._observe(gen)

    def _observe(self, gen: Generation | None) -> None:
        now = time.monotonic()
        ttft = None
        metrics = self.state.metrics
        if gen is not None:
            if gen.first_token_at is not None:
                ttft = gen.first_token_at - gen.submitted_at
                metrics.ttft.observe(ttft)
            for gap in gen.inter_token_s:
                metrics.itl.observe(gap)
            if self.status == 200:
                metrics.e2e.observe(now - gen.submitted_at)
        usage = self._usage()
        self.state.stats.record(RequestRecord(
            id=self.api_id, route=self.route, status=self.status, prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"], ttft_ms=None if ttft is None else round(ttft * 1e3, 3),
            duration_ms=round((now - self.started_at) * 1e3, 3), stream=self.stream_mode))


def engine_dead(state: AppState) -> bool:
    return state.engine is None or state.engine.batcher.health() != "ready"


def _admission_error(e: AdmissionError, engine: Any, reqs: list) -> APIError:
    reason, message = e.reason, str(e)
    if reason == "context_length":
        return APIError(400, message, param="max_tokens", code="context_length_exceeded")
    if reason == "too_large":
        per_block = engine.kv_bytes_per_block
        total = engine.batcher.stats().kv_blocks_total
        need = max(blocks_to_reserve(len(r.prompt_token_ids), r.max_tokens, r.n, engine.block_size)[0]
                   for r in reqs)
        if need > total:
            message += f" ({need * per_block} bytes needed; the KV budget holds {total * per_block} bytes)"
        return APIError(400, message, param="max_tokens", code="device_memory_budget_exceeded")
    if reason == "queue_full":
        return unavailable(message, code="queue_full")
    return unavailable(message, code="unavailable")
