"""The OpenAI Responses adapter: `POST /v1/responses`.

The Responses wire format only; the generation core (`api/generation.py`) does the rest.
Request: `input` (a string, or message items whose content is a string or
`input_text` / `output_text` parts), `instructions` (a system turn before them),
`max_output_tokens` (default: the room left in the context), `temperature`, `top_p`,
`stream`. Stateless: `store` is accepted and nothing is kept, so `previous_response_id`
is a 400 (send the whole conversation as `input`); `tools` and non-text `text.format`
are 400s for now.

Reply: a `response` object with one `message` output item holding one `output_text`
part, `status` `completed`, or `incomplete` with `incomplete_details.reason:
"max_output_tokens"` when the token limit ended it (`cancelled` after `/v1/cancel`), and
`usage` (`input_tokens`, `output_tokens`, `total_tokens`). `output_text` (the SDKs'
property over `output`) is also in the JSON, for clients without an SDK.

A stream is the Responses event sequence, each `event: <type>\\ndata: {json}` with a
`sequence_number` counting from 0: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`*,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
then `response.completed` (or `response.incomplete`, as OpenAI sends for a truncated
answer, and for a cancelled one, whose status says `cancelled`). A failure mid-stream is
an `error` event. Errors use the OpenAI envelope.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from quart import Blueprint, Response, current_app, request

from api import generation
from api.errors import APIError
from api.generation import GenerationRun, RowOutput
from api.limits import check_asked_tokens, check_prompt_tokens, max_tokens
from api.prompts import chat_prompt, check_model
from api.protocol import parse_body
from api.sse import named_event as event, sse_response
from api.state import json_response, state_of
from ferrox_jax.request import GenerationRequest, SamplingParams

blueprint = Blueprint("responses", __name__)

ROUTE = "/v1/responses"
ROLES = ("user", "assistant", "system", "developer")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Any = Field(..., description="a string or a list of message items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("input", mode="plain")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        if isinstance(v, str) or (isinstance(v, list) and all(isinstance(item, dict) for item in v)):
            return v
        raise ValueError("input must be a string or a list of message items")


def _item_text(item: dict, i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of text parts",
                       param=f"input[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                and isinstance(part.get("text"), str)):
            raise APIError(400, f"input[{i}].content[{j}]: only input_text / output_text parts are supported",
                           param=f"input[{i}].content[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _turns(body: ResponsesRequest) -> list[dict]:
    turns = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return turns + [{"role": "user", "content": body.input}]
    if not body.input:
        raise APIError(400, "input must not be empty", param="input")
    for i, item in enumerate(body.input):
        if item.get("type", "message") != "message" or item.get("role") not in ROLES:
            raise APIError(400, f"input[{i}]: only message items with a role in {ROLES} are supported "
                                f"(got type {item.get('type', 'message')!r})", param=f"input[{i}]")
        turns.append({"role": item["role"], "content": _item_text(item, i)})
    return turns


def _check_supported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server keeps no responses "
                            "(store is ignored); send the whole conversation as input",
                       param="previous_response_id")
    if body.tools:
        raise APIError(400, "tools are not supported on /v1/responses yet", param="tools")
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise APIError(400, "text.format other than text is not supported on /v1/responses yet",
                       param="text.format")


@blueprint.post(ROUTE)
async def create_response() -> Response:
    state = state_of(current_app)
    body: ResponsesRequest = parse_body(await request.get_data(), ResponsesRequest)
    engine = state.require_engine()
    check_model(body.model, engine)
    _check_supported(body)
    check_asked_tokens(body.max_output_tokens, state.config, "max_output_tokens")
    prompt, _plan = await chat_prompt(engine, _turns(body), "input")
    check_prompt_tokens(len(prompt), state.config, "input")
    api_id = f"resp_{uuid.uuid4().hex}"
    sampling = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, seed=random.getrandbits(31))
    limit = max_tokens(body.max_output_tokens, len(prompt), engine.max_context, state.config, "input")
    job = GenerationRequest(request_id=api_id, prompt_token_ids=tuple(prompt), max_tokens=limit, sampling=sampling)
    run = GenerationRun(state, ROUTE, api_id, [job], stream=bool(body.stream), engine=engine)
    reply = _Response(run, engine.model_name, body, sampling)
    generation.start(run)
    if run.stream:
        return sse_response(reply.stream(), api_id)
    await generation.collect(run, reply.fold)
    return json_response(reply.response(), headers={"X-Request-Id": api_id})


class _Response:
    """One run's events as a Responses `response`, whole or as its event stream."""

    def __init__(self, run: GenerationRun, model: str, body: ResponsesRequest, sampling: SamplingParams) -> None:
        self.run, self.model, self.body, self.sampling = run, model, body, sampling
        self.created_at = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.sequence_number = 0

    def fold(self, output: RowOutput) -> None:
        if output.event.text:
            self.text.append(output.event.text)
        if output.event.finish_reason is not None:
            self.finish_reason = output.event.finish_reason

    @property
    def status(self) -> Literal["in_progress", "completed", "incomplete", "cancelled"]:
        return {None: "in_progress", "length": "incomplete", "cancelled": "cancelled"}.get(
            self.finish_reason, "completed")

    def _part(self) -> dict:
        return {"type": "output_text", "text": "".join(self.text), "annotations": [], "logprobs": []}

    def _item(self, done: bool) -> dict:
        status = "in_progress" if not done else ("completed" if self.status == "completed" else "incomplete")
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [self._part()] if done else []}

    def response(self, done: bool = True) -> dict:
        run, body = self.run, self.body
        status = self.status if done else "in_progress"
        usage = {"input_tokens": run.num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": run.num_completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": run.num_prompt_tokens + run.num_completion_tokens}
        return {"id": run.api_id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.model, "output": [self._item(True)] if done else [],
                "output_text": "".join(self.text) if done else "", "parallel_tool_calls": False,
                "previous_response_id": None, "store": False, "temperature": self.sampling.temperature,
                "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
                "top_p": self.sampling.top_p, "truncation": "disabled", "usage": usage if done else None,
                "user": body.user, "metadata": body.metadata or {}}

    def _event(self, kind: str, **fields: Any) -> bytes:
        frame = event(kind, {"type": kind, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1
        return frame

    def _where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _frames(self, output: RowOutput) -> list[bytes]:
        self.fold(output)
        if not output.event.text:
            return []
        return [self._event("response.output_text.delta", **self._where(), delta=output.event.text, logprobs=[])]

    def _end(self) -> list[bytes]:
        part = self._part()
        final = "response.completed" if self.status == "completed" else "response.incomplete"
        return [self._event("response.output_text.done", **self._where(), text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=part),
                self._event("response.output_item.done", output_index=0, item=self._item(True)),
                self._event(final, response=self.response())]

    def _error(self, e: APIError) -> bytes:
        return self._event("error", code=e.code, message=e.message, param=e.param)

    async def stream(self):
        yield self._event("response.created", response=self.response(done=False))
        yield self._event("response.in_progress", response=self.response(done=False))
        yield self._event("response.output_item.added", output_index=0, item=self._item(False))
        yield self._event("response.content_part.added", **self._where(),
                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        async for frame in generation.stream(self.run, self._frames, keepalive=b": keep-alive\n\n", end=self._end,
                                             error=self._error):
            yield frame
