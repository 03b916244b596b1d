"""The recurrent state pool: which running row holds which state slot. No jax here.

A model with recurrent layers (Qwen3.5's Gated DeltaNet, `models/deltanet.py`) keeps, per
row, a fixed-size state instead of K/V per token: per DeltaNet layer a conv state
f32[Kc - 1, C] and a recurrent state f32[Hv, dk, dv]. The device holds them as a pool of
slots beside the paged KV cache (`KVCache.states`, `models/deltanet.py:RecurrentStates`,
`[S, ...]` per layer), and each step's host batch names each row's slot (`state_slots`, a
column like the adapter slots). Slot 0 is the null slot padding rows write into, as block 0
is for K/V; the pool has one slot per row a step can hold (`max_rows`) besides it.

This module is the host side, owned by the scheduler's block tables (the owner thread, no locks):

    admission    every open row of the admitted job takes a slot (`acquire`)
    planning     each `RowPlan` carries its row's slot (`slot`)
    finish / abort / failure   the row's slot is freed when the row is flushed (`release`)
    preemption   the preempted rows' slots are freed; re-admitted, they take new ones and
                 recompute from position 0 (where the forward starts from zero states,
                 `models/deltanet.py:starts_fresh`) or from a prefix-cache hit's snapshot
    n > 1        when the prompt is prefilled, each other row of the job gets a copy of the
                 prefill row's slot (`fork`): the state is per row, so copy-on-write for it
                 is a copy at the fork (the K/V blocks stay shared as for any model)

Speculative decoding (prompt lookup, or a draft model without recurrent layers) gives each
slot 1 + k entries on the device, the states after each verified token, and the next step
reads the one after the row's last accepted token (`state_entries`, `models/deltanet.py`,
"Speculation"): nothing here changes, a slot is still one row's.

Admission already bounds running rows by `max_rows`, so a slot is always free for an
admitted row (asserted). The slots' bytes are fixed at start-up (`state_pool_bytes` in
`/admin/stats`, counted in the memory bounds beside the KV cache's).

Prefix caching keeps *snapshots* of the state beside the running slots
(`ferrox_jax/state_snapshots.py`): slots `max_rows + 1 ..` of the same device arrays,
`--state-snapshots` of them or two per row in flight (`snapshot_slots`). Where: a prompt's
state every `--state-snapshot-interval` blocks and at its last full block before its last
token (B = floor((P - 1) / bs) * bs), the prompt's chunking cut to end a chunk on each, so
the state there exists after that step, and the next step copies it (running slot ->
snapshot slot, before its forward) and attaches it to the block that ends there; and one
per row at its latest block boundary while it decodes, moved along as it grows, so a chat's
next turn hits the end of this turn's last full block. What a hit restores: admission cuts
a prefix hit back to its last block that carries a snapshot (none: no hit), copies that
snapshot into the row's running slot before the row's first chunk, and the row computes on
from that block's end. Evicting the block frees its snapshot; a new snapshot takes a free
slot, or the snapshot of the least recently released idle cached block.

Every copy (save, restore, fork) is a (src, dst) slot pair run before the step's forward,
in order: saves, then restores, then forks (`take_copies`, `StepPlan.state_copies`), by one
jitted copy beside the KV block copy (`ferrox_jax/kv_cache.py:copy_blocks`), so a slot
freed and taken again in one tick is read before it is written.

With speculation each slot keeps 1 + k entries (`state_entries`, `models/deltanet.py`,
"Speculation") and the pool a position per slot; every copy above carries all of a slot's
entries and its position (`ferrox_jax/kv_cache.py:copy_state_slots`).

With the host KV tier (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`, "Snapshots") a
snapshot the device drops (its slot stolen for a newer one, or its block evicted) is copied
to a host slot first, and a hit whose snapshot only the host holds restores it from there
into the row's running slot. Those copies are state copies too, in the same ordered list:
a host slot h is written `host_id(h)` = -1 - h, so (snapshot slot, -1 - h) saves to the host
and (-1 - h, running slot) restores from it, and each runs after every copy before it (a
snapshot saved this step is on the device before the host reads it; a host slot written
this step is read back after it). The runner moves them (`ferrox_jax/runner.py`, `_copy_blocks`).
Under tensor parallelism the pool is split as the layers' weights are, by value head and
conv channel (`ferrox_jax/sharding.py`), and the memory bounds count each device's part.
Speculation runs there too: a slot's entries are rows of the same split arrays, and the
per-slot positions are replicated, every device updating its copy alike.
"""

from __future__ import annotations

from collections.abc import Iterable

NULL_SLOT = 0
# Snapshot slots per row when `--state-snapshots` is 0: a running row's prompt snapshot and its
# decode snapshot, each on its own held blocks (`ferrox_jax/state_snapshots.py`, "How many").
SNAPSHOTS_PER_ROW = 2


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
        self._saves: list[tuple[int, int]] = []  # (running slot, snapshot slot) for the next step
        self._restores: dict[int, int] = {}  # row id -> the snapshot slot its running slot takes
        self._forks: list[tuple[int, int]] = []  # (prefill row id, row id) whose state is copied

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
            self._restores.pop(row_id, None)
            if slot is not None:
                self._free.append(slot)

    def slot(self, row_id: int) -> int:
        """The slot the row holds (the null slot when the pool is off)."""
        if not self.enabled:
            return NULL_SLOT
        assert row_id in self._slot_of, f"row {row_id} is planned but holds no state slot"
        return self._slot_of[row_id]

    # -- copies, run before the next step's forward (saves, restores, forks, in that order) --

    def save(self, row_id: int, snapshot_slot: int) -> None:
        """The row's state now (after the step just applied) goes to `snapshot_slot`."""
        self._saves.append((self.slot(row_id), snapshot_slot))

    def restore(self, row_id: int, snapshot_slot: int) -> None:
        """The row (admitted this tick) starts from `snapshot_slot`'s state (a prefix hit;
        `host_id(h)`: host slot h of the host tier's)."""
        self._restores[row_id] = snapshot_slot

    def spill(self, snapshot_slot: int, host_slot: int) -> None:
        """Snapshot slot `snapshot_slot`, as every copy before this one leaves it, goes to host
        slot `host_slot` of the host tier (before a later copy overwrites it)."""
        self._saves.append((snapshot_slot, host_id(host_slot)))

    def fork(self, row_id: int, row_ids: Iterable[int]) -> None:
        """Rows `row_ids` start from `row_id`'s state (n > 1: the prefill row's)."""
        self._forks += [(row_id, other) for other in row_ids]

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The (src, dst) slot copies for the step being planned, in the order they must run.
        A restore or fork of a row released since (a cancel) is dropped."""
        held = self._slot_of
        copies = self._saves + [(src, held[row]) for row, src in self._restores.items() if row in held]
        copies += [(held[src], held[dst]) for src, dst in self._forks if src in held and dst in held]
        self._saves, self._restores, self._forks = [], {}, []
        return tuple(copies)


def host_id(host_slot: int) -> int:
    """How a state copy names host slot `host_slot` of the host tier (negative: never a device slot)."""
    return -1 - host_slot


def snapshot_slots(rows: int, prefix_caching: bool, setting: int = 0) -> int:
    """Snapshot slots (`ferrox_jax/state_snapshots.py`): `--state-snapshots`, or with its 0
    two per row (`SNAPSHOTS_PER_ROW`); none without prefix caching."""
    return (setting or SNAPSHOTS_PER_ROW * rows) if prefix_caching else 0


def pool_slots(rows: int, prefix_caching: bool, snapshots: int = 0) -> int:
    """Device slots of the pool: the null slot, one running slot per row, and with prefix
    caching the snapshot slots (`snapshot_slots` of the `--state-snapshots` setting)."""
    return 1 + rows + snapshot_slots(rows, prefix_caching, snapshots)


def settings_pool_bytes(specs, rows: int, settings) -> int:
    """Device bytes of the pool an engine's `settings` (`prefix_caching`, `state_snapshots`,
    `speculative`) size for `rows` rows: what the memory bounds count and `/admin/stats` reports."""
    return pool_bytes(specs, pool_slots(rows, settings.prefix_caching, settings.state_snapshots),
                      state_entries(settings.speculative))


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
