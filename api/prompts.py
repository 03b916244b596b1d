"""Prompt preparation every adapter shares: the model check, tokenizing, chat rendering.

Adapters turn their own message shapes into the chat template's `{"role", "content", ...}`
dicts (OpenAI's roles; `tool_calls` / `tool_call_id` for tool turns), their tools into a
`ToolRequest` and their output format into a constraint (`api/structured.py`), and call
`chat_prompt` (or `encode` for raw text); the token ids go into `Job`s and
the output plan says how to constrain and parse what comes back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api import images
from api.errors import APIError
from api.lora_routes import lora_names
from api.offload import run_cpu, run_cpu_if
from api.structured import OutputPlan, ToolRequest, prepare_chat

if TYPE_CHECKING:
    from ferrox_jax.engine import Engine
    from ferrox_jax.constraint import GrammarSpec

ENCODE_INLINE_CHARS = 16_384  # longer prompts are tokenized in the CPU pool (api/offload.py)
INLINE_MESSAGES = 32  # longer conversations are rendered in the CPU pool


def check_model(name: str | None, engine: Engine) -> None:
    """404 `model_not_found` unless `name` is absent, the served model's id or a loaded
    LoRA adapter's name (`api/lora_routes.py`)."""
    if name is not None and name != engine.model_name and name not in lora_names(engine):
        raise APIError(404, f"model {name!r} not found; this server serves {engine.model_name!r}",
                       param="model", code="model_not_found")


async def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; long texts are encoded off the event loop (a 4 MiB body takes ~1 s)."""
    if len(text) < ENCODE_INLINE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await run_cpu(tokenizer.encode, text, add_special_tokens)


def heavy_chat(messages: list[Any], tools: Any = None) -> bool:
    """Whether preparing `messages` (dicts or the request's message models) belongs in the
    CPU pool: many messages, long contents, or tools (a forced call compiles their schemas)."""
    if tools or len(messages) > INLINE_MESSAGES:
        return True
    contents = (m.get("content") if isinstance(m, dict) else getattr(m, "content", None) for m in messages)
    return sum(len(c) if isinstance(c, str) else len(str(c or "")) for c in contents) > ENCODE_INLINE_CHARS


async def chat_prompt(engine: Engine, messages: list[dict], param: str = "messages",
                      **kwargs: Any) -> tuple[list[int], OutputPlan]:
    """`chat_prompt_images` of a conversation without images: its token ids and output plan."""
    ids, plan, _ = await chat_prompt_images(engine, messages, param, **kwargs)
    return ids, plan


async def chat_prompt_images(engine: Engine, messages: list[dict], param: str = "messages", *,
                             pictures: list[tuple[Any, bytes]] = (), tools: ToolRequest | None = None,
                             constraint: GrammarSpec | str | None = None, constraint_param: str = "response_format",
                             default_constraint: GrammarSpec | None = None, split_reasoning: bool = True,
                             template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], OutputPlan, tuple]:
    """Rendered (as the OpenAI chat route renders it: `api/structured.py:prepare_chat`, so a
    history's tool turns and the tools come out the same) and tokenized conversation, its
    output plan, and its images' spans (`pictures`: `api/images.py:prepare`'s, in the order the
    messages' `{"type": "image"}` items stand). Thinking sections are split as on chat (the
    Anthropic and Responses adapters render them as thinking blocks / reasoning items) unless
    `split_reasoning` is False, which keeps them in the text. A template error or an empty
    result is a 400 naming `param`."""
    chat = await run_cpu_if(heavy_chat(messages, tools), prepare_chat, engine.tokenizer, messages, tools=tools,
                            constraint=constraint, constraint_param=constraint_param,
                            default_constraint=default_constraint, messages_param=param,
                            split_reasoning=split_reasoning, template_kwargs=template_kwargs)
    text = images.expand(chat.text, engine, pictures, param)
    ids = await encode(engine.tokenizer, text, add_special_tokens=False)
    if not ids:
        raise APIError(400, f"{param} render to an empty prompt", param=param)
    return ids, chat.plan, images.spans(ids, engine, list(pictures), param)
