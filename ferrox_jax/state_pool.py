"""The recurrent state pool: which running row holds which state slot. No jax here.

A model with recurrent layers (Qwen3.5's Gated DeltaNet, `models/deltanet.py`) keeps, per
row, a fixed-size state instead of K/V per token: per DeltaNet layer a conv state
f32[Kc - 1, C] and a recurrent state f32[Hv, dk, dv]. The device holds them as a pool of
slots beside the paged KV cache (`KVCache.states`, `models/deltanet.py:RecurrentStates`,
`[S, ...]` per layer), and each step's host batch names each row's slot (`state_slots`, a
column like the adapter slots). Slot 0 is the null slot padding rows write into, as block 0
is for K/V; the pool has one slot per row a step can hold (`max_rows`) besides it.

This module is the host side, owned by the scheduler (the owner thread, no locks):

    admission    every open row of the admitted job takes a slot (`acquire`)
    planning     each `RowPlan` carries its row's slot (`slot`)
    finish / abort / failure   the row's slot is freed when the row is flushed (`release`)
    preemption   the preempted rows' slots are freed; re-admitted, they take new ones and
                 recompute from position 0, where the forward starts from zero states
                 (`models/deltanet.py:starts_fresh`), so nothing needs saving

Speculative decoding (prompt lookup, or a draft model without recurrent layers) gives each
slot 1 + k entries on the device, the states after each verified token, and the next step
reads the one after the row's last accepted token (`state_entries`, `models/deltanet.py`,
"Speculation"): nothing here changes, a slot is still one row's.

Admission already bounds running rows by `max_rows`, so a slot is always free for an
admitted row (asserted). The slots' bytes are fixed at start-up (`state_pool_bytes` in
`/admin/stats`, counted in the memory bounds beside the KV cache's).

What these models do not do yet, refused or turned off at load with the reason
(`refuse_unsupported`, `ferrox_jax/engine_builder.py`): prefix caching (a hit would need the
recurrent state at the cached prefix: it is turned off, with a start-up log line), the host
KV tier (its swap would need the states too), `n > 1` (the rows would fork the prefill's state),
and tensor parallelism (the pool is not sharded).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

NULL_SLOT = 0


class StatePoolUnsupported(ValueError):
    """A setting this engine cannot combine with recurrent-state models yet."""


class StatePool:
    """Slot ids 1 .. num_slots - 1 handed to rows; `num_slots` 0: a model without recurrent
    layers (every row's slot is the null slot and nothing is held)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots == 1 or num_slots < 0:
            raise ValueError(f"a state pool needs 0 slots (none) or at least 2 (slot 0 is the null slot); "
                             f"got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, NULL_SLOT, -1))  # pop() hands out the lowest first
        self._slot_of: dict[int, int] = {}

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, row_ids: Iterable[int]) -> None:
        """Each row takes a slot now (nothing when the pool is off)."""
        if not self.enabled:
            return
        for row_id in row_ids:
            assert row_id not in self._slot_of, f"row {row_id} already holds state slot {self._slot_of[row_id]}"
            assert self._free, f"no free state slot for row {row_id}: admission let more rows run than the pool holds"
            self._slot_of[row_id] = self._free.pop()

    def release(self, row_ids: Iterable[int]) -> None:
        """Frees the rows' slots; a row holding none (never admitted, or the pool is off) is a no-op."""
        for row_id in row_ids:
            slot = self._slot_of.pop(row_id, None)
            if slot is not None:
                self._free.append(slot)

    def slot(self, row_id: int) -> int:
        """The slot the row holds (the null slot when the pool is off)."""
        if not self.enabled:
            return NULL_SLOT
        assert row_id in self._slot_of, f"row {row_id} is planned but holds no state slot"
        return self._slot_of[row_id]


def pool_bytes(specs, num_slots: int, entries: int = 1) -> int:
    """Device bytes of a pool of `num_slots` slots (the null slot included) of `entries`
    entries each (`state_entries`) for a model's `recurrent_specs()` (f32 states: each spec's
    `state_shapes()`), and with more than one entry each slot's position (i32)."""
    per_slot = 0
    for spec in specs:
        (kc, c), (h, dk, dv) = spec.state_shapes()
        per_slot += (kc * c + h * dk * dv) * 4
    return (per_slot * entries + 4 * (entries > 1)) * num_slots if specs else 0


def state_entries(speculative) -> int:
    """Entries per state slot: with speculation (a `SpeculativeConfig`) the states after each
    token a row verifies, 1 + its most drafts, so that the next step continues from the last
    accepted one (`models/deltanet.py`, "Speculation"); 1 without."""
    return 1 if speculative is None else 1 + speculative.most_drafts


def recurrent_settings(config, model_cfg):
    """The `EngineConfig` a model with recurrent layers is served under: prefix caching turned
    off (logged: a hit would skip the tokens whose recurrent state it does not hold), and
    refused with the reason: the host KV tier and tensor parallelism. Speculation runs
    (`--speculative mtp` is refused by `ferrox_jax/mtp.py:check_mtp`: these models' MTP
    layers are not loaded).
    Any other model's config is returned as it is."""
    if not model_cfg.recurrent_specs():
        return config
    refuse_unsupported(config.mesh_shape[1] > 1, config.kv_offload_gib)  # before the weights are placed
    if config.prefix_caching:
        log.info("prefix caching is off for %s: its recurrent (linear-attention) layers keep one state per "
                 "row, not one per cached block, so a prefix hit could not restore the state at the prefix",
                 model_cfg.architecture)
        config = dataclasses.replace(config, prefix_caching=False)
    return config


def refuse_unsupported(sharded: bool, kv_offload: float) -> None:
    """Raises StatePoolUnsupported for a setting recurrent-state models cannot take yet: a mesh
    (`sharded`) or a host KV tier (`kv_offload`: its blocks or GiB, 0 when off)."""
    if sharded:
        raise StatePoolUnsupported("this model has recurrent (linear-attention) layers, whose state pool is not "
                                   "sharded yet: serve it on one device (no tensor parallelism)")
    if kv_offload:
        raise StatePoolUnsupported("--kv-offload-gib: this model has recurrent (linear-attention) layers, whose "
                                   "states the host tier does not swap yet; serve it without the host tier")
