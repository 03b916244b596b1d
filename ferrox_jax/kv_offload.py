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
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import numpy as np

from ferrox_jax.memory_bounds import MemoryBoundError, host_available_bytes

GIB = 1 << 30


def host_tier_blocks(offload_gib: float, bytes_per_block: int, *, num_processes: int = 1,
                     prefix_caching: bool = True, draft: bool = False, host_room: int | None = None) -> int:
    """Host slots `--kv-offload-gib` buys (0: the tier is off). `host_room`: host bytes the
    tier may take (what is available, less a CPU backend's KV cache still to be allocated);
    None: unknown, not checked.

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
    num = int(offload_gib * GIB) // bytes_per_block
    if num < 1:
        raise ValueError(f"--kv-offload-gib {offload_gib:g} holds no KV block (one takes {bytes_per_block} "
                         f"bytes); give at least {bytes_per_block / GIB:.6f}")
    if host_room is not None and num * bytes_per_block > host_room:
        raise MemoryBoundError("kv_offload_gib", f"kv_offload_gib {offload_gib:g} needs {num * bytes_per_block / GIB:.2f} "
                                                 f"GiB of host memory; the host has {max(host_room, 0) / GIB:.2f} GiB "
                                                 "to spare beside the weights and the KV cache: give less")
    return num


class HostTier:
    """Name <-> host slot index of offloaded blocks, and the copies the next step runs."""

    def __init__(self, num_slots: int) -> None:
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

    def clear(self) -> None:
        """Forgets every name and pending copy (sleep)."""
        self._slot_by_name.clear()
        self._name_by_slot.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pins.clear()
        self._saves, self._restores = [], []

    def check(self) -> None:
        """Asserts the index's invariants (tests)."""
        assert len(self._slot_by_name) == len(self._name_by_slot), "names and slots disagree"
        assert set(self._name_by_slot).isdisjoint(self._free_slots), "a named slot is also free"
        assert len(self._name_by_slot) + len(self._free_slots) == self.num_slots, "a slot leaked"
        assert all(self._slot_by_name[name] == slot for slot, name in self._name_by_slot.items())


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
