"""The OpenAI adapter: models, completions, chat completions, cancel.

A generation request goes: parse and validate (api/protocol.py) -> its output
constraint and tools (`response_format` / `guided_*`, `tools` / `tool_choice`, planned by
api/structured.py) -> tokenize (chat: render the checkpoint's template first, with the
tools) -> check the context (prompt alone at or over the ceiling is a 400; prompt +
max_tokens over it is clamped to the room left, the ferrox-server contract) -> compile the
constraint (a 400 names what the engine cannot enforce) -> one `Job` per
prompt, run by the generation core (`api/generation.py`: submission, events,
cancellation, accounting) -> its row events folded into OpenAI choices (api/choices.py:
content, reasoning_content and reasoning, tool_calls), returned whole or streamed as SSE
chunks. `thinking_token_budget` becomes the job's thinking budget (`api/reasoning.py`). This
module is OpenAI's wire format only.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from quart import Blueprint, Response, current_app, request

from api import generation, images, resumable, sessions
from api.lora_routes import lora_cards
from api.choices import INLINE_REPLY_ENTRIES, ChatShape, Choice, CompletionShape, prompt_entries, reply_entries
from api.errors import APIError
from api.generation import GenerationRun, RowOutput, job_ids
from api.limits import (check_asked_tokens, check_common, check_fits_queue, check_logprobs, check_prompt_tokens,
                        check_reply_entries, check_token_ids, max_tokens)
from api.offload import parse_body_off_loop, run_cpu_if
from api.priority import request_priority
from api.prompts import check_model, encode, heavy_chat
from api.protocol import (CancelRequest, ChatCompletionRequest, CompletionRequest, SamplingFields, dumps,
                          parse_logit_bias)
from api.reasoning import THINK_START, prompt_opens_reasoning, thinking_budget
from api.sse import DONE, KEEP_ALIVE_COMMENT, event, sse_response
from api.state import AppState, json_response, state_of
from api.structured import (PLAIN_TEXT, OutputPlan, choice_constraint, check_grammar, completion_plan,
                            grammar_constraint, json_object_constraint, json_schema_constraint, prepare_chat,
                            regex_constraint, tool_request)
from api.template_kwargs import template_kwargs
from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.request import Job, RowSampling, ThinkingBudget

if TYPE_CHECKING:  # the facade's module imports jax; only its type is needed here
    from ferrox_jax.engine import Engine

blueprint = Blueprint("openai", __name__)


def _state() -> AppState:
    return state_of(current_app)


async def _body(model: type) -> Any:
    return await parse_body_off_loop(await request.get_data(), model)


# ---------------------------------------------------------------- small routes


@blueprint.get("/v1/models")
async def list_models() -> Response:
    engine = _state().require_engine()
    card = _model_object(engine)
    return json_response({"object": "list", "data": [card, *lora_cards(engine, card)]})


@blueprint.get("/v1/models/<path:name>")
async def get_model(name: str) -> Response:
    engine = _state().require_engine()
    check_model(name, engine)
    card = _model_object(engine)
    return json_response(next((c for c in lora_cards(engine, card) if c["id"] == name), card))


def _model_object(engine: Engine) -> dict:
    """The served model's `/v1/models` entry (`api/protocol.py:ModelObject`), from the engine's card."""
    created = int(time.time() - _state().stats.uptime_s())
    card = engine.model_card
    return {"id": card.id, "object": "model", "created": created, "owned_by": "ferrox",
            "max_model_len": card.max_context, "architecture": card.architecture, "dtype": card.dtype,
            "quantization": card.quantization, "kv_cache_dtype": card.kv_cache_dtype,
            "image_input": engine.takes_images}


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


def _sampling(body: SamplingFields, engine: Engine, logprobs: int | None) -> RowSampling:
    top_k = body.top_k or 0
    return RowSampling(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if top_k < 0 else top_k,
        min_p=body.min_p or 0.0,
        seed=body.seed,  # None: the engine draws one (Engine.submit)
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=parse_logit_bias(body.logit_bias, engine.tokenizer.vocab_size),
    )


def _job_request(job_id: str, prompt_ids: list[int], max_tokens: int, body: SamplingFields,
                 sampling: RowSampling, prompt_logprobs: bool, grammar: GrammarSpec | None = None,
                 plan: OutputPlan = OutputPlan(), images: tuple = (),
                 thinking: ThinkingBudget | None = None, priority: int = 0) -> Job:
    return Job(
        request_id=job_id, prompt_token_ids=tuple(prompt_ids), max_tokens=max_tokens, sampling=sampling,
        n=body.n or 1, stop=tuple(body.stop_list()), stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos), min_tokens=min(body.min_tokens or 0, max_tokens),
        prompt_logprobs=prompt_logprobs, grammar=grammar, skip_special_tokens=plan.skip_special_tokens,
        images=images, thinking_budget=thinking, priority=priority)


_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _constraint(body: SamplingFields) -> tuple[GrammarSpec | str | None, str]:
    """The request's output constraint and the field it came from: a GrammarSpec,
    PLAIN_TEXT (`response_format: {"type": "text"}` alone, which also opts out of the
    server's default constraint) or None. More than one constraint is a 400."""
    given: list[tuple[GrammarSpec | str, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append((json_object_constraint(), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        param = "response_format.json_schema.schema"
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, f"{param} is required for response_format type json_schema", param=param,
                           code="invalid_value")
        given.append((json_schema_constraint(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict),
                                             param=param), param))
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise APIError(400, f"guided_json is not valid JSON: {e}", param="guided_json") from None
        given.append((json_schema_constraint(schema, strict=False, param="guided_json"), "guided_json"))
    if body.guided_regex is not None:
        given.append((regex_constraint(body.guided_regex, param="guided_regex"), "guided_regex"))
    if body.guided_choice is not None:
        given.append((choice_constraint(body.guided_choice, param="guided_choice"), "guided_choice"))
    if body.guided_grammar is not None:
        given.append((grammar_constraint(body.guided_grammar, param="guided_grammar"), "guided_grammar"))
    if len(given) > 1:
        raise APIError(400, f"give at most one output constraint ({', '.join(_CONSTRAINT_FIELDS)}); got "
                            f"{', '.join(param for _, param in given)}", param=given[1][1])
    if given:
        return given[0]
    return (PLAIN_TEXT if fmt is not None else None), "response_format"


# ---------------------------------------------------------------- the generation routes


@blueprint.post("/v1/completions")
async def completions() -> Response:
    state = _state()
    body: CompletionRequest = await _body(CompletionRequest)
    engine = state.require_engine()
    priority = request_priority(body.priority, engine)
    check_model(body.model, engine)
    check_common(body, engine, state.config)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    check_logprobs(body.logprobs, state.config, "logprobs")
    check_asked_tokens(body.max_tokens if "max_tokens" in body.model_fields_set else None, state.config)
    tok = engine.tokenizer
    prompts = []
    check_fits_queue(len(body.prompt_list()), engine, "prompt")
    for p in body.prompt_list():
        ids = await encode(tok, p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        check_token_ids(ids, tok.vocab_size, "prompt")
        check_prompt_tokens(len(ids), state.config, "prompt")
        prompts.append(ids)
    sampling = _sampling(body, engine, body.logprobs)
    echo_logprobs = bool(body.echo) and body.logprobs is not None
    if (body.min_tokens or 0) > (body.max_tokens if body.max_tokens is not None else 16):
        raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    plan = completion_plan(*_constraint(body), state.config.default_grammar)
    grammar = await check_grammar(engine, plan.grammar, plan.grammar_param)
    api_id = f"cmpl-{uuid.uuid4().hex}"
    # max_tokens 0 (lm-eval's echo + logprobs scoring): a job must sample at least one
    # token, so ask for one and drop it; with nothing to score, no job is submitted at all.
    zero_output = body.max_tokens == 0
    # A raw prompt has no output plan for thinking sections: the template's markers and the
    # prompt's own text say whether the output starts inside one.
    sections = grammar is None and THINK_START in (tok.chat_template or "")
    reqs = [_job_request(job_id, ids,
                         max(1, max_tokens(body.max_tokens, len(ids), engine.max_context, state.config, "prompt")),
                         body, sampling, echo_logprobs, grammar, plan, priority=priority,
                         thinking=thinking_budget(tok, body.thinking_token_budget, has_sections=sections,
                                                  starts_inside=prompt_opens_reasoning(tok.decode(ids))))
            for job_id, ids in zip(job_ids(api_id, len(prompts)), prompts)]
    check_reply_entries(reqs, body.logprobs, state.config, echo=bool(body.echo))
    echoes = [tok.decode(ids, skip_special_tokens=False) if body.echo else "" for ids in prompts]
    run = GenerationRun(state, "/v1/completions", api_id, reqs, stream=bool(body.stream), drop_output=zero_output,
                        engine=engine, model=body.model)
    return await _serve(run, body, CompletionShape(state.tokens_for(engine), body.logprobs), echoes)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    state = _state()
    body: ChatCompletionRequest = await _body(ChatCompletionRequest)
    engine = state.require_engine()
    priority = request_priority(body.priority, engine)
    check_model(body.model, engine)
    check_common(body, engine, state.config)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    check_logprobs(body.top_logprobs, state.config, "top_logprobs")
    asked_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    check_asked_tokens(asked, state.config, asked_param)
    constraint, constraint_param = _constraint(body)
    kwargs = template_kwargs(body.chat_template_kwargs, body.reasoning_effort, engine.tokenizer.chat_template)
    session = _session(state, body.session_id)
    parts = [(part, f"messages[{i}].content") for i, m in enumerate(body.messages) for part in m.image_parts()]
    images.check_count(engine, len(parts), state.config, parts[0][1] if parts else "messages")
    pictures = await images.prepare(engine, [images.part_bytes(p, param) for p, param in parts], state.config,
                                    "messages")
    messages = [m.template_dict() for m in body.messages]
    if session:  # rendered as the session will keep them, so the next turn renders the same history
        messages = state.sessions.kept_turns(messages)
    history = state.sessions.history(*session) if session else []

    def plan_chat():  # in the CPU pool for a long conversation or tools (a forced call compiles)
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, engine)
        return prepare_chat(engine.tokenizer, history + messages, tools=tools, constraint=constraint,
                            constraint_param=constraint_param, default_constraint=state.config.default_grammar,
                            add_generation_prompt=body.add_generation_prompt is not False, template_kwargs=kwargs)

    chat = await run_cpu_if(heavy_chat(body.messages, body.tools), plan_chat)
    text = images.expand(chat.text, engine, pictures, "messages")
    prompt_ids = await encode(engine.tokenizer, text, add_special_tokens=False)
    if not prompt_ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    check_prompt_tokens(len(prompt_ids), state.config, "messages")
    if asked is not None and (body.min_tokens or 0) > asked:
        raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    limit = max_tokens(asked, len(prompt_ids), engine.max_context, state.config, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await check_grammar(engine, chat.plan.grammar, chat.plan.grammar_param)
    api_id = f"chatcmpl-{uuid.uuid4().hex}"
    thinking = thinking_budget(engine.tokenizer, body.thinking_token_budget, has_sections=chat.plan.reasoning,
                               starts_inside=chat.plan.starts_in_reasoning)
    reqs = [_job_request(api_id, prompt_ids, limit, body, _sampling(body, engine, logprobs), False, grammar,
                         chat.plan, images.spans(prompt_ids, engine, pictures, "messages"), thinking=thinking,
                         priority=priority)]
    check_reply_entries(reqs, logprobs, state.config, param=asked_param)
    run = GenerationRun(state, "/v1/chat/completions", api_id, reqs, stream=bool(body.stream), engine=engine,
                        model=body.model)
    after = (lambda reply: _remember(state, session, messages, reply)) if session else None
    return await _serve(run, body, ChatShape(state.tokens_for(engine), logprobs), [""], chat.plan, after)


def _session(state: AppState, session_id: Any) -> tuple[str, str] | None:
    """(credential namespace, id) of the request's session (api/sessions.py), or None."""
    session_id = sessions.check_session_id(session_id)
    return (sessions.credential_namespace(request.headers), session_id) if session_id else None


def _remember(state: AppState, session: tuple[str, str], messages: list[dict], reply: _Reply) -> None:
    """A finished exchange joins its session: the request's messages, then the first
    choice's text as the assistant's turn (a cancelled or failed reply is not kept)."""
    choice = reply.choices[0]
    if choice.finish_reason in ("stop", "length", "tool_calls"):
        state.sessions.append(*session, messages + [{"role": "assistant", "content": "".join(choice.text)}])


async def _then(frames: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    """`frames`, then `done()` once they all went out (not after a disconnect)."""
    async for frame in frames:
        yield frame
    done()


async def _serve(run: GenerationRun, body: SamplingFields, shape: Any, echoes: list[str],
                 plan: OutputPlan = OutputPlan(), after: Callable[[Any], None] | None = None) -> Response:
    """Submit the run's jobs and answer whole or as a stream (the generation core's
    `start`, `collect` and `stream`); `after(reply)` runs once the reply is complete."""
    reply = _Reply(run, shape, echoes, plan)
    if run.drop_output and not any(job.prompt_logprobs for job in run.jobs) and not run.stream:
        return reply.without_engine()  # max_tokens 0 with nothing to score: no job at all
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    frames = reply.stream(include_usage) if run.stream else None
    if frames is not None and after is not None:
        frames = _then(frames, lambda: after(reply))
    if run.stream and body.stream_resumable:  # detached from this connection: see api/resumable.py
        return resumable.serve(run, frames)
    generation.start(run)
    if run.stream:
        return sse_response(frames, run.api_id)
    await generation.collect(run, reply.fold)
    if after is not None:
        after(reply)
    return await reply.whole()


class _Reply:
    """A run's events rendered as an OpenAI completion or chat completion."""

    def __init__(self, run: GenerationRun, shape: Any, echoes: list[str], plan: OutputPlan) -> None:
        self.run, self.shape = run, shape
        self.created = int(time.time())
        self.model = run.engine.model_name if run.engine is not None else ""
        n = run.n
        self.choices = [Choice(index=j * n + i, echo=echoes[j], parser=plan.new_parser())
                        for j in range(len(run.jobs)) for i in range(n)]

    def fold(self, output: RowOutput) -> tuple[Choice, list]:
        choice = self.choices[output.choice]
        event = output.event
        if event.prompt_logprobs and choice.prompt_entries is None:
            entries = prompt_entries(self.run.jobs[output.job].prompt_token_ids, event.prompt_logprobs)
            n = self.run.n
            for c in self.choices[output.job * n:(output.job + 1) * n]:
                c.prompt_entries = entries
        return choice, choice.add(event)

    def _usage(self) -> dict:
        prompt, completion = self.run.num_prompt_tokens, self.run.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.run.num_cached_tokens}}

    def response(self, choices: list[dict]) -> dict:
        return {"id": self.run.api_id, "request_id": self.run.api_id, "object": self.shape.object,
                "created": self.created, "model": self.model, "choices": choices, "usage": self._usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.run.api_id, "request_id": self.run.api_id, "object": self.shape.chunk_object,
                "created": self.created, "model": self.model, "choices": choices}

    async def whole(self) -> Response:
        """The whole reply as JSON. A large one (logprobs: a dict per alternative) is built
        and serialized in the CPU pool, not on the event loop, which a million entries
        would hold for seconds (api/offload.py)."""
        def body() -> str:
            return dumps(self.response([self.shape.final(c) for c in self.choices]))

        text = await run_cpu_if(reply_entries(self.choices, self.shape.top_k) > INLINE_REPLY_ENTRIES, body)
        return Response(text, content_type="application/json")

    def without_engine(self) -> Response:
        for c in self.choices:
            c.finish_reason = "length"
        self.run.close()
        return json_response(self.response([self.shape.final(c) for c in self.choices]))

    def _frames(self, output: RowOutput) -> list[bytes]:
        choice, entries = self.fold(output)
        return [event(self._chunk([delta]))  # one choice per chunk, as OpenAI sends
                for delta in self.shape.deltas(choice, output.event.text, entries, output.event.finish_reason)]

    def stream(self, include_usage: bool) -> AsyncIterator[bytes]:
        def end() -> list[bytes]:
            return ([event({**self._chunk([]), "usage": self._usage()})] if include_usage else []) + [DONE]

        return generation.stream(self.run, self._frames, keepalive=KEEP_ALIVE_COMMENT, end=end,
                                 error=lambda e: event(e.body()))  # mid-stream failure: one error event
