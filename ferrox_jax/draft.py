"""The draft model of `--speculative draft`: a smaller checkpoint proposing k tokens per row.

Its KV cache is its own arrays (its layers, heads and head size) but its *block ids are the
target's*: block b of the draft cache holds the draft's K/V for exactly the positions block
b of the target cache holds. So the one BlockBudget counts both (admission reserves a block
id, which is memory in both caches; `ferrox_jax/engine_builder.py` sizes a block as the sum
of the two), and everything the scheduler does to blocks holds for the draft unchanged:

  * every target forward is mirrored (`mirror`, in the owner's tick right after the
    target's forward): the draft runs the same host batch (prompt chunks, decode rows,
    verification rows) after the same block copies, so whatever the target wrote, the
    draft wrote at the same positions: a prefix-cache hit, a copy-on-write copy, a shared
    `n > 1` prompt block carry the draft's K/V along with the target's;
  * a cancelled or finished row frees block ids; nothing of the draft's needs freeing;
  * positions written for rejected drafts lie past the row's length in both caches and are
    written again (by both) before anything attends to them.

Proposing (`propose`, the tick's proposer for this method: after `schedule()` named the
rows, before the target's host batch is built): k one-token decode steps of the draft over
the speculating rows, step j computing the row's token at position p + j (its last token,
then its drafts) and sampling the next with the row's own settings and its (seed, position)
noise (`ferrox_jax/sampling.py`). Each proposal step is the runner's `forward` and `sample`
on the draft's compiled decode shapes; nothing but those verbs reaches the draft's runner.

Exactness. Verification is the one of prompt lookup (`ferrox_jax/speculative.py`): the target
samples after every verified position with the noise keyed by (seed, position) and a draft is
kept where it equals that sample. The draft drew its token with the same noise, so the pair is
a coupling of the draft's q and the target's p: the output is the target's own sample at every
position, greedy or seeded, identical to the non-speculative reply, reproducible and
independent of the batch. (The textbook rule, accept with min(1, p/q) and resample from
norm(max(0, p - q)), gives the same distribution with a higher acceptance for sampled rows,
but not the same tokens seed for seed; it is not what runs here.)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ferrox_jax.host_batch import HostBatch
from ferrox_jax.plan import RowPlan, StepPlan

if TYPE_CHECKING:
    from ferrox_jax.runner_protocol import Runner


class DraftModel:
    """The draft side: a runner of the draft checkpoint, built with the target runner's
    geometry (blocks, block size, row and token buckets, context) so that every target
    batch is one of its shapes too (`check_compatible`)."""

    def __init__(self, runner: Runner, proposals: Runner | None = None) -> None:
        """`proposals`: what runs the proposal steps, on a multi-host leader a sender that
        first sends each to the followers (`multihost_runner.DraftSender`); default `runner`."""
        if runner.max_loras:
            raise ValueError("the draft model cannot carry LoRA adapter slots")
        self.runner = runner
        self.proposals = proposals if proposals is not None else runner

    @property
    def recompiles_after_warmup(self) -> int:
        return self.runner.recompiles_after_warmup

    def warmup(self) -> float:
        return self.runner.warmup()

    def check_compatible(self, target: Runner) -> None:
        check_compatible(self.runner, target)

    def follow(self, plan: StepPlan, batch: HostBatch, pending, arrays) -> None:
        """After the target's step was sampled: nothing (the mirror ran with its forward);
        the MTP draft's hook (`ferrox_jax/mtp.py`)."""

    def mirror(self, batch: HostBatch) -> None:
        """Run the target's batch on the draft cache: the same block copies, the same forward
        (never sampled; only the K/V it writes matter)."""
        self.runner.forward(batch)

    def propose(self, plan: StepPlan) -> list[tuple[int, ...]]:
        """Each of `plan.draft_requests`' `num_drafts` tokens, drawn autoregressively by the
        draft (module docstring). The plan's block copies run first on the draft cache (with
        the first proposal step): a row's last block may be a copy-on-write destination the
        target's step fills only later."""
        requests = plan.draft_requests
        drafts: list[list[int]] = [[] for _ in requests]
        for j in range(max(r.num_drafts for r in requests)):
            active = [i for i, r in enumerate(requests) if r.num_drafts > j]
            step = StepPlan(decode=tuple(_proposal_row(i, requests[i].row, j, drafts[i]) for i in active),
                            block_copies=plan.block_copies if j == 0 else ())
            batch = HostBatch.build(step, self.proposals.geometry)
            sampled = self.proposals.sample(self.proposals.forward(batch), None).tokens[:, 0]
            for i, token in zip(active, sampled.tolist()):
                drafts[i].append(token)
        return [tuple(d) for d in drafts]


def _proposal_row(index: int, plan: RowPlan, step: int, drafts: list[int]) -> RowPlan:
    """Proposal step `step` of one row: its last token (step 0) or its latest draft, at the
    position after the ones before, sampled with the row's settings but no logprobs."""
    token = plan.token_ids[-1] if step == 0 else drafts[-1]
    return RowPlan(row_id=index, token_ids=(token,), start_pos=plan.start_pos + step, block_ids=plan.block_ids,
                   sample=True, sampling=dataclasses.replace(plan.sampling, logprobs=None),
                   num_prompt_tokens=plan.num_prompt_tokens, history_token_ids=plan.history_token_ids)


def check_compatible(draft: Runner, target: Runner) -> None:
    """Raises ValueError unless the draft runner can mirror every target batch: the same
    logits width (token ids mean the same thing: the tokenizers are compared at load),
    blocks, block size, table width and compiled shapes."""
    pairs = {"vocab size": (draft.geometry.vocab_size, target.geometry.vocab_size),
             "KV blocks": (draft.num_blocks, target.num_blocks),
             # the target's window columns (its sliding layers' own pool) are its alone: the
             # draft's arrays hold a block per block id, and its steps leave the columns out
             "block geometry": (draft.geometry, dataclasses.replace(target.geometry, windowed=draft.geometry.windowed)),
             "step buckets": (draft.compile_keys(), target.compile_keys())}
    for what, (ours, theirs) in pairs.items():
        if ours != theirs:
            raise ValueError(f"draft model: its {what} must equal the target's; got {ours} and {theirs}")
