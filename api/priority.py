"""A generation request's scheduling priority: its body's `priority`, or a router's `x-priority` header.

Every generation route (OpenAI chat and completions, Anthropic Messages, Responses, llama.cpp's
`/completion`) takes an integer `priority` in its body, as vLLM's do: lower is served first
when the server runs `--scheduling-policy priority` (`ferrox_jax/priority.py`: admission by
(priority, arrival), and preemption of less urgent running requests). Routers that cannot
touch the body (NVIDIA Dynamo, the SMG router) send the `x-priority` header instead; when
both are given the body wins, since it is the client's own word.

Checked before anything is queued, each refusal a 400 in the route's own envelope naming
the field: not an integer, outside [-2^31, 2^31 - 1], or non-zero while the server schedules
first come first served (vLLM refuses a priority it would ignore, and so do we; 0 is the
default everywhere, so clients that send nothing are never refused).
"""

from __future__ import annotations

import re

from quart import request

from api.errors import APIError
from ferrox_jax.engine import Engine, check_priority

PRIORITY_HEADER = "x-priority"
_INTEGER = re.compile(r"[+-]?[0-9]{1,20}")


def request_priority(body_priority: int | None, engine: Engine) -> int:
    """The request's priority (0 when neither the body nor the header names one).

    Raises:
      APIError: 400 `invalid_value`, param "priority" or "x-priority", saying what to send.
    """
    value, param = body_priority, "priority"
    if value is None:
        header = request.headers.get(PRIORITY_HEADER)
        if header is None:
            return 0
        param = PRIORITY_HEADER
        if not _INTEGER.fullmatch(header.strip()):
            raise APIError(400, f"header {PRIORITY_HEADER} must be an integer (lower is served first); got "
                                f"{header[:40]!r}", param=param, code="invalid_value")
        value = int(header.strip())
    refusal = check_priority(value, engine.config.scheduling_policy, param)
    if refusal is not None:
        raise APIError(400, refusal, param=param, code="invalid_value")
    return value
