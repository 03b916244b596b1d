"""Admission: what a job needs before it runs, and what it can never get. No jax here.

A submitted job meets two kinds of refusal (the ferrox-server contract):

  * "never" (`check_admission`, pure: it reads immutable limits only, so submitters call it
    on their own threads, before anything is queued): a prompt + max_tokens over the
    context ceiling, more KV blocks than the whole budget, more rows than ever run at once;
  * "not now": the scheduler admits the waiting queue's head in strict FIFO once the
    running rows and the block ledger have room (`Scheduler._admit_waiting`); the head
    that does not fit holds the line.

A job that names a LoRA adapter (`Job.adapter_name`) also needs the adapter's
slot, a constraint beside rows and blocks (`AdapterSlots`, the engine's registry): at
admission the scheduler asks `refusal` (not loaded any more, quarantined, or reloaded
with other weights since the job named it: the job ends with that error, its code on
the event) and, once rows and blocks are granted, `acquire`s the slot, which it holds
until the job's last row ends (`release`). An adapter's slot is its own while it is
loaded, so the constraint never makes a job wait, only refuses it; every call runs on the
owner thread, as every change to the registry does.
"""

from __future__ import annotations

from typing import Any, Protocol

from ferrox_jax.block_tables import blocks_to_reserve
from ferrox_jax.config import SchedulerLimits
from ferrox_jax.request import Job


def check_admission(job: Job, limits: SchedulerLimits) -> tuple[str, str] | None:
    """The "never" refusals, in the contract's order; None when the job can ever run.

    Pure (reads immutable limits only), so submitters call it on their own threads.

    Returns:
        None, or (reason, message): reason "context_length" or "too_large".
    """
    num_prompt_tokens = len(job.prompt_token_ids)
    total_tokens = num_prompt_tokens + job.max_tokens
    if limits.max_context is not None and total_tokens > limits.max_context:
        return ("context_length",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({job.max_tokens}) = "
                f"{total_tokens} tokens exceeds the context limit of {limits.max_context} tokens")
    num_blocks = blocks_to_reserve(num_prompt_tokens, job.max_tokens, job.n, limits.block_size)
    if num_blocks > limits.num_blocks:
        message = (f"request needs {num_blocks} KV blocks of {limits.block_size} positions "
                   f"(prompt {num_prompt_tokens} + max_tokens {job.max_tokens}, n={job.n}); "
                   f"the whole budget is {limits.num_blocks} blocks")
        if limits.kv_bytes_per_block:
            message += (f" ({num_blocks * limits.kv_bytes_per_block} bytes needed; the KV budget holds "
                        f"{limits.num_blocks * limits.kv_bytes_per_block} bytes)")
        return "too_large", message
    if job.n > limits.max_rows:
        return ("too_large", f"request asks for n={job.n} rows; at most {limits.max_rows} "
                             "rows run at once (max_seqs)")
    return None


class AdapterSlots(Protocol):
    """Where a job's adapter gets its slot (`ferrox_jax/lora_registry.py:LoraRegistry`)."""

    def refusal(self, name: str, key: str | None) -> tuple[str, str] | None:
        """(code, message) when a job naming adapter `name` at version `key` cannot run:
        "adapter_not_found" or "adapter_quarantined"; None when it can."""

    def acquire(self, name: str) -> Any:
        """Holds the adapter's slot for one job; returns the adapter (its `slot`)."""

    def release(self, slot: int) -> None:
        """The job holding `slot` ended."""

    def quarantine(self, slot: int, reason: str) -> str | None:
        """Quarantines the adapter in `slot` (a faulted row); its name, or None."""
