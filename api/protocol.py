"""The OpenAI wire format: request models, response shapes and the error envelope.

Requests are validated here, before the engine sees them: bodies are parsed
with pydantic in strict mode from the raw JSON, so `"temperature": "0.5"` or
`"n": 1.0` is a 400 naming its `param` instead of a silent coercion. Unknown fields
are ignored (tools built for vLLM send extras of their own). `StrictBody` says so once;
every protocol's request models (here and in each adapter module) derive from it.

Every refusal is an `APIError` (`api/errors.py`), rendered in the envelope of the route's
protocol by `api/app.py`. Response *models* below exist for `/openapi.json`; handlers
build the same shapes as plain dicts.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from api.errors import APIError
from ferrox_jax.request import MAX_LOGPROBS


# ---------------------------------------------------------------- request models


class StrictBody(BaseModel):
    """The base of every request body the API parses, in every protocol: strict types (no
    "0.5" for a float, no 1.0 for an int), unknown fields ignored (clients built for other
    servers send extras of their own), no NaN or infinity."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictBody):
    include_usage: bool | None = False


class JSONSchemaFormat(StrictBody):
    """`response_format.json_schema`: OpenAI's structured-output schema."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # True: a keyword the engine cannot enforce is a 400 and objects get
    # additionalProperties false unless they say otherwise; False (OpenAI's default): best effort.
    strict: bool | None = False


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(StrictBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM) and 0 both mean off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(1, ge=1)
    stop: Any = None  # str | list[str]; checked below for a clean message
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    thinking_token_budget: int | None = Field(None, ge=0)  # vLLM's: </think> forced after N thinking tokens
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stream_resumable: bool | None = False  # ferrox: replayable stream, not cancelled by a disconnect
    priority: int | None = None  # vLLM's: lower first under --scheduling-policy priority (api/priority.py)
    user: str | None = None
    # Output constraints (docs/structured-output.md), at most one: OpenAI's response_format,
    # or vLLM's guided_* extensions.
    response_format: ResponseFormat | None = None
    guided_json: Any = None  # a JSON schema, as an object or its JSON text (best effort, like strict false)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark, or llama.cpp GBNF (told apart by `::=`)

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("stop must be a string or a list of strings")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CompletionRequest(SamplingFields):
    prompt: Any = Field(..., description="string, list of strings, token ids, or list of token-id lists")
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if all(_is_int(t) for t in v):
                return v
            if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in v):
                return v
        raise ValueError("prompt must be a string, a non-empty list of strings, "
                         "a list of token ids, or a list of token-id lists")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (each a string or a token-id list)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(_is_int(t) for t in p):
            return [list(p)]
        return list(p)


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | list of text and image parts (api/images.py) | None (assistant tool calls)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            for part in v:
                if not (isinstance(part, dict) and (part.get("type") == "text" and isinstance(part.get("text"), str)
                                                    or part.get("type") == "image_url")):
                    raise ValueError('content parts must be {"type": "text", "text": str} or '
                                     '{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}')
            return v
        raise ValueError("content must be a string or a list of text and image parts")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content if part.get("type") == "text")

    def image_parts(self) -> list[dict[str, Any]]:
        """The message's image parts, in order (api/images.py reads them)."""
        return [p for p in self.content if p.get("type") == "image_url"] if isinstance(self.content, list) else []

    def template_dict(self) -> dict[str, Any]:
        content: Any = self.text()
        if self.image_parts():  # the vision templates place an image where its item is
            content = [{"type": "image"} if p.get("type") == "image_url" else {"type": "text", "text": p["text"]}
                       for p in self.content]
        d: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True
    tools: list[dict[str, Any]] | None = None  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None  # None: true
    # Template variables and history (api/template_kwargs.py, api/sessions.py); their
    # shapes are checked there, for messages that name the field.
    chat_template_kwargs: Any = None
    reasoning_effort: Any = None
    session_id: Any = None


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: rendered as a chat request's tools
    add_special_tokens: bool | None = True
    chat_template_kwargs: Any = None  # with messages: as on chat (api/template_kwargs.py)
    reasoning_effort: Any = None


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


class CancelRequest(StrictBody):
    request_id: str


# ---------------------------------------------------------------- response models (schema only)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "cancelled"] | None


class CompletionResponse(BaseModel):
    id: str
    request_id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is only tool calls
    reasoning_content: str | None = None  # templates with thinking sections only
    reasoning: str | None = None  # the same text under the field's newer name
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "cancelled"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    request_id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelObject(BaseModel):
    """One `/v1/models` entry on the wire (OpenAI's model object, with vLLM's `max_model_len`,
    `root` and `parent`): the engine's `ModelCard` as `openai_routes._model_object` renders
    it, and an adapter's entry (`api/lora_routes.py:lora_cards`) built from that."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int
    architecture: str | None = None
    dtype: str | None = None  # compute dtype
    quantization: str | None = None  # none, int8 or w8a8
    kv_cache_dtype: str | None = None
    image_input: bool = False  # the model takes image parts (docs/api.md, "Images")
    root: str | None = None  # a LoRA adapter: its folder
    parent: str | None = None  # a LoRA adapter: the base model's id


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str  # vLLM's name for the text
    text: str


class CancelResponse(BaseModel):
    request_id: str
    cancelled: bool


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------- parsing


def _param_name(loc: tuple) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def json_or_none(raw: bytes) -> Any:
    """The body as JSON, or None when it is not UTF-8 JSON (the caller's 400 says what to
    send). Quart's `get_json(silent=True)` lets a non-UTF-8 body's UnicodeDecodeError out."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Validate a raw request body against `model`; raise a 400 APIError naming the param.

    Args:
      raw: the body bytes as received.
      model: the pydantic request model.
    Returns:
      the validated model instance.
    """
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_body") from None
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {err['msg']}", code="invalid_json") from None
        param = _param_name(tuple(err["loc"]))
        if param is None:
            raise APIError(400, f"request body must be a JSON object: {err['msg']}", code="invalid_body") from None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "field required"
        raise APIError(400, f"{param}: {msg}", param=param, code="invalid_value") from None


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as string": bias in [-100, 100]} -> ((id, bias), ...)."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids; got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise APIError(400, f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias values must be in [-100, 100]; got {value} for {token_id}",
                           param="logit_bias")
        out.append((token_id, float(value)))
    return tuple(sorted(out))


def dumps(obj: Any) -> str:
    """Compact JSON for the wire (non-ASCII kept as is; the body is UTF-8)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
