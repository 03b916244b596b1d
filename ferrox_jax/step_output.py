"""Reading a step's output: the fetched `StepArrays` as one `RowResult` per row. No jax here.

The last host step of a tick before `Scheduler.update` (`ferrox_jax/batcher.py`). Every row
that samples is read the same way, speculating or not: `StepArrays.tokens[i, j]` is what
was sampled after the row's j-th new token, and a row's drafts (its last
`num_draft_tokens` tokens, none for a plain row) are kept while they equal what was
sampled before them (`speculative.count_accepted`). So a plain row gives its one token, and
a speculating row its first sample plus, in `RowResult.following`, the sample after each
accepted draft (the last of them the model's own token after the accepted run).

`run_plan` is one unconstrained step of a plan through a runner's verbs, for tests and
tools; the owner loop's tick does the same in the open, proposing drafts first and filling
grammar masks between the forward and the sample.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ferrox_jax.host_batch import HostBatch, StepArrays
from ferrox_jax.plan import RowPlan, StepOutput, StepPlan
from ferrox_jax.request import RowResult
from ferrox_jax.speculative import count_accepted

if TYPE_CHECKING:
    from ferrox_jax.runner_protocol import Runner


def step_output(plan: StepPlan, batch: HostBatch, arrays: StepArrays, *, device_s: float = 0.0) -> StepOutput:
    """One `RowResult` per row that samples, scores its prompt or pools."""
    results: dict[int, RowResult] = {}
    for i, row in enumerate(plan.decode + plan.chunks):
        if row.sample or row.prompt_logprobs or row.pooling:
            results[row.row_id] = _row_result(row, batch, arrays, i)
    nonfinite = () if arrays.finite is None else tuple(int(batch.row_ids[i]) for i in np.flatnonzero(~arrays.finite))
    return StepOutput(results=results, device_s=device_s, nonfinite_row_ids=nonfinite)


def run_plan(runner: Runner, plan: StepPlan) -> StepOutput:
    """One step of `plan`, no row constrained and no drafts proposed, on `runner`'s verbs:
    build the host batch, forward, sample, read each row's result."""
    batch = HostBatch.build(plan, runner.geometry)
    start_s = time.perf_counter()
    arrays = runner.sample(runner.forward(batch), None)
    return step_output(plan, batch, arrays, device_s=time.perf_counter() - start_s)


def _row_result(row: RowPlan, batch: HostBatch, arrays: StepArrays, i: int) -> RowResult:
    prompt = _prompt_logprobs(row, batch, arrays, i) if row.prompt_logprobs else ()
    if not row.sample:  # a prompt-logprobs chunk that is not the prompt's last, or pooling
        return RowResult(row_id=row.row_id, token_id=-1, prompt_logprobs=prompt,
                         hidden_sum=arrays.hidden_sum[i] if row.pooling else None,
                         last_hidden=arrays.last_hidden[i] if row.pooling else None)
    drafts = row.token_ids[len(row.token_ids) - row.num_draft_tokens:] if row.num_draft_tokens else ()
    accepted = count_accepted(drafts, arrays.tokens[i]) if drafts else 0
    following = tuple(_sampled(row, arrays, i, j) for j in range(1, accepted + 1))
    return _sampled(row, arrays, i, 0, prompt_logprobs=prompt, following=following)


def _sampled(row: RowPlan, arrays: StepArrays, i: int, j: int, **fields) -> RowResult:
    """What row `i` sampled after its j-th new token, with its top logprobs when asked."""
    k = row.sampling.logprobs or 0
    top = tuple(zip(arrays.top_ids[i, j, :k].tolist(), arrays.top_logprobs[i, j, :k].tolist()))
    return RowResult(row_id=row.row_id, token_id=int(arrays.tokens[i, j]), logprob=float(arrays.logprob[i, j]),
                     top_logprobs=top, **fields)


def _prompt_logprobs(row: RowPlan, batch: HostBatch, arrays: StepArrays, i: int) -> tuple:
    """Each computed prompt token's (logprob, top k) given what precedes it."""
    k = row.sampling.logprobs or 0
    lo, hi = int(batch.row_starts[i]), int(batch.row_starts[i + 1])
    if row.next_token_id < 0:  # the prompt's last token: what follows it is sampled, not scored
        hi -= 1
    return tuple(
        (float(arrays.prompt_logprob[n]),
         tuple(zip(arrays.prompt_top_ids[n, :k].tolist(), arrays.prompt_top_logprobs[n, :k].tolist())))
        for n in range(lo, hi))
