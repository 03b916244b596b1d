"""BatcherStats: the snapshot of batcher counters the owner thread publishes after each tick.

The first twelve fields are the ferrox-server stats contract, field for field (served at
`/admin/stats`, rendered at `/metrics`); the rest are ours. Readers get a frozen copy and
never touch live counters, so a snapshot is always consistent with itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ferrox_jax.speculative import spec_decode_stats


@dataclasses.dataclass(frozen=True)
class BatcherStats:
    # -- the ferrox-server contract ----------------------------------------------------
    prefill_chunks: int = 0  # prompt chunks computed (one per tick with the default token budget; a long prompt takes several)
    prefill_tokens: int = 0  # prompt tokens computed in those chunks (work, not requests)
    decode_steps: int = 0  # steps that computed at least one decoding row (chunks may share the step)
    queue_depth: int = 0  # jobs waiting for admission right now (a gauge)
    queue_rejected: int = 0  # refused because the waiting queue was full: momentary pressure, retry helps
    kv_blocks_total: int = 0  # usable KV blocks in the budget (the null block not counted)
    kv_blocks_free: int = 0  # total minus blocks admitted jobs hold or were promised; idle cached blocks count as free
    kv_block_size: int = 0  # token positions per KV block
    kv_rejected_too_large: int = 0  # refused: needs more blocks than the whole budget; a box too small
    kv_rejected_context_length: int = 0  # refused: prompt + max_tokens over the context ceiling; a request to fix
    kv_blocks_peak: int = 0  # most blocks held at once, counted from the rows, not the ledger
    aborted: int = 0  # jobs a cancel actually stopped (not cancels of finished or unknown jobs)
    # -- ours --------------------------------------------------------------------------
    running_rows: int = 0  # rows holding a slot: decoding rows plus prefilling jobs' rows
    waiting_requests: int = 0  # same as queue_depth, named for the /metrics gauge
    tokens_generated: int = 0  # tokens sampled, stop tokens included
    recompiles_after_warmup: int = 0  # runner compiles after warmup (should stay 0)
    ticks: int = 0  # owner-loop ticks that planned device work
    host_s: float = 0.0  # tick wall time outside the runner's device calls (scheduling overhead)
    device_s: float = 0.0  # wall time in the runner's device calls, as it reports
    prefix_cache_queries: int = 0  # prompt tokens of admitted jobs looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from cached blocks instead of computed
    kv_blocks_cached: int = 0  # blocks resident in the prefix cache, held by rows or idle (a gauge)
    # Running jobs preempted for a more urgent one (the priority policy, ferrox_jax/priority.py;
    # vLLM's vllm:num_preemptions): each preemption counts, a job preempted twice twice. 0 under fcfs.
    num_preemptions: int = 0
    # -- the sliding KV group (ferrox_jax/kv_groups.py); all 0 for a model without sliding layers.
    # The kv_blocks_* fields above count the full-attention group, as they always have.
    kv_window_slots_total: int = 0  # the sliding group's pool of slots (a gauge)
    kv_window_slots_held: int = 0  # slots the rows' windows reference now (a gauge)
    kv_window_slots_parked: int = 0  # slots kept with a prefix-cached block nobody's window needs (a gauge)
    kv_window_slots_free: int = 0  # total minus what admitted jobs hold or reserved; parked count as free (a gauge)
    kv_window_slots_peak: int = 0  # most slots held at once
    kv_window_blocks_passed: int = 0  # window references dropped as rows moved past their blocks (a counter)
    # -- the host KV tier under the prefix cache (--kv-offload-gib, ferrox_jax/kv_offload.py) ---
    prefix_cache_hits_device: int = 0  # of prefix_cache_hits, tokens found in the device cache
    prefix_cache_hits_host: int = 0  # ... tokens restored from the host tier (hits = device + host)
    kv_offload_blocks_total: int = 0  # host slots the tier has (0: off; a gauge)
    kv_offload_blocks_cached: int = 0  # host slots holding a block now (a gauge)
    kv_offload_blocks_stored: int = 0  # evicted device blocks copied to host memory
    kv_offload_blocks_evicted: int = 0  # host copies the tier's LRU dropped for newer ones
    kv_offload_blocks_restored: int = 0  # host copies brought back into fresh device blocks
    # ... and its recurrent-state snapshots (a model with linear-attention layers; kv_offload.py, "Snapshots")
    kv_offload_snapshots_total: int = 0  # host snapshot slots (0: none; a gauge)
    kv_offload_snapshot_bytes: int = 0  # host bytes of one snapshot (every DeltaNet layer's conv + recurrent state)
    kv_offload_snapshots_cached: int = 0  # host snapshot slots holding one now (a gauge)
    kv_offload_snapshots_stored: int = 0  # snapshots the device dropped (stolen or evicted) copied to host memory
    kv_offload_snapshots_restored: int = 0  # host snapshots restored into a row's state slot on a prefix hit
    # -- the recurrent state pool (a model with linear-attention layers: ferrox_jax/state_pool.py) ---
    state_slots_total: int = 0  # slots rows can hold (one per row in flight; 0: the model keeps no recurrent state)
    state_slots_held: int = 0  # of those, held by admitted rows now (a gauge; back to 0 when idle: no leak)
    state_pool_bytes: int = 0  # device bytes of the pool, every slot and the null slot (fixed at start-up)
    # its snapshot slots (prefix caching: the state at chosen block boundaries of prompts and rows, state_snapshots.py)
    state_snapshot_slots_total: int = 0  # snapshot slots beside the running ones (0: none, prefix caching off)
    state_snapshot_slots_held: int = 0  # of those, attached to a cached block now (a gauge; freed with the block)
    state_snapshots_taken: int = 0  # snapshots taken (a counter; a row's decode snapshot counts each move)
    state_snapshots_restored: int = 0  # prefix hits that restored one into a row's slot (a counter)
    # -- structured output (docs/structured-output.md) -----------------------------------
    constrained_requests: int = 0  # jobs taken whose output a grammar constrains
    grammar_errors: int = 0  # rows ended because their grammar rejected a sampled token (a bug: stays 0)
    grammar_mask_rows: int = 0  # row masks filled: one per constrained row per sampling step
    grammar_mask_s: float = 0.0  # host seconds filling them (inside device_s: they run while the model does)
    grammar_mask_fills: int = 0  # fills, one per model call that had a constrained row
    # Of those, fills that ended while their model call was still running on the device: the
    # mask cost nothing but host time. Checked once per fill (is the call's logits ready?).
    grammar_mask_fills_hidden: int = 0
    # -- speculative decoding (ferrox_jax/speculative.py; vLLM's vllm:spec_decode_* counters) ---
    spec_decode_num_drafts: int = 0  # row-steps that verified at least one draft token
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified
    spec_decode_num_accepted_tokens: int = 0  # of those, accepted (each saved a step of its row)
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # accepted at draft position 0, 1, ... k-1
    # -- images (a model taking them: ferrox_jax/images.py) ---------------------------------
    encoder_runs: int = 0  # images the vision encoder computed
    encoder_cache_hits: int = 0  # images whose soft tokens came from the encoder cache instead
    image_tokens: int = 0  # image soft tokens forwards computed (prefix-cache hits not included)
    # LoRA (vLLM's lora_requests_info): adapter slots, and the adapters of the jobs holding
    # rows now / waiting for admission (names, sorted; the base model is not listed).
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # Step faults by kind (ferrox_jax/step_faults.py) and the last one's reason, e.g.
    # "nonfinite: non-finite logits (NaN or inf) in 1 of the step's 3 rows".
    step_faults_exception: int = 0
    step_faults_nonfinite: int = 0
    step_faults_timeout: int = 0
    step_faults_peer: int = 0  # a multi-host process died or hung (the group is lost)
    last_step_fault: str | None = None

    def step_faults_by_kind(self) -> dict[str, int]:
        """{kind: count} of the `step_faults_<kind>` fields above, in their order: what
        `/health` and `/metrics` show, without their having to know the kinds."""
        return {f.name.removeprefix(STEP_FAULTS_PREFIX): getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name.startswith(STEP_FAULTS_PREFIX)}


STEP_FAULTS_PREFIX = "step_faults_"  # one field per kind of ferrox_jax/step_faults.py (a test keeps them equal)


def scheduler_fields(scheduler: Any) -> dict[str, Any]:
    """The `BatcherStats` fields a `ferrox_jax/scheduler.py:Scheduler` counts (the owner
    adds its own: ticks, times, recompiles, grammar masks)."""
    running_adapters, waiting_adapters = scheduler.lora_adapters
    return dict(
        prefill_chunks=scheduler.prefill_chunks, prefill_tokens=scheduler.prefill_tokens,
        decode_steps=scheduler.decode_steps, queue_depth=scheduler.num_waiting,
        kv_blocks_total=scheduler.budget.num_blocks, kv_blocks_free=scheduler.budget.num_free_blocks,
        kv_blocks_peak=scheduler.kv_blocks_peak, aborted=scheduler.aborted,
        running_rows=scheduler.num_running_rows, waiting_requests=scheduler.num_waiting,
        tokens_generated=scheduler.tokens_generated, constrained_requests=scheduler.num_constrained_requests,
        grammar_errors=scheduler.num_grammar_errors, prefix_cache_queries=scheduler.blocks.num_queried_tokens,
        prefix_cache_hits=scheduler.blocks.num_hit_tokens, kv_blocks_cached=scheduler.blocks.num_cached_blocks,
        num_preemptions=scheduler.num_preemptions,
        **state_pool_fields(scheduler), **offload_fields(scheduler.blocks), **window_fields(scheduler.blocks),
        running_lora_adapters=running_adapters, waiting_lora_adapters=waiting_adapters,
        **spec_decode_stats(scheduler.speculator))


def state_pool_fields(scheduler: Any) -> dict[str, int]:
    """The recurrent state pool's `BatcherStats` fields, from the scheduler's `StatePool` and limits."""
    pool, snapshots = scheduler.states, scheduler.blocks.snapshots
    fields = dict(state_slots_total=max(pool.num_slots - 1, 0), state_slots_held=pool.num_held,
                  state_pool_bytes=scheduler.limits.state_pool_bytes)
    if snapshots is not None:
        fields.update(state_snapshot_slots_total=snapshots.num_slots, state_snapshot_slots_held=snapshots.num_held,
                      state_snapshots_taken=snapshots.num_taken, state_snapshots_restored=snapshots.num_restored)
    return fields


def offload_fields(blocks: Any) -> dict[str, int]:
    """The host KV tier's `BatcherStats` fields, from the scheduler's `BlockTables`."""
    tier = blocks.tier
    host = blocks.num_host_hit_tokens
    fields = dict(prefix_cache_hits_device=blocks.num_hit_tokens - host, prefix_cache_hits_host=host)
    if tier is not None:
        fields.update(kv_offload_blocks_total=tier.num_slots, kv_offload_blocks_cached=tier.num_cached_blocks,
                      kv_offload_blocks_stored=tier.num_stored, kv_offload_blocks_evicted=tier.num_evicted,
                      kv_offload_blocks_restored=tier.num_restored, kv_offload_snapshots_total=tier.num_snapshot_slots,
                      kv_offload_snapshot_bytes=blocks.snapshot_bytes if tier.num_snapshot_slots else 0,
                      kv_offload_snapshots_cached=tier.num_cached_snapshots,
                      kv_offload_snapshots_stored=tier.num_snapshots_stored,
                      kv_offload_snapshots_restored=tier.num_snapshots_restored)
    return fields


def window_fields(blocks: Any) -> dict[str, int]:
    """The sliding KV group's `BatcherStats` fields, from the scheduler's `BlockTables`."""
    pool = blocks.window
    if pool is None:
        return {}
    return dict(kv_window_slots_total=pool.num_slots, kv_window_slots_held=pool.num_held,
                kv_window_slots_parked=pool.num_parked, kv_window_slots_free=pool.num_free,
                kv_window_slots_peak=pool.peak_held, kv_window_blocks_passed=pool.num_freed_behind)
