"""Plain data passed between the scheduler and the model runner. No jax here.

The owner loop does: `plan = scheduler.schedule()` -> `out = runner.run(plan)` ->
`scheduler.update(plan, out)`. A `StepPlan` names, per row, the tokens to compute,
where they sit (positions and block table), whether to sample after the last one and
with which settings. A `StepOutput` carries one `RowResult` per sampling row.
Because both are plain data, the scheduler is tested against a scripted runner.

Vocabulary: a *request* is one API job; a *row* is one sequence being generated (a
request with `n > 1` has n rows; row ids are never reused); a *block* holds K/V for
`block_size` token positions (block ids index the cache; block 0 is the null block).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

MAX_LOGPROBS = 20  # top-k logprobs returned per sampled token, at most (OpenAI's limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling settings; they travel to the device as [rows] arrays, never static.

    temperature 0 means greedy. top_k 0 means off; top_p 1 and min_p 0 are off.
    `seed` makes the draw a function of (seed, position) only, so a row samples the same
    tokens alone or in any batch. `logprobs` is None (not asked), or k in [0, 20]: the
    chosen token's logprob plus the top k (raw model logprobs, before temperature).
    Penalties follow vLLM: presence/frequency over generated tokens, repetition over
    prompt and generated tokens; `logit_bias` adds to the raw logits by token id.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature:
            raise ValueError(f"SamplingParams.temperature must be >= 0; got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0; got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1]; got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs must be in [0, {MAX_LOGPROBS}]; got {self.logprobs}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0; got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


@dataclasses.dataclass(frozen=True)
class RowStep:
    """One row's work in one step.

    Computes `token_ids` at positions `start_pos .. start_pos + len(token_ids) - 1`,
    writing their K/V through `block_ids` (the row's block table, in position order; it
    must cover every position written). If `sample`, samples the token that follows.
    `prompt_logprobs`: also return, for each computed token except the first of the
    whole prompt, its logprob given what precedes it (for `echo` + `logprobs`);
    `next_token_id` is the prompt token after this chunk's last one (or -1 when none).
    `history_token_ids` are the row's prompt+generated tokens before this step, used
    only when `sampling.has_penalties`.
    """

    row_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    sampling: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    next_token_id: int = -1
    num_prompt_tokens: int = 0
    history_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One tick's device work: at most one prefill chunk, then one batched decode step.

    `block_copies` (src, dst) run first: for `n > 1` the rows share a prompt's full
    blocks and each gets a copy of the partly filled last one.
    """

    prefill: tuple[RowStep, ...] = ()
    decode: tuple[RowStep, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode or self.block_copies)


@dataclasses.dataclass(frozen=True)
class RowResult:
    """What one sampling row produced this step."""

    row_id: int
    token_id: int
    logprob: float = 0.0  # raw logprob of token_id
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    # For prompt_logprobs rows: per computed token (after the first prompt token),
    # (logprob of that token, its top-k). Empty otherwise.
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepOutput:
    results: dict[int, RowResult]  # row_id -> result, for rows with sample or prompt_logprobs
    device_s: float = 0.0  # wall time spent in device calls, for host-overhead stats


class Runner(Protocol):
    """What the owner loop needs from the device side (`ferrox_jax/runner.py`)."""

    block_size: int
    num_blocks: int  # total blocks in the cache, including the null block 0
    max_rows: int  # largest decode row bucket
    max_prefill_tokens: int  # largest prefill token bucket

    def run(self, plan: StepPlan) -> StepOutput: ...
