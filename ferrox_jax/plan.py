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
from typing import TYPE_CHECKING, Protocol

from ferrox_jax.request import RowResult, SamplingParams

if TYPE_CHECKING:
    from ferrox_jax.grammar import RowMatcher


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
    only when `sampling.has_penalties`. `matcher` is the row's grammar state
    (`ferrox_jax.grammar.RowMatcher`) when its output is constrained and it samples: the
    runner fills the row's token mask from it; only the scheduler advances it. `pooling`
    (prefill only): also return the sum and the last of the chunk's final hidden states
    (`RowResult.hidden_sum` / `last_hidden`).
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
    matcher: RowMatcher | None = None
    pooling: bool = False  # return the chunk's pooled hidden states (embeddings jobs)


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
class StepOutput:
    results: dict[int, RowResult]  # row_id -> result, for rows with sample, prompt_logprobs or pooling
    device_s: float = 0.0  # wall time spent in device calls, for host-overhead stats
    # Grammar masks (constrained rows only): host seconds filling them (part of device_s,
    # since they are computed while the model call runs), row masks filled, fills (one per
    # model call with a constrained row), and fills done before that call finished.
    mask_s: float = 0.0
    num_mask_rows: int = 0
    num_mask_fills: int = 0
    num_mask_fills_hidden: int = 0


class Runner(Protocol):
    """What the owner loop needs from the device side (`ferrox_jax/runner.py`)."""

    block_size: int
    num_blocks: int  # total blocks in the cache, including the null block 0
    max_rows: int  # largest decode row bucket
    max_prefill_tokens: int  # largest prefill token bucket
    recompiles_after_warmup: int  # shapes compiled after warm-up (should stay 0)

    def run(self, plan: StepPlan) -> StepOutput: ...
