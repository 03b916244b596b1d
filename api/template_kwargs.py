"""A chat request's own template variables: `chat_template_kwargs` and `reasoning_effort`.

`chat_template_kwargs` (vLLM's and llama.cpp's field) is an object of further variables the
checkpoint's chat template sees beside `messages` and `tools`: `{"enable_thinking": false}`
turns Qwen3's thinking off, other templates have switches of their own. The names the
server itself passes (`messages`, `tools`, `add_generation_prompt`, `documents`, the special
token strings) cannot be replaced: a 400 names the key.

`reasoning_effort` (OpenAI's `none`, `minimal`, `low`, `medium`, `high`) is handed to the
template as the variable `reasoning_effort` (gpt-oss-style templates read it) and, where
the template has a thinking switch of its own (a variable named `enable_thinking` or
`thinking` appears in its source), mapped onto it: `none` switches thinking off, every
other effort on. A key the request gives in `chat_template_kwargs` wins over the mapping.
A template without either variable renders as before: the effort is accepted and changes
nothing, as OpenAI accepts it for models that do not reason.

Plain Python, no engine: `api/openai_routes.py` and `api/tokenizer_routes.py` call
`template_kwargs` and pass the result to `api/structured.py:prepare_chat`.
"""

from __future__ import annotations

import re
from typing import Any

from api.errors import APIError

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# Variables the server sets itself (models/chat_template.py); a request cannot replace them.
RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "documents",
                            "bos_token", "eos_token", "unk_token", "pad_token"})
THINKING_SWITCHES = ("enable_thinking", "thinking")  # the on/off variables templates test


def thinking_switches(template: str | None) -> list[str]:
    """The thinking switches `template`'s source reads (whole-word matches)."""
    source = template or ""
    return [name for name in THINKING_SWITCHES if re.search(rf"\b{name}\b", source)]


def template_kwargs(kwargs: Any, reasoning_effort: Any, template: str | None) -> dict[str, Any] | None:
    """The template variables a request asks for (None: none).

    Args:
      kwargs: the request's `chat_template_kwargs` (an object or None).
      reasoning_effort: the request's `reasoning_effort` (one of REASONING_EFFORTS or None).
      template: the checkpoint's chat template source, to find its thinking switch.
    Raises:
      APIError 400: kwargs is not an object or names a reserved variable; an unknown effort.
    """
    if kwargs is not None and not isinstance(kwargs, dict):
        raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs",
                       code="invalid_value")
    out = dict(kwargs or {})
    for key in out:
        if key in RESERVED_NAMES:
            raise APIError(400, f"chat_template_kwargs.{key}: the server sets {key!r} itself; it cannot be "
                                f"given here", param=f"chat_template_kwargs.{key}", code="invalid_value")
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got "
                                f"{reasoning_effort!r}", param="reasoning_effort", code="invalid_value")
        out.setdefault("reasoning_effort", reasoning_effort)
        for switch in thinking_switches(template):
            out.setdefault(switch, reasoning_effort != "none")
    return out or None
