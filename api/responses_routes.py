"""The OpenAI Responses adapter: `POST /v1/responses`.

The Responses wire format only; the generation core (`api/generation.py`) and the
neutral tools and output pieces (`api/structured.py`, `api/output_blocks.py`) do the rest.
Request: `input` (a string, or items: messages whose content is a string or
`input_text` / `output_text` parts, `function_call` and `function_call_output` items,
which become an assistant's `tool_calls` and `tool` turns as on chat; `reasoning` items
are accepted and dropped), `instructions` (a
system turn before them), `max_output_tokens` (default: the room left in the context),
`temperature`, `top_p`, `stream`, `reasoning.effort` (as chat's `reasoning_effort`:
`api/template_kwargs.py`), `reasoning.max_tokens` or `thinking_token_budget` (the thinking
section is cut there: `api/reasoning.py:thinking_budget`). Stateless: `store` is accepted and nothing is kept, so
`previous_response_id` is a 400 (send the whole conversation as `input`).

Tools: `tools` of type `function` (`{name, description, parameters, strict}`; other
types such as web_search are 400s naming the type), `tool_choice` ("auto", the default
with tools; "none"; "required" and `{"type": "function", "name"}` force a call with a
grammar, as on chat) and `parallel_tool_calls`. Output format: `text.format`
`{"type": "json_schema", "name", "schema", "strict"}` or `{"type": "json_object"}`
constrains the text as chat's `response_format` does; `{"type": "text"}` opts out of a
server-wide default constraint, which applies otherwise.

Reply: a `response` object whose `output` is, with a template that has thinking sections
(`<think>`), a `reasoning` item (`{"id": "rs_…", "summary": [], "content": [{"type":
"reasoning_text", "text"}], "status"}`), then a `message` item (one `output_text` part),
then a `function_call` item (`{"id": "fc_…", "call_id": "call_…", "name", "arguments":
JSON text, "status"}`) per call; a reply of calls alone has no message item, a reply
that can have no calls always one. `status` is `completed`, or `incomplete` with
`incomplete_details.reason: "max_output_tokens"` when the token limit ended it
(`cancelled` after `/v1/cancel`); `usage` (`input_tokens`, of which
`input_tokens_details.cached_tokens` came from the prefix cache, `output_tokens`,
`total_tokens`). `output_text` (the SDKs' property over `output`) is also in the JSON,
for clients without an SDK.

A stream is the Responses event sequence, each `event: <type>\\ndata: {json}` with a
`sequence_number` counting from 0: `response.created`, `response.in_progress`, then per
output item `response.output_item.added` and, for a message, `response.content_part.added`,
`response.output_text.delta`*, `response.output_text.done`, `response.content_part.done`,
for a reasoning item the same with a `reasoning_text` part and
`response.reasoning_text.delta`* / `.done`, or, for a call, `response.function_call_arguments.delta`*,
`response.function_call_arguments.done`; then `response.output_item.done`; last
`response.completed` (or `response.incomplete`, as OpenAI sends for a truncated answer,
and for a cancelled one, whose status says `cancelled`). A reply that can have no calls
opens its message item at once (after the reasoning item, with thinking sections). A failure mid-stream is an `error` event. Errors use the
OpenAI envelope.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator
from quart import Blueprint, Response, current_app, request

from api import generation, images
from api.errors import APIError
from api.generation import GenerationRun, RowOutput
from api.limits import check_asked_tokens, check_prompt_tokens, max_tokens
from api.output_blocks import Block, BlockEvent, OutputBlocks
from api.offload import parse_body_off_loop, run_cpu_if
from api.priority import request_priority
from api.prompts import chat_prompt_images, check_model, heavy_chat
from api.protocol import StrictBody
from api.reasoning import thinking_budget
from api.template_kwargs import template_kwargs
from api.sse import named_event as event, sse_response
from api.state import json_response, state_of
from api.structured import (PLAIN_TEXT, OutputPlan, ToolRequest, check_grammar, json_object_constraint,
                            json_schema_constraint, tool_request)
from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.request import Job, RowSampling

if TYPE_CHECKING:  # the facade's module imports jax; only its type is needed here
    from ferrox_jax.engine import Engine

blueprint = Blueprint("responses", __name__)

ROUTE = "/v1/responses"
ROLES = ("user", "assistant", "system", "developer")
TEXT_PART_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(StrictBody):
    model: str | None = None
    input: Any = Field(..., description="a string or a list of input items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None  # [{"type": "function", "name", "description", "parameters", "strict"}]
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None  # None: true
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: Any = None  # {"effort"}: mapped onto the template's thinking switch (api/template_kwargs.py)
    thinking_token_budget: int | None = Field(None, ge=0)  # as on chat; or reasoning.max_tokens
    priority: int | None = None  # ours (vLLM's field): lower first under --scheduling-policy priority

    @field_validator("input", mode="plain")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        if isinstance(v, str) or (isinstance(v, list) and all(isinstance(item, dict) for item in v)):
            return v
        raise ValueError("input must be a string or a list of input items")


def _effort_kwargs(body: ResponsesRequest, engine: Engine) -> dict[str, Any] | None:
    """`reasoning.effort` as chat's `reasoning_effort` (a 400 names `reasoning.effort`)."""
    if body.reasoning is None:
        return None
    if not isinstance(body.reasoning, dict):
        raise APIError(400, "reasoning must be an object", param="reasoning", code="invalid_value")
    try:
        return template_kwargs(None, body.reasoning.get("effort"), engine.tokenizer.chat_template)
    except APIError as e:
        raise APIError(400, e.message, param="reasoning.effort", code="invalid_value") from None


def _thinking_cap(body: ResponsesRequest) -> int | None:
    """The thinking tokens after which `</think>` is forced: `reasoning.max_tokens` (as
    OpenRouter spells it) or `thinking_token_budget` (vLLM's), not both; None: no cap."""
    cap = body.reasoning.get("max_tokens") if isinstance(body.reasoning, dict) else None
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise APIError(400, f"reasoning.max_tokens must be a whole number >= 0; got {cap!r}",
                       param="reasoning.max_tokens", code="invalid_value")
    if cap is not None and body.thinking_token_budget is not None:
        raise APIError(400, "give one of reasoning.max_tokens or thinking_token_budget",
                       param="thinking_token_budget", code="invalid_value")
    return cap if cap is not None else body.thinking_token_budget


def _text_parts(content: Any, param: str, images_ok: bool = False) -> Any:
    """A string, or input_text / output_text parts joined by newlines; with `images_ok` (a user
    message), input_image parts too, and then the template's item list (api/images.py)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of text parts", param=param)
    texts, items = [], []
    for j, part in enumerate(content):
        if images_ok and isinstance(part, dict) and part.get("type") == "input_image":
            items.append({"type": "image"})  # its bytes: `_image_parts`, in the same order
            continue
        if not (isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str)):
            raise APIError(400, f"{param}[{j}]: only input_text / output_text (and input_image in a user "
                                "message) parts are supported", param=f"{param}[{j}]")
        texts.append(part["text"])
        items.append({"type": "text", "text": part["text"]})
    return items if len(items) > len(texts) else "\n".join(texts)


def _image_parts(body: ResponsesRequest) -> list[tuple[dict, str]]:
    """The user messages' input_image parts in prompt order, with their params."""
    if isinstance(body.input, str):
        return []
    return [(part, f"input[{i}].content[{j}]") for i, item in enumerate(body.input)
            if item.get("type", "message") == "message" and item.get("role") == "user"
            and isinstance(item.get("content"), list)
            for j, part in enumerate(item["content"]) if isinstance(part, dict) and part.get("type") == "input_image"]


def _call(item: dict, i: int) -> dict:
    """A `function_call` input item as a chat tool call."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise APIError(400, f"input[{i}]: a function_call item needs call_id, name and arguments (a JSON string)",
                       param=f"input[{i}]")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _turns(body: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat-template turns: function_call items join the
    assistant turn before them (or make one), function_call_output items are tool turns."""
    turns = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return turns + [{"role": "user", "content": body.input}]
    if not body.input:
        raise APIError(400, "input must not be empty", param="input")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "function_call":
            if turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(_call(item, i))
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [_call(item, i)]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or "output" not in item:
                raise APIError(400, f"input[{i}]: a function_call_output item needs call_id and output",
                               param=f"input[{i}]")
            turns.append({"role": "tool", "tool_call_id": item["call_id"],
                          "content": _text_parts(item["output"], f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # a reply's reasoning item sent back: earlier turns' thinking is not rendered
        elif kind == "message" and item.get("role") in ROLES:
            turns.append({"role": item["role"], "content": _text_parts(item.get("content"), f"input[{i}].content",
                                                                       images_ok=item["role"] == "user")})
        else:
            raise APIError(400, f"input[{i}]: only message items with a role in {ROLES}, function_call and "
                                f"function_call_output items are supported (got type {kind!r})", param=f"input[{i}]")
    if not turns:
        raise APIError(400, "input has nothing to render: reasoning items alone are dropped", param="input")
    return turns


_TOOL_CHOICE_SHAPE = 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'


def _tools(body: ResponsesRequest, engine: Engine) -> ToolRequest | None:
    """The function tools and tool choice as the neutral ToolRequest (`strict` is
    accepted: a forced call always matches its parameters)."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function":
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported; only function tools",
                           param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, _TOOL_CHOICE_SHAPE, param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "none", "auto", "required"):
        raise APIError(400, _TOOL_CHOICE_SHAPE, param="tool_choice")
    return tool_request(tools, choice, body.parallel_tool_calls, engine)


def _constraint(body: ResponsesRequest) -> tuple[GrammarSpec | str | None, str]:
    """`text.format` as the request's constraint: a GrammarSpec, PLAIN_TEXT or None."""
    fmt = (body.text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None:
        return None, "text.format"
    if kind == "text":
        return PLAIN_TEXT, "text.format"
    if kind == "json_object":
        return json_object_constraint(), "text.format"
    if kind == "json_schema":
        param = "text.format.schema"
        if fmt.get("schema") is None:
            raise APIError(400, f"{param} is required for text.format type json_schema", param=param)
        return json_schema_constraint(fmt["schema"], strict=bool(fmt.get("strict")), param=param), param
    raise APIError(400, f"text.format.type must be text, json_schema or json_object; got {kind!r}",
                   param="text.format")


@blueprint.post(ROUTE)
async def create_response() -> Response:
    state = state_of(current_app)
    body: ResponsesRequest = await parse_body_off_loop(await request.get_data(), ResponsesRequest)
    engine = state.require_engine()
    priority = request_priority(body.priority, engine)
    check_model(body.model, engine)
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server keeps no responses "
                            "(store is ignored); send the whole conversation as input",
                       param="previous_response_id")
    check_asked_tokens(body.max_output_tokens, state.config, "max_output_tokens")
    cap = _thinking_cap(body)
    constraint, constraint_param = _constraint(body)
    parts = _image_parts(body)
    images.check_count(engine, len(parts), state.config, parts[0][1] if parts else "input")
    pictures = await images.prepare(engine, [images.part_bytes(p, param) for p, param in parts], state.config,
                                    "input")
    turns = await run_cpu_if(isinstance(body.input, list) and heavy_chat(body.input), _turns, body)
    tools = await run_cpu_if(bool(body.tools), _tools, body, engine)  # a forced call compiles schemas
    prompt, plan, spans = await chat_prompt_images(
        engine, turns, "input", pictures=pictures, tools=tools, constraint=constraint,
        constraint_param=constraint_param, default_constraint=state.config.default_grammar,
        template_kwargs=_effort_kwargs(body, engine))
    check_prompt_tokens(len(prompt), state.config, "input")
    grammar = await check_grammar(engine, plan.grammar, plan.grammar_param)
    api_id = f"resp_{uuid.uuid4().hex}"
    sampling = RowSampling(temperature=1.0 if body.temperature is None else body.temperature,
                           top_p=1.0 if body.top_p is None else body.top_p,
                           seed=None)  # Responses has no seed: the engine draws one
    limit = max_tokens(body.max_output_tokens, len(prompt), engine.max_context, state.config, "input")
    job = Job(request_id=api_id, prompt_token_ids=tuple(prompt), max_tokens=limit, sampling=sampling,
              grammar=grammar, skip_special_tokens=plan.skip_special_tokens, images=spans, priority=priority,
              thinking_budget=thinking_budget(engine.tokenizer, cap, has_sections=plan.reasoning,
                                              starts_inside=plan.starts_in_reasoning))
    run = GenerationRun(state, ROUTE, api_id, [job], stream=bool(body.stream), engine=engine, model=body.model)
    reply = _Response(run, engine.model_name, body, sampling, plan)
    generation.start(run)
    if run.stream:
        return sse_response(reply.stream(), api_id)
    await generation.collect(run, reply.fold)
    return json_response(reply.response(), headers={"X-Request-Id": api_id})


class _Response:
    """One run's events as a Responses `response`, whole or as its event stream."""

    def __init__(self, run: GenerationRun, model: str, body: ResponsesRequest, sampling: RowSampling,
                 plan: OutputPlan = OutputPlan()) -> None:
        self.run, self.model, self.body, self.sampling = run, model, body, sampling
        self.created_at = int(time.time())
        self.output = OutputBlocks(plan)
        self.item_ids: list[str] = []  # per output block: "rs_…" thinking, "msg_…" text, "fc_…" a call
        self.finish_reason: str | None = None
        self.sequence_number = 0

    def fold(self, output: RowOutput) -> list[BlockEvent]:
        event = output.event
        events = self.output.feed(event.text) if event.text else []
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            events += self.output.finish()
        return events

    @property
    def status(self) -> Literal["in_progress", "completed", "incomplete", "cancelled"]:
        return {None: "in_progress", "length": "incomplete", "cancelled": "cancelled"}.get(
            self.finish_reason, "completed")

    def _item_id(self, index: int) -> str:
        while len(self.item_ids) <= index:
            block = self.output.blocks[len(self.item_ids)]
            prefix = {"thinking": "rs", "text": "msg"}.get(block.kind)
            self.item_ids.append(f"{prefix}_{uuid.uuid4().hex}" if prefix
                                 else "fc_" + block.call_id.removeprefix("call_"))
        return self.item_ids[index]

    def _item(self, index: int, block: Block, done: bool) -> dict:
        """Output item `index`; an item the output has gone past is completed, the last one
        is as complete as the response."""
        status = "in_progress"
        if done:
            is_last = index == len(self.output.blocks) - 1
            status = "completed" if not is_last or self.status == "completed" else "incomplete"
        if block.kind == "thinking":
            return {"type": "reasoning", "id": self._item_id(index), "summary": [],
                    "content": [_reasoning_part(block.text)] if done else [], "status": status}
        if block.kind == "call":
            return {"type": "function_call", "id": self._item_id(index), "call_id": block.call_id,
                    "name": block.name, "arguments": block.text if done else "", "status": status}
        return {"type": "message", "id": self._item_id(index), "status": status, "role": "assistant",
                "content": [_part(block.text)] if done else []}

    def response(self, done: bool = True) -> dict:
        run, body = self.run, self.body
        status = self.status if done else "in_progress"
        usage = {"input_tokens": run.num_prompt_tokens,
                 "input_tokens_details": {"cached_tokens": run.num_cached_tokens},
                 "output_tokens": run.num_completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": run.num_prompt_tokens + run.num_completion_tokens}
        blocks = self.output.blocks if done else []
        return {"id": run.api_id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.model, "output": [self._item(i, b, True) for i, b in enumerate(blocks)],
                "output_text": "".join(b.text for b in blocks if b.kind == "text"),
                "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
                "store": False, "temperature": self.sampling.temperature,
                "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
                "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
                "tools": body.tools or [], "top_p": self.sampling.top_p, "truncation": "disabled",
                "usage": usage if done else None, "user": body.user, "metadata": body.metadata or {}}

    def _event(self, kind: str, **fields: Any) -> bytes:
        frame = event(kind, {"type": kind, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1
        return frame

    def _block_frames(self, e: BlockEvent) -> list[bytes]:
        """One block event as its Responses stream events."""
        block, where = e.block, {"item_id": self._item_id(e.index), "output_index": e.index}
        text_where = {**where, "content_index": 0}
        if e.kind == "start":
            added = [self._event("response.output_item.added", output_index=e.index,
                                 item=self._item(e.index, block, done=False))]
            if block.kind != "call":
                empty = _part("") if block.kind == "text" else _reasoning_part("")
                added.append(self._event("response.content_part.added", **text_where, part=empty))
            return added
        if e.kind == "delta" and block.kind == "thinking":
            return [self._event("response.reasoning_text.delta", **text_where, delta=e.delta)]
        if e.kind == "delta" and block.kind == "text":
            return [self._event("response.output_text.delta", **text_where, delta=e.delta, logprobs=[])]
        if e.kind == "delta":
            return [self._event("response.function_call_arguments.delta", **where, delta=e.delta)]
        item = self._item(e.index, block, done=True)
        if block.kind == "thinking":
            done = [self._event("response.reasoning_text.done", **text_where, text=block.text),
                    self._event("response.content_part.done", **text_where, part=item["content"][0])]
        elif block.kind == "text":
            done = [self._event("response.output_text.done", **text_where, text=block.text, logprobs=[]),
                    self._event("response.content_part.done", **text_where, part=item["content"][0])]
        else:
            done = [self._event("response.function_call_arguments.done", **where, arguments=block.text)]
        return done + [self._event("response.output_item.done", output_index=e.index, item=item)]

    def _frames(self, output: RowOutput) -> list[bytes]:
        return [frame for e in self.fold(output) for frame in self._block_frames(e)]

    def _end(self) -> list[bytes]:
        final = "response.completed" if self.status == "completed" else "response.incomplete"
        return [self._event(final, response=self.response())]

    def _error(self, e: APIError) -> bytes:
        return self._event("error", code=e.code, message=e.message, param=e.param)

    async def stream(self):
        yield self._event("response.created", response=self.response(done=False))
        yield self._event("response.in_progress", response=self.response(done=False))
        for e in self.output.start():
            for frame in self._block_frames(e):
                yield frame
        async for frame in generation.stream(self.run, self._frames, keepalive=b": keep-alive\n\n", end=self._end,
                                             error=self._error):
            yield frame


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}
