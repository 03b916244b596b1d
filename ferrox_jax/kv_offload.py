"""The host-memory KV tier under the prefix cache (`--kv-offload-gib`). No jax here.

The device prefix cache (`ferrox_jax/prefix_cache.py`) forgets a named block when admission
evicts it to make room. With the tier on, the block's K/V is first copied to host memory,
under the same name (its sha256 chain hash), and a later prompt whose chain reaches that
name copies it back into a fresh device block instead of computing it again: a working set
of prompts far larger than the device cache still hits (what vLLM's offloading connector,
LMCache and SGLang's HiCache do).

Two halves, on the two sides of the tick:

- `HostTier` (the scheduler's side): the index. Name -> host slot, least recently used
  first; the slots a step must fill (*saves*: device block -> host slot, for blocks evicted
  while planning it) and the slots it must read back (*restores*: host slot -> device
  block, for host hits admitted while planning it). A step's plan carries both
  (`StepPlan.kv_saves` / `kv_restores`); a slot a restore reads is pinned until the plan
  is taken, so no save of the same step can overwrite it.
- `HostKVPool` (the runner's side): the bytes, one numpy slot per block holding every
  layer's K and V of it, `[slots, 2 (K, V), layers, kv_heads, block_size, head_dim]`.
  The runner's `offload_blocks` verb moves them (`ferrox_jax/runner.py`): saves first,
  then restores, then the step's block copies, then its forward. Saves before restores
  because a restore may land in the very block a save of the same step reads (the
  evicted block's id is what the budget hands out next).

The tier is inclusive: a restored block keeps its host copy, so evicting it again costs no
second copy (its name is only refreshed). LRU: a full tier drops its least recently stored
or hit name for a new one. `clear` forgets everything (sleep: the device cache is gone and
the engine starts cold; a cache rebuild builds a new engine, whose tier starts empty).

Snapshots. A model with recurrent (DeltaNet) layers takes a prefix hit only up to a block
with a state snapshot (`ferrox_jax/state_snapshots.py`), so K/V blocks alone would restore
nothing. The tier keeps snapshots too, in slots of their own (`HostStatePool` on the
runner's side: every DeltaNet layer's conv and recurrent state, all of a slot's entries and
its position), under the name of the block they are the state at the end of. A snapshot
goes to host memory when the device drops it: its slot taken for a newer snapshot, or its
block evicted (`offer_snapshot`; a moving decode snapshot's previous boundary is not kept:
the row's next one supersedes it). A hit on a recurrent model is cut back to its last block
with a snapshot on the device or here (`ferrox_jax/prefix_hits.py`), and a snapshot only
here is copied into the row's running slot. Those copies are ordered with the state pool's
own (`ferrox_jax/state_pool.py`, a host slot h written -1 - h), not with the block copies:
a snapshot saved by the step before may not have been written when the block's eviction
offers it, and a stolen slot is written again right after. The tier's bytes are split
between blocks and snapshots as the device cache splits its own (`host_tier_snapshots`);
`/admin/stats` and the start-up log state a snapshot's bytes. A slot a restore reads is
pinned until the state copies are taken; LRU, `clear` and a failed step's forgetting are as
for blocks.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from ferrox_jax.memory_bounds import MemoryBoundError, host_available_bytes
from ferrox_jax.state_pool import pool_bytes, snapshot_slots, state_entries

GIB = 1 << 30


def host_tier_blocks(offload_gib: float, bytes_per_block: int, *, num_processes: int = 1,
                     prefix_caching: bool = True, draft: bool = False, host_room: int | None = None,
                     snapshot_bytes: int = 0) -> int:
    """Host slots `--kv-offload-gib` buys (0: the tier is off). `host_room`: host bytes the
    tier may take (what is available, less a CPU backend's KV cache still to be allocated);
    None: unknown, not checked. `snapshot_bytes`: what its recurrent-state snapshots take
    of it (`host_tier_snapshots` times a snapshot's bytes), the blocks getting the rest.

    Raises:
      ValueError: the tier is asked for where it cannot work, or buys not one block;
        MemoryBoundError (one) when the host has less room than the tier's blocks take.
    """
    if not offload_gib:
        return 0
    if num_processes > 1:
        raise ValueError("--kv-offload-gib is not supported on a multi-host mesh (each process would hold "
                         "its own host copy of its KV shards); serve without it")
    if not prefix_caching:
        raise ValueError("--kv-offload-gib keeps prefix-cache blocks in host memory: it needs prefix caching "
                         "(drop --no-prefix-caching)")
    if draft:
        raise ValueError("--kv-offload-gib does not hold a draft model's KV yet; serve --speculative draft "
                         "without it (or use --speculative ngram)")
    num = (int(offload_gib * GIB) - snapshot_bytes) // bytes_per_block
    if num < 1:
        raise ValueError(f"--kv-offload-gib {offload_gib:g} holds no KV block (one takes {bytes_per_block} "
                         f"bytes); give at least {bytes_per_block / GIB:.6f}")
    if host_room is not None and num * bytes_per_block + snapshot_bytes > host_room:
        need = num * bytes_per_block + snapshot_bytes
        raise MemoryBoundError("kv_offload_gib", f"kv_offload_gib {offload_gib:g} needs {need / GIB:.2f} "
                                                 f"GiB of host memory; the host has {max(host_room, 0) / GIB:.2f} GiB "
                                                 "to spare beside the weights and the KV cache: give less")
    return num


class HostTier:
    """Name <-> host slot index of offloaded blocks, and the copies the next step runs."""

    def __init__(self, num_slots: int, num_snapshot_slots: int = 0) -> None:
        assert num_slots > 0, f"a host tier of {num_slots} slots"
        self.num_slots = num_slots
        self._slot_by_name: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._name_by_slot: dict[int, bytes] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._pins: collections.Counter[int] = collections.Counter()  # slots a pending restore reads
        self._saves: list[tuple[int, int]] = []  # (device block, host slot), in order
        self._restores: list[tuple[int, int]] = []  # (host slot, device block)
        # Counters (BatcherStats' kv_offload_*).
        self.num_stored = 0  # blocks copied to host memory
        self.num_evicted = 0  # names the LRU dropped for newer ones
        self.num_restored = 0  # blocks copied back into the device cache
        # Recurrent-state snapshots (the module docstring, "Snapshots"): name -> host state slot.
        self.num_snapshot_slots = num_snapshot_slots
        self._snapshot_by_name: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._name_by_snapshot: dict[int, bytes] = {}
        self._free_snapshots = list(range(num_snapshot_slots - 1, -1, -1))
        self._snapshot_pins: collections.Counter[int] = collections.Counter()
        self.num_snapshots_stored = 0  # device snapshots copied to host memory
        self.num_snapshots_evicted = 0  # host snapshots the LRU dropped for newer ones
        self.num_snapshots_restored = 0  # host snapshots copied into a row's state slot

    @property
    def num_cached_blocks(self) -> int:
        return len(self._slot_by_name)

    def offer(self, name: bytes, block_id: int) -> None:
        """The device cache evicts `block_id`, named `name`: keep a copy (a save in the next
        step), or refresh the name when the tier holds it already. When every slot is taken
        and pinned, the block is dropped as without the tier."""
        if name in self._slot_by_name:
            self._slot_by_name.move_to_end(name)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._slot_by_name[name] = slot
        self._name_by_slot[slot] = name
        self._saves.append((block_id, slot))
        self.num_stored += 1

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for name, slot in self._slot_by_name.items():  # least recently used first
            if not self._pins[slot]:
                del self._slot_by_name[name]
                del self._name_by_slot[slot]
                self.num_evicted += 1
                return slot
        return None

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """Slots of the longest run of `names` the tier holds (a prompt's chain, continuing
        where the device cache's hit ended)."""
        slots = []
        for name in names:
            slot = self._slot_by_name.get(name)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, slots: Iterable[int]) -> None:
        """Keeps `slots` from being overwritten until the plan is taken (an admission reads them)."""
        self._pins.update(slots)

    def unpin(self, slots: Iterable[int]) -> None:
        """Undoes `pin` (the admission did not happen)."""
        self._pins.subtract(slots)

    def restore(self, slot: int, block_id: int) -> None:
        """Copies `slot` into the fresh device block `block_id` at the next step's start."""
        assert self._pins[slot] > 0, f"restoring host slot {slot}, which admission did not pin"
        self._slot_by_name.move_to_end(self._name_by_slot[slot])
        self._restores.append((slot, block_id))
        self.num_restored += 1

    def take(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """(saves, restores) for the step being planned; the pins go with them. A slot saved
        twice keeps its last save (its first name was dropped for the second)."""
        last = {slot: i for i, (_, slot) in enumerate(self._saves)}
        saves = tuple(pair for i, pair in enumerate(self._saves) if last[pair[1]] == i)
        restores = tuple(self._restores)
        self._saves, self._restores = [], []
        self._pins.clear()
        return saves, restores

    def forget_slots(self, slots: Iterable[int]) -> None:
        """Drops the names of `slots` (their save was in a step that failed: contents unknown)."""
        for slot in slots:
            name = self._name_by_slot.pop(slot, None)
            if name is not None:
                del self._slot_by_name[name]
                self._free_slots.append(slot)

    # -- recurrent-state snapshots (the module docstring, "Snapshots") ---------------------

    @property
    def num_cached_snapshots(self) -> int:
        return len(self._snapshot_by_name)

    def offer_snapshot(self, name: bytes) -> int | None:
        """The device drops the snapshot at the end of the block named `name`: the host slot
        its copy goes to (the caller queues the copy with the state pool's, in order), or
        None: the tier holds that snapshot already (the state after the same tokens; its
        name is refreshed), or every slot is pinned, or the tier keeps no snapshots."""
        if name in self._snapshot_by_name:
            self._snapshot_by_name.move_to_end(name)
            return None
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        else:
            victim = next((n for n, s in self._snapshot_by_name.items() if not self._snapshot_pins[s]), None)
            if victim is None:
                return None
            slot = self._snapshot_by_name.pop(victim)
            del self._name_by_snapshot[slot]
            self.num_snapshots_evicted += 1
        self._snapshot_by_name[name] = slot
        self._name_by_snapshot[slot] = name
        self.num_snapshots_stored += 1
        return slot

    def snapshot_slot(self, name: bytes) -> int | None:
        """The host slot of the snapshot at the end of the block named `name` (None: none)."""
        return self._snapshot_by_name.get(name)

    def pin_snapshot(self, slot: int) -> None:
        """Keeps `slot` from being overwritten until the state copies that read it are taken."""
        self._snapshot_pins[slot] += 1

    def unpin_snapshot(self, slot: int) -> None:
        self._snapshot_pins[slot] -= 1

    def restore_snapshot(self, slot: int) -> None:
        """A hit restores host snapshot `slot` (pinned) into a row's state slot: it is used."""
        assert self._snapshot_pins[slot] > 0, f"restoring host snapshot {slot}, which admission did not pin"
        self._snapshot_by_name.move_to_end(self._name_by_snapshot[slot])
        self.num_snapshots_restored += 1

    def snapshot_copies_taken(self) -> None:
        """The state copies reading pinned snapshots were taken into a plan: the pins go."""
        self._snapshot_pins.clear()

    def forget_snapshots(self, slots: Iterable[int]) -> None:
        """Drops the snapshots of `slots` (their save was in a step that failed)."""
        for slot in slots:
            name = self._name_by_snapshot.pop(slot, None)
            if name is not None:
                del self._snapshot_by_name[name]
                self._free_snapshots.append(slot)

    def clear(self) -> None:
        """Forgets every name and pending copy (sleep)."""
        self._slot_by_name.clear()
        self._name_by_slot.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pins.clear()
        self._saves, self._restores = [], []
        self._snapshot_by_name.clear()
        self._name_by_snapshot.clear()
        self._free_snapshots = list(range(self.num_snapshot_slots - 1, -1, -1))
        self._snapshot_pins.clear()

    def check(self) -> None:
        """Asserts the index's invariants (tests)."""
        assert len(self._slot_by_name) == len(self._name_by_slot), "names and slots disagree"
        assert set(self._name_by_slot).isdisjoint(self._free_slots), "a named slot is also free"
        assert len(self._name_by_slot) + len(self._free_slots) == self.num_slots, "a slot leaked"
        assert all(self._slot_by_name[name] == slot for slot, name in self._name_by_slot.items())
        assert len(self._snapshot_by_name) == len(self._name_by_snapshot), "snapshot names and slots disagree"
        assert set(self._name_by_snapshot).isdisjoint(self._free_snapshots), "a named snapshot slot is also free"
        assert len(self._name_by_snapshot) + len(self._free_snapshots) == self.num_snapshot_slots, "a snapshot leaked"


class HostKVPool:
    """The runner's host memory for the tier: `num_slots` blocks of K and V, every layer.

    Allocated with `np.empty`, so the operating system hands out pages as slots are first
    written, not the whole budget at start-up.
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype) -> None:
        self.num_slots = num_slots
        self.slots = np.empty((num_slots, 2, num_layers, num_kv_heads, block_size, head_dim), dtype)

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def put(self, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Stores blocks: `k`, `v` [layers, kv_heads, len(slots), block_size, head_dim], as gathered."""
        self.slots[slots, 0] = np.moveaxis(k, 2, 0)
        self.slots[slots, 1] = np.moveaxis(v, 2, 0)

    def get(self, slots: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The blocks of `slots` as (k, v) [layers, kv_heads, width, block_size, head_dim],
        zeros past len(slots) (padding, scattered into the null block)."""
        blocks = np.zeros((width,) + self.slots.shape[1:], self.slots.dtype)
        blocks[:len(slots)] = self.slots[slots]
        return np.moveaxis(blocks[:, 0], 0, 2), np.moveaxis(blocks[:, 1], 0, 2)


def host_room_for_tier(cpu_kv_bytes: int) -> int | None:
    """Host bytes a tier may take now: what the host has available (`memory_bounds`), less
    `cpu_kv_bytes`, the KV cache still to be allocated in the same memory when the backend
    is the CPU (0 on an accelerator); None where the host does not say."""
    have = host_available_bytes()
    return None if have is None else have - cpu_kv_bytes


class HostStatePool:
    """The runner's host memory for the tier's snapshots: `num_slots` recurrent states, each
    every DeltaNet layer's conv f32[E, Kc - 1, C] and recurrent f32[E, Hv, dk, dv] state (E
    entries: 1, or 1 + the most drafts with speculation) and, with E > 1, its position.
    `np.empty`, as `HostKVPool`: pages come as slots are first written."""

    def __init__(self, num_slots: int, conv_shapes: Sequence[tuple[int, ...]],
                 recurrent_shapes: Sequence[tuple[int, ...]], entries: int) -> None:
        self.num_slots = num_slots
        self.conv = [np.empty((num_slots, entries, *shape), np.float32) for shape in conv_shapes]
        self.recurrent = [np.empty((num_slots, entries, *shape), np.float32) for shape in recurrent_shapes]
        self.positions = np.zeros(num_slots, np.int32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv + self.recurrent) + self.positions.nbytes

    def put(self, slots: np.ndarray, conv: Sequence[np.ndarray], recurrent: Sequence[np.ndarray],
            positions: np.ndarray) -> None:
        """Stores states as gathered: per layer [B, E, ...], B >= len(slots) (padding past it)."""
        n = len(slots)
        for host, got in zip(self.conv + self.recurrent, list(conv) + list(recurrent)):
            host[slots] = got[:n]
        self.positions[slots] = positions[:n]

    def get(self, slots: np.ndarray, width: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """The states of `slots` as (conv, recurrent, positions), `width` of each, zeros past
        len(slots) (padding, scattered into the null slot)."""
        def padded(a):
            out = np.zeros((width,) + a.shape[1:], a.dtype)
            out[:len(slots)] = a[slots]
            return out
        return [padded(a) for a in self.conv], [padded(a) for a in self.recurrent], padded(self.positions)


def host_tier_snapshots(offload_gib: float, bytes_per_block: int, snapshot_bytes: int, device_blocks: int,
                        device_snapshots: int) -> int:
    """Host snapshot slots of a tier of `offload_gib` for a model with recurrent layers (0:
    none, the model has none or the device keeps no snapshots): the tier's bytes split
    between blocks and snapshots as the device cache splits its own (`device_blocks` blocks
    of `bytes_per_block`, `device_snapshots` snapshot slots of `snapshot_bytes`), at least one.

    Raises:
      ValueError: the tier cannot hold one snapshot and one block.
    """
    if not offload_gib or not snapshot_bytes or not device_snapshots:
        return 0
    total = int(offload_gib * GIB)
    share = device_snapshots * snapshot_bytes / (device_snapshots * snapshot_bytes + device_blocks * bytes_per_block)
    num = max(1, int(total * share) // snapshot_bytes)
    if total - num * snapshot_bytes < bytes_per_block:
        need = (snapshot_bytes + bytes_per_block) / GIB
        raise ValueError(f"--kv-offload-gib {offload_gib:g} holds no recurrent-state snapshot beside a KV block "
                         f"(a snapshot takes {snapshot_bytes} bytes, a block {bytes_per_block}); give at least "
                         f"{need:.6f}")
    return num


@dataclasses.dataclass(frozen=True)
class HostTierSize:
    """What `--kv-offload-gib` buys: `blocks` host slots (0: the tier is off) and, for a
    model with recurrent layers, `snapshots` snapshot slots of `snapshot_bytes` each."""

    blocks: int
    bytes_per_block: int
    snapshots: int = 0
    snapshot_bytes: int = 0

    @property
    def note(self) -> str:
        """The start-up log's line."""
        snapshots = (f", {self.snapshots} recurrent-state snapshots of {self.snapshot_bytes} bytes"
                     if self.snapshots else "")
        return f"host KV tier: {self.blocks} blocks of {self.bytes_per_block} bytes{snapshots}"


def size_host_tier(config, bytes_per_block: int, device_blocks: int, specs, rows: int, *, num_processes: int = 1,
                   draft: bool = False, host_room: int | None = None) -> HostTierSize:
    """The host tier of an engine's `config` (`kv_offload_gib`, `prefix_caching`,
    `state_snapshots`, `speculative`) beside a device cache of `device_blocks` blocks, for a
    model whose recurrent layers are `specs` (none: no snapshots) and `rows` rows: snapshots
    first (`host_tier_snapshots`), blocks from the rest (`host_tier_blocks`, which refuses)."""
    snapshot_bytes = pool_bytes(specs, 1, state_entries(config.speculative))
    snapshots = host_tier_snapshots(config.kv_offload_gib, bytes_per_block, snapshot_bytes, device_blocks,
                                    snapshot_slots(rows, config.prefix_caching, config.state_snapshots))
    blocks = host_tier_blocks(config.kv_offload_gib, bytes_per_block, num_processes=num_processes,
                              prefix_caching=config.prefix_caching, draft=draft, host_room=host_room,
                              snapshot_bytes=snapshots * snapshot_bytes)
    return HostTierSize(blocks, bytes_per_block, snapshots, snapshot_bytes if snapshots else 0)
