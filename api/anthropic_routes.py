"""The Anthropic Messages adapter: `POST /v1/messages` and `/v1/messages/count_tokens`.

Anthropic's wire format only; the generation core (`api/generation.py`) and the neutral
tools and output pieces (`api/structured.py`, `api/output_blocks.py`) do the rest.
A request's `system` (a string or text blocks) and `messages` (text, `tool_use` and
`tool_result` blocks; an assistant's `thinking` blocks are accepted and dropped) become chat-template turns (OpenAI's roles: tool uses are an
assistant's `tool_calls`, tool results `tool` turns), rendered and tokenized like chat.
`tools` (`{name, description, input_schema}`; server tools such as web search are 400s)
are the neutral tools with input_schema as parameters, rendered into the prompt as chat
renders them (count_tokens counts them too); `tool_choice` `{"type": "auto"}` (the
default with tools) parses calls the model writes, `none` renders no tools, `any` and
`{"type": "tool", "name"}` force a call with a grammar (as OpenAI's "required" and named
choices), and `disable_parallel_tool_use` allows one call. A server-wide default
constraint (`--json-schema` ...) applies as on chat.

Thinking: with a template that has thinking sections (`<think>`), the section becomes a
`{"type": "thinking", "thinking", "signature": ""}` block before the text (the signature
is empty: nothing signs it). The request's `thinking` (`{"type": "enabled",
"budget_tokens": N >= 1024}`, `{"type": "adaptive"}`, `{"type": "disabled"}`) is
validated (otherwise a 400); `enabled` caps the section at N tokens (`</think>` is forced
there: `api/reasoning.py:thinking_budget`), `disabled` keeps the section in the text, as
before thinking blocks; absent splits as enabled does.

Reply: `{"type": "message", "content": [blocks], "stop_reason", "stop_sequence", "usage":
{"input_tokens", "output_tokens", "cache_creation_input_tokens": 0, "cache_read_input_tokens"}}`
(the prompt tokens the prefix cache served are `cache_read_input_tokens`, the rest
`input_tokens`, as Anthropic splits a prompt that hit its cache); the `request-id` header carries the id `/v1/cancel`
takes. Content is a thinking block (see above), a text block, then a `tool_use` block (`{"id": "toolu_…", "name",
"input": {...}}`) per call; a reply of calls alone has no text block, a reply without
tools always one. Stop reasons: calls and a normal end -> `tool_use`; a stop string ->
`stop_sequence` (and which one, from the engine's `RowEvent.stop_string`); end of
generation -> `end_turn`; the token limit -> `max_tokens`; a cancel -> `cancelled`
(ferrox's, as on the OpenAI routes).

A stream is Anthropic's event sequence, each `event: <type>\\ndata: {json}`:
`message_start`, `ping`, then per block `content_block_start` (the block empty: text "",
tool_use input {}, thinking "" with signature ""), `content_block_delta`* (`thinking_delta`,
`text_delta`, or `input_json_delta` with `partial_json`, pieces of the input's JSON; a
thinking block's last delta is its `signature_delta`), `content_block_stop`; then `message_delta`
(stop reason, the final usage: `message_start`'s cannot know the cache hits yet), `message_stop`. A reply without tools or thinking opens its text block
before the first `ping` (no tools, or `tool_choice` none: no calls can come). `ping`
again while idle; a failure mid-stream is an `error` event.

Errors, on every path under /v1/messages (`api/app.py` picks this envelope by route):
`{"type": "error", "error": {"type", "message"}}` with Anthropic's status codes and types;
our 503s (queue full, loading, draining) are Anthropic's 529 `overloaded_error`.

Defaults are Anthropic's: temperature 1.0 (range [0, 1]), top_p and top_k off. Recent
`anthropic` clients send temperature / top_p / top_k only through `extra_body`.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator
from quart import Blueprint, Response, current_app, request

from api import generation, images
from api.errors import APIError
from api.generation import GenerationRun, RowOutput
from api.limits import check_asked_tokens, check_prompt_tokens, check_stop_strings, max_tokens
from api.output_blocks import Block, BlockEvent, OutputBlocks
from api.offload import parse_body_off_loop, run_cpu_if
from api.priority import request_priority
from api.prompts import chat_prompt_images, check_model, heavy_chat
from api.protocol import StrictBody
from api.reasoning import thinking_budget
from api.sse import named_event as event, sse_response
from api.state import AppState, json_response, state_of
from api.structured import OutputPlan, ToolRequest, check_grammar, tool_request
from ferrox_jax.request import Job, RowEvent, RowSampling

if TYPE_CHECKING:  # the facade's module imports jax; only its type is needed here
    from ferrox_jax.engine import Engine

blueprint = Blueprint("anthropic", __name__)

ROUTE = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               504: "timeout_error", 529: "overloaded_error"}
PING = event("ping", {"type": "ping"})  # sent once after the block starts, then while idle


def error_response(e: APIError) -> tuple[int, dict]:
    """Anthropic's status and envelope for a refusal (our 503 is their 529 overloaded_error)."""
    status = 529 if e.status == 503 else e.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": e.message}}


# ---------------------------------------------------------------- request shape


def _text_or_blocks(v: Any, optional: bool = False) -> Any:
    if (v is None and optional) or isinstance(v, str) or (isinstance(v, list) and all(isinstance(b, dict) for b in v)):
        return v
    raise ValueError("must be a string or a list of content blocks")


class MessageParam(StrictBody):
    # "system" is not Anthropic's (its system prompt is the top-level field), but recent
    # clients (Claude Code) send one inside `messages`: it is folded into the system prompt.
    role: Literal["user", "assistant", "system"]
    content: Any

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, v: Any) -> Any:
        return _text_or_blocks(v)


class CountTokensRequest(StrictBody):
    model: str
    messages: list[MessageParam] = Field(..., min_length=1)
    system: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None  # checked by `_splits_thinking`

    @field_validator("system", mode="plain")
    @classmethod
    def _system(cls, v: Any) -> Any:
        return _text_or_blocks(v, optional=True)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    priority: int | None = None  # ours (vLLM's field): lower first under --scheduling-policy priority

    @field_validator("metadata", mode="plain")
    @classmethod
    def _metadata(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise ValueError("metadata must be an object")
        return v


def _text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{param}.text: a string is required", param=f"{param}.text")
    return block["text"]


def _system_text(system: str | list[dict] | None, param: str = "system") -> str:
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for j, block in enumerate(system):
        if block.get("type") != "text":
            raise APIError(400, f"{param}[{j}]: only text blocks are supported", param=f"{param}[{j}]")
        parts.append(_text(block, f"{param}[{j}]"))
    return "\n".join(parts)


def _tool_result_text(block: dict, param: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(b, f"{param}.content[{k}]") for k, b in enumerate(content)
                         if isinstance(b, dict) and b.get("type") == "text")
    raise APIError(400, f"{param}.content must be a string or text blocks", param=f"{param}.content")


def _turns(message: MessageParam, i: int) -> list[dict]:
    """One Anthropic message as chat-template turns (tool results become `tool` turns)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    turns, texts, calls, items = [], [], [], []
    for j, block in enumerate(message.content):
        param = f"messages[{i}].content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, param))
            items.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and message.role == "user":
            items.append({"type": "image"})  # its bytes: `_image_blocks`, in the same order
        elif kind == "tool_use" and message.role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{param}: tool_use needs a name and an input object", param=param)
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # a reply's thinking sent back (tool loops must): earlier turns' thinking is not rendered
        elif kind == "tool_result" and message.role == "user":
            turns.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                          "content": _tool_result_text(block, param)})
        else:
            raise APIError(400, f"{param}: content blocks of type {kind!r} are not supported in a "
                                f"{message.role} message (text, image, thinking, tool_use, tool_result)", param=param)
    if texts or calls or items:
        content = items if any(item["type"] == "image" for item in items) else "\n".join(texts)
        turn: dict[str, Any] = {"role": message.role, "content": content}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool" names one: forced


def _tools(body: CountTokensRequest, engine: Engine) -> ToolRequest | None:
    """Anthropic's `tools` and `tool_choice` as the neutral ToolRequest: a tool's
    input_schema is its parameters; `any` and `tool` force a call (with a grammar) as
    OpenAI's "required" and named choices do; `disable_parallel_tool_use` allows one call."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        kind = (tool.get("type") or "custom") if isinstance(tool, dict) else type(tool).__name__
        if kind != "custom":
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported; only client tools "
                                "(name, description, input_schema)", param="tools")
        if "input_schema" not in tool:
            raise APIError(400, f"tools[{i}].input_schema: Field required", param="tools")
        tools.append({"type": "function", "function": {"name": tool.get("name"), "parameters": tool["input_schema"],
                                                       "description": tool.get("description", "")}})
    choice = body.tool_choice
    if choice is None:
        return tool_request(tools, None, None, engine)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
        raise APIError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name"}',
                       param="tool_choice")
    disable_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable_parallel, bool):
        raise APIError(400, "tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    if kind != "none" and not tools:
        raise APIError(400, f"tool_choice {kind!r} needs tools", param="tool_choice")
    neutral = {"type": "function", "function": {"name": choice["name"]}} if kind == "tool" else _TOOL_CHOICES[kind]
    return tool_request(tools, neutral, not disable_parallel, engine)


MIN_THINKING_BUDGET_TOKENS = 1024  # Anthropic's lower bound for budget_tokens


def _splits_thinking(thinking: Any) -> bool:
    """Whether a request's `thinking` lets the template's thinking sections become thinking
    blocks: absent, `enabled` or `adaptive` do; `disabled` keeps them in the text. Only
    `budget_tokens` changes generation: the section is cut there (`_budget_tokens`)."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is None or kind == "adaptive":
        return True
    if kind == "disabled":
        return False
    if kind != "enabled":
        raise APIError(400, 'thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} '
                            'or {"type": "disabled"}', param="thinking")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET_TOKENS:
        raise APIError(400, f"thinking.budget_tokens: an integer >= {MIN_THINKING_BUDGET_TOKENS} is required; "
                            f"got {budget!r}", param="thinking.budget_tokens")
    return True


def _budget_tokens(thinking: Any) -> int | None:
    """`thinking.budget_tokens` of an `enabled` request (validated by `_splits_thinking`),
    the thinking tokens after which `</think>` is forced; None otherwise."""
    return thinking.get("budget_tokens") if isinstance(thinking, dict) and thinking.get("type") == "enabled" else None


def _folded_system(body: CountTokensRequest) -> str:
    """The system prompt: the top-level `system`, then the text of every `system` message
    inside `messages`, in order, one paragraph each (where in the conversation such a
    message stood is not kept: chat templates take one system turn, first)."""
    parts = [_system_text(body.system)]
    for i, message in enumerate(body.messages):
        if message.role == "system":
            parts.append(_system_text(message.content, f"messages[{i}].content"))
    return "\n\n".join(part for part in parts if part)


def _conversation(body: CountTokensRequest) -> list[dict]:
    system = _folded_system(body)
    turns = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(body.messages):
        if message.role != "system":
            turns.extend(_turns(message, i))
    if not any(turn["role"] != "system" for turn in turns):
        raise APIError(400, "messages: at least one user or assistant message is required", param="messages")
    return turns


def _image_blocks(body: CountTokensRequest) -> list[tuple[dict, str]]:
    """The user messages' image blocks in prompt order, with their params."""
    return [(block, f"messages[{i}].content[{j}]") for i, message in enumerate(body.messages)
            if message.role == "user" and not isinstance(message.content, str)
            for j, block in enumerate(message.content) if block.get("type") == "image"]


async def _prompt(body: CountTokensRequest, engine: Engine, state: AppState) -> tuple[list[int], OutputPlan, tuple]:
    blocks = _image_blocks(body)
    images.check_count(engine, len(blocks), state.config, blocks[0][1] if blocks else "messages")
    pictures = await images.prepare(engine, [images.part_bytes(b, param) for b, param in blocks], state.config,
                                    "messages")
    turns = await run_cpu_if(heavy_chat(body.messages), _conversation, body)
    tools = await run_cpu_if(bool(body.tools), _tools, body, engine)  # a forced call compiles schemas
    return await chat_prompt_images(engine, turns, pictures=pictures, tools=tools,
                                    default_constraint=state.config.default_grammar,
                                    split_reasoning=_splits_thinking(body.thinking))


# ---------------------------------------------------------------- routes


def _state() -> AppState:
    return state_of(current_app)


@blueprint.post(ROUTE + "/count_tokens")
async def count_tokens() -> Response:
    state = _state()
    body: CountTokensRequest = await parse_body_off_loop(await request.get_data(), CountTokensRequest)
    engine = state.require_engine()
    check_model(body.model, engine)
    prompt, _plan, _images = await _prompt(body, engine, state)
    return json_response({"input_tokens": len(prompt)})


@blueprint.post(ROUTE)
async def create_message() -> Response:
    state = _state()
    body: MessagesRequest = await parse_body_off_loop(await request.get_data(), MessagesRequest)
    engine = state.require_engine()
    priority = request_priority(body.priority, engine)
    check_model(body.model, engine)
    check_stop_strings(body.stop_sequences or [], state.config, "stop_sequences")
    check_asked_tokens(body.max_tokens, state.config)
    prompt, plan, spans = await _prompt(body, engine, state)
    check_prompt_tokens(len(prompt), state.config, "messages")
    grammar = await check_grammar(engine, plan.grammar, plan.grammar_param)
    api_id = f"msg_{uuid.uuid4().hex}"
    sampling = RowSampling(temperature=1.0 if body.temperature is None else body.temperature,
                           top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                           seed=None)  # Messages has no seed: the engine draws one
    job = Job(request_id=api_id, prompt_token_ids=tuple(prompt), sampling=sampling,
              max_tokens=max_tokens(body.max_tokens, len(prompt), engine.max_context,
                                    state.config, "messages"),
              stop=tuple(body.stop_sequences or ()), grammar=grammar,
              skip_special_tokens=plan.skip_special_tokens, images=spans, priority=priority,
              thinking_budget=thinking_budget(engine.tokenizer, _budget_tokens(body.thinking),
                                              has_sections=plan.reasoning, starts_inside=plan.starts_in_reasoning))
    run = GenerationRun(state, ROUTE, api_id, [job], stream=bool(body.stream), engine=engine, model=body.model)
    reply = _Message(run, engine.model_name, plan)
    generation.start(run)
    headers = {"request-id": api_id}
    if run.stream:
        response = sse_response(reply.stream(), api_id)
        response.headers.update(headers)
        return response
    await generation.collect(run, reply.fold)
    return json_response(reply.message(), headers=headers)


def stop_reason(event: RowEvent, finish_reason: str | None = None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for a row's last event; `finish_reason` is the parsed
    output's ("tool_calls" for a reply with calls that ended normally)."""
    reason = finish_reason or event.finish_reason
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "stop":
        return ("stop_sequence", event.stop_string) if event.stop_string is not None else ("end_turn", None)
    if reason == "length":
        return "max_tokens", None
    return reason, None


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a parsed call: the parser's random part after "toolu_"."""
    return "toolu_" + call_id.removeprefix("call_")


def content_block(block: Block, empty: bool = False) -> dict:
    """A block as Anthropic's content block; `empty` as a stream's content_block_start has it.
    A thinking block's signature is empty: no Anthropic key signs this server's thinking."""
    if block.kind == "thinking":
        return {"type": "thinking", "thinking": "" if empty else block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": "" if empty else block.text}
    return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
            "input": {} if empty else block.arguments()}


class _Message:
    """One run's events as an Anthropic message, whole or as its event stream."""

    def __init__(self, run: GenerationRun, model: str, plan: OutputPlan = OutputPlan()) -> None:
        self.run, self.model = run, model
        self.output = OutputBlocks(plan)
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def fold(self, output: RowOutput) -> list[BlockEvent]:
        event = output.event
        events = self.output.feed(event.text) if event.text else []
        if event.finish_reason is not None:
            events += self.output.finish()
            self.stop_reason, self.stop_sequence = stop_reason(event, self.output.finish_reason(event.finish_reason))
        return events

    def _usage(self) -> dict:
        """Anthropic's usage: `input_tokens` are the prompt tokens computed, those the prefix
        cache served are `cache_read_input_tokens` (the prompt is their sum, as Anthropic
        counts a cache hit); nothing is written to a cache on request, so no creation."""
        cached = self.run.num_cached_tokens
        return {"input_tokens": self.run.num_prompt_tokens - cached, "output_tokens": self.run.num_completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def message(self, content: list | None = None) -> dict:
        if content is None:
            content = [content_block(block) for block in self.output.blocks]
        return {"id": self.run.api_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self._usage()}

    def _frames(self, output: RowOutput) -> list[bytes]:
        return [frame for e in self.fold(output) for frame in _frames(e)]

    def _end(self) -> list[bytes]:
        return [event("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                                        "usage": self._usage()}),
                event("message_stop", {"type": "message_stop"})]

    async def stream(self):
        start = self.message(content=[])
        start["usage"]["output_tokens"] = 0
        yield event("message_start", {"type": "message_start", "message": start})
        for block_event in self.output.start():
            for frame in _frames(block_event):
                yield frame
        yield PING
        async for frame in generation.stream(self.run, self._frames, keepalive=PING, end=self._end,
                                             error=lambda e: event("error", error_response(e)[1])):
            yield frame


def _frames(e: BlockEvent) -> list[bytes]:
    """One block event as its Anthropic stream events (a thinking block's stop is preceded
    by its `signature_delta`, as Anthropic's stream has it)."""
    if e.kind == "start":
        return [event("content_block_start", {"type": "content_block_start", "index": e.index,
                                              "content_block": content_block(e.block, empty=True)})]
    stop = event("content_block_stop", {"type": "content_block_stop", "index": e.index})
    if e.kind == "stop" and e.block.kind != "thinking":
        return [stop]
    if e.kind == "stop":
        return [_delta(e.index, {"type": "signature_delta", "signature": ""}), stop]
    kind = e.block.kind
    delta = ({"type": "thinking_delta", "thinking": e.delta} if kind == "thinking"
             else {"type": "text_delta", "text": e.delta} if kind == "text"
             else {"type": "input_json_delta", "partial_json": e.delta})
    return [_delta(e.index, delta)]


def _delta(index: int, delta: dict) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
