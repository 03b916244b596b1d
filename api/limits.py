"""Per-request limits from `ServerConfig`, checked before the engine sees a request.

Each check raises a 400 `APIError` naming its `param`. The limits and their flags
(api/settings.py holds the table; docs/operations.md explains them):

| limit | flag | default |
|---|---|---|
| choices per request | `--max-n` | 16 |
| stop strings, characters per stop string | `--max-stop-strings`, `--max-stop-chars` | 16, 256 |
| tokens per prompt | `--max-prompt-tokens` | the context ceiling |
| `max_tokens` a request may ask | `--max-output-tokens` | the room left in the context |
| `logprobs` / `top_logprobs` | `--max-logprobs` | 20 |
| token entries a reply may hold | `--max-reply-entries` | 1,048,576 |

A reply's size is bounded before anything is generated, from what the request asks at
most: each token it may return (generated, or its prompt again with `echo`) is one entry,
plus one per logprob alternative, for every prompt and every one of its `n` choices.
A 4 KB completions body (500 prompts, `max_tokens` 400, `logprobs` 20) asks for 4.2
million entries, a 75 MiB reply; at 1 Mi entries a reply stays within tens of MiB.

The context rule is the ferrox-server contract's: a prompt alone at or over the context
ceiling is a 400 `context_length_exceeded`; a prompt that fits but leaves less room than
`max_tokens` asks is served with `max_tokens` clamped to the room left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from api.config import ServerConfig
from api.errors import APIError

if TYPE_CHECKING:  # the facade's module imports jax; only its type is needed here
    from ferrox_jax.engine import Engine
    from ferrox_jax.request import Job


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise APIError(400, f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})", param=param)


def check_common(body: Any, engine: Engine, config: ServerConfig) -> None:
    """n, stop strings, stop token ids, stream_options: the fields both generation routes share."""
    n = body.n or 1
    if n > config.max_n:
        raise APIError(400, f"n must be at most {config.max_n}; got {n}", param="n")
    check_stop_strings(body.stop_list(), config)
    check_token_ids(body.stop_token_ids or [], engine.tokenizer.vocab_size, "stop_token_ids")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.stream_resumable and not body.stream:
        raise APIError(400, "stream_resumable is only allowed when stream is true", param="stream_resumable")


def check_stop_strings(stops: list[str], config: ServerConfig, param: str = "stop") -> None:
    """At most --max-stop-strings, each non-empty and at most --max-stop-chars long."""
    if len(stops) > config.max_stop_strings:
        raise APIError(400, f"at most {config.max_stop_strings} stop strings; got {len(stops)}", param=param)
    for s in stops:
        if not s:
            raise APIError(400, "stop strings must not be empty", param=param)
        if len(s) > config.max_stop_chars:
            raise APIError(400, f"stop strings must be at most {config.max_stop_chars} characters; "
                                f"got {len(s)}", param=param)


def check_logprobs(value: int | None, config: ServerConfig, param: str) -> None:
    if value is not None and value > config.max_logprobs:
        raise APIError(400, f"{param} must be at most {config.max_logprobs}; got {value}", param=param)


def check_prompt_tokens(num_tokens: int, config: ServerConfig, param: str) -> None:
    limit = config.max_prompt_tokens
    if limit and num_tokens > limit:
        raise APIError(400, f"the prompt has {num_tokens} tokens; this server accepts at most {limit} "
                            "per prompt", param=param, code="prompt_too_long")


def check_asked_tokens(asked: int | None, config: ServerConfig, param: str = "max_tokens") -> None:
    limit = config.max_output_tokens
    if limit and asked is not None and asked > limit:
        raise APIError(400, f"{param} must be at most {limit}; got {asked}", param=param)


def max_tokens(asked: int | None, prompt_len: int, max_context: int, config: ServerConfig, param: str) -> int:
    """The tokens a job may generate: the contract's context rule, then the server's cap.

    Args:
      asked: the request's max_tokens, or None for "as many as fit".
      prompt_len: tokens in the prompt.
      max_context: the engine's per-request ceiling (prompt + generated tokens).
      param: the field a context refusal names ("prompt" or "messages").
    Returns:
      min(asked, room left, --max-output-tokens when set).
    """
    if prompt_len >= max_context:
        raise APIError(400, f"This model's maximum context length is {max_context} tokens, but the prompt has "
                            f"{prompt_len} tokens (no room left to generate).",
                       param=param, code="context_length_exceeded")
    room = max_context - prompt_len
    if config.max_output_tokens:
        room = min(room, config.max_output_tokens)
    return room if asked is None else min(asked, room)


def check_fits_queue(num_jobs: int, engine: Engine, param: str) -> None:
    """400 when a request's jobs outnumber the engine's whole waiting queue (`--max-queue`):
    it could never be admitted, so a retryable 503 `queue_full` would be a lie."""
    max_queue = engine.config.max_queue
    if num_jobs > max_queue:
        raise APIError(400, f"{param}: {num_jobs} items in one request; this server queues at most {max_queue} "
                            "(--max-queue); split the request", param=param, code="too_many_inputs")


def check_reply_entries(jobs: Sequence[Job], logprobs: int | None, config: ServerConfig, *,
                        echo: bool = False, param: str = "max_tokens") -> None:
    """400 `reply_too_large` when the jobs' reply could hold more than --max-reply-entries
    token entries: per job, n x (max_tokens + its prompt's tokens when echoed) x (1 + logprobs).

    Args:
      jobs: the request's engine jobs, their max_tokens already clamped to the context.
      logprobs: alternatives per token (`logprobs` / `top_logprobs`), None for none.
      echo: the reply repeats each prompt (completions `echo`).
    """
    per_token = 1 + (logprobs or 0)
    tokens = sum(job.n * (job.max_tokens + (len(job.prompt_token_ids) if echo else 0)) for job in jobs)
    entries = tokens * per_token
    if entries > config.max_reply_entries:
        n, most = (jobs[0].n, max(job.max_tokens for job in jobs)) if jobs else (1, 0)
        asked = (f"{len(jobs):,} prompt(s) x n {n} x up to {most:,} tokens{' plus the prompt (echo)' if echo else ''}"
                 f" x (1 + {logprobs or 0} logprobs)")
        raise APIError(400, f"this request may return up to {entries:,} token entries ({asked}); this server "
                            f"returns at most {config.max_reply_entries:,} per request (--max-reply-entries): lower "
                            "max_tokens, n or logprobs, or split the prompts over several requests",
                       param=param, code="reply_too_large")
