"""Plain data passed between the scheduler and the device side. No jax here.

The owner loop does: `plan = scheduler.schedule()` -> `ferrox_jax/host_batch.py` turns it
into arrays -> the runner's verbs compute them (`ferrox_jax/runner_protocol.py`) ->
`scheduler.update(plan, out)`. A `StepPlan` is
the scheduler's decision for one step: per row, the tokens to compute, where they sit
(positions and block table), whether to sample after the last one and with which
settings. A `StepOutput` carries one `RowResult` per row that sampled, scored or pooled.
Because both are plain data, the scheduler is tested against a scripted runner. A
`DraftRequest` is a decoding row's ask for draft tokens (speculative decoding): the tick
has its proposer answer it between `schedule()` and the host batch.

Vocabulary: a *request* is one API job; a *row* is one sequence being generated (a
request with `n > 1` has n rows; row ids are never reused); a *block* holds K/V for
`block_size` token positions (block ids index the cache; block 0 is the null block); a
*chunk* is the part of a prompt computed in one step; a *step* is one forward over every
planned row (decode rows and prompt chunks together) and one sampling call.
"""

from __future__ import annotations

import dataclasses

from ferrox_jax.request import RowResult, RowSampling


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One row's part of a step.

    Computes `token_ids` at positions `start_pos .. start_pos + len(token_ids) - 1`,
    writing their K/V through `block_ids` (the row's block table, in position order; it
    must cover every position written). If `sample`, samples the token that follows.
    `prompt_logprobs`: also return, for each computed token except the first of the
    whole prompt, its logprob given what precedes it (for `echo` + `logprobs`);
    `next_token_id` is the prompt token after this chunk's last one (or -1 when none).
    `history_token_ids` are the row's prompt+generated tokens before this step, used
    only when `sampling.has_penalties`. `is_constrained`: its output has a grammar, so
    its token mask is filled from its matcher (which the scheduler keeps) while the
    forward runs. `pooling` (prompt chunks only): also return the sum and the last of the
    chunk's final hidden states (`RowResult.hidden_sum` / `last_hidden`).
    """

    row_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    sampling: RowSampling = RowSampling()
    prompt_logprobs: bool = False
    next_token_id: int = -1
    num_prompt_tokens: int = 0
    history_token_ids: tuple[int, ...] = ()
    is_constrained: bool = False
    pooling: bool = False  # return the chunk's pooled hidden states (embeddings jobs)
    # Decoding rows that speculate: the last this many of `token_ids` are draft tokens, and
    # the row samples after each of its tokens (`ferrox_jax/speculative.py`).
    num_draft_tokens: int = 0
    adapter_slot: int = 0  # the LoRA slot its projections add (0: none, the base model)
    state_slot: int = 0  # its recurrent layers' state slot (ferrox_jax/state_pool.py; 0: none)
    # Prompt chunks: the job's images with a soft token in this chunk (`ferrox_jax/images.py`),
    # their embeddings attached by the owner before the host batch is built.
    images: tuple = ()
    # Every row of a job whose images take M-RoPE positions (Qwen2.5-VL), decoding rows too: all
    # of the job's images, from which its tokens' 3-D positions follow (`ferrox_jax/images.py`).
    rope_images: tuple = ()


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """One decoding row's ask for draft tokens this step (`ferrox_jax/speculative.py`)."""

    row: RowPlan  # its decode step: its last token at `row.start_pos`; for the draft model its
    # table already covers the drafts' positions (the model writes their K/V while proposing)
    num_drafts: int  # at most this many
    token_ids: tuple[int, ...] = ()  # n-gram lookup: the row's prompt and output so far (() for the draft model)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step's work: every decoding row (one token each) and the prompt chunks the
    token budget allows, all in one forward.

    `block_copies` (src, dst) run first: for `n > 1` the rows share a prompt's full
    blocks and each gets a copy of the partly filled last one.

    `kv_saves` (device block, host slot) and `kv_restores` (host slot, device block) are the
    host tier's copies (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`): saves run first
    (blocks admission evicted, before anything overwrites them), then restores (host hits
    admitted this step), then the block copies, then the forward.

    With speculation, `draft_requests` name the decoding rows that may verify drafts this
    step; the owner loop has a proposer find them and `Scheduler.add_drafts` adds them to
    the rows before the host batch is built (`ferrox_jax/batcher.py`).
    """

    decode: tuple[RowPlan, ...] = ()
    chunks: tuple[RowPlan, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    draft_requests: tuple[DraftRequest, ...] = ()
    max_draft_tokens: int = 0  # draft tokens the step's rows may take in all (a proposer stops there)
    kv_saves: tuple[tuple[int, int], ...] = ()
    kv_restores: tuple[tuple[int, int], ...] = ()
    # The sliding-window KV group (ferrox_jax/kv_groups.py): (block, slot) of every block of
    # the step's tables that has a slot, and the (src, dst) slot copies run with block_copies.
    window_slots: tuple[tuple[int, int], ...] = ()
    window_copies: tuple[tuple[int, int], ...] = ()
    # The recurrent state pool's (src, dst) slot copies, run in order before the forward:
    # snapshot saves, prefix-hit restores, n > 1 forks (ferrox_jax/state_pool.py); a negative
    # id -1 - h is the host tier's snapshot slot h. Only in a plan with rows: until one comes
    # they wait (nothing touches a slot without a forward).
    state_copies: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.decode or self.block_copies or self.kv_saves or self.kv_restores)

    @property
    def rows(self) -> tuple[RowPlan, ...]:
        """Every row, in host-batch order: decode rows, then chunks."""
        return self.decode + self.chunks


@dataclasses.dataclass(frozen=True)
class StepOutput:
    results: dict[int, RowResult]  # row_id -> result, for rows with sample, prompt_logprobs or pooling
    device_s: float = 0.0  # wall time from the forward's dispatch to the sample's fetch (grammar masks included)
    # Rows whose logits held NaN or inf (found on the device): their results are garbage.
    nonfinite_row_ids: tuple[int, ...] = ()
