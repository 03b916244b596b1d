"""KV groups: the sliding-window layers' own block pool, freed behind the window. No jax here.

A model's layers fall in KV groups by what their queries see: the *full* group (every
key from position 0) and, for a family with sliding layers (Gemma 2/3/4, gpt-oss, Mistral
or Phi-3 with a window), the *sliding* group of window W (keys p - W < s <= p). A full
layer needs a row's every block for its whole life; a sliding layer only the blocks its
next query can still see, at most ceil(W / bs) + 1 for a one-token step (W keys straddle
one block boundary more than W / bs).

The design: vLLM's hybrid KV cache manager (one block table per group, each group its own
pool sized from its own need), in the form that changes least here. The full group keeps
today's block ids, tables and `BlockBudget`. The sliding group's pool is `WindowPool`: its
ids are *slots*, and a slot is attached to a full block id when the block is allocated
(`slot_of[block]`), so a sliding table is the full table mapped through `slot_of`, with
the entries behind the window mapped to the null slot 0. One table per row therefore
stays the only thing the prefix cache, copy-on-write, fork, preemption and speculative
rollback handle; the sliding group follows each of them through the hooks below. A shared
pool (one id space, sliding tables handing their blocks back) was the other choice; it
would need a second table next to every row's anyway (the full layers still read the
blocks the sliding ones release), so it buys nothing over a mapped one.

A table's sliding state is one number, `start`: the blocks at indices < start hold no
slot reference of that table. Before a step writes positions [p, p + T) of a table
(`BlockTables._prepare`), `advance` moves start to `first_window_block(p)` and drops the
references of the blocks it passes: those lie wholly behind every key the step's queries
see. A slot whose last reference goes is *free*, or *parked* when its full block is named
in the prefix cache (idle, kept for a later hit, evicted least recently parked first when
a fresh slot is needed, or at once when the prefix cache evicts the full block).

What a table holds: after `advance(p)` and the step's allocations up to p + T it holds
blocks first_window_block(p) .. ceil((p + T) / bs) - 1, at most
`window_cap(T) = ceil((W - 1 + T) / bs) + 1` slots (never more than the row's full need).
A job's worst case is its largest table times its rows (`quota`): admission reserves it
beside the full group's promise, so allocating a slot never fails mid-step (held slots
never exceed the reserved quotas, and the pool has at least as many slots).

Prefix-cache hits: the full blocks hit as today; the sliding layers of the job's first
computed position need the slots of the hit's last blocks (from `first_window_block` of
it). A hit whose window blocks have lost their slots (parked and evicted) is cut back to
the longest run whose window blocks still have theirs: the rest is recomputed, never read
from a slot that holds another block's keys.

Storage (`window_plan`, `ferrox_jax/kv_cache.py`): the sliding layers' cache arrays hold
the pool's slots (each row's cap, twice over with prefix caching so finished rows' windows
stay parked for hits), the full layers' arrays the blocks; each step carries the rows'
window tables (`StepPlan.window_slots` -> `HostBatch.window_tables` -> the model's
`ForwardContext.window`) and copy-on-write's slot copies (`window_copies`). Gemma 4's
arrays are named by `kv_source` (its shared-KV layers read their source's array through
the source's table). Every layer sliding, the full group has no array: its block ids are
logical (0 bytes each, so each row is sized a whole context of them) and the pool is the
cache. A draft model's runner keeps arrays of its own, a block for every block id (it
mirrors the target's batches and leaves their window columns out): its bytes count with
the full group's, so beside a draft the block ids are never logical. Where the sliding
arrays cannot be indexed apart (the host tier's cache and an MTP layer's are copied or
indexed by block id), or the pool would not be smaller than what it replaces, every array
keeps `num_blocks` and this pool is the sliding group's accounting only (its gauges in
`/admin/stats`), sized to refuse nothing the full group admits.
"""

from __future__ import annotations

import collections
import dataclasses
import math

NULL_SLOT = 0


def first_window_block(position: int, window: int, block_size: int) -> int:
    """Index of the first block holding a key the query at `position` sees (keys
    position - window < s <= position): the blocks before it are wholly behind the window."""
    return max(0, position - window + 1) // block_size


def window_cap(window: int, block_size: int, step_tokens: int, per_row: int) -> int:
    """Most slots one table holds while a step computes `step_tokens` positions of it: the
    window of its first query plus the step's own positions, never more than its `per_row`."""
    return min(per_row, math.ceil((window - 1 + step_tokens) / block_size) + 1)


def sliding_window(cfg) -> int | None:
    """The window of a model config's sliding group, or None when no layer slides."""
    windows = {cfg.window(layer) for layer in range(cfg.num_layers)} - {None}
    assert len(windows) <= 1, f"layers slide over different windows: {sorted(windows)}"
    return windows.pop() if windows else None


def window_arrays(cfg) -> tuple[bool, ...]:
    """Per cache array, whether it belongs to the sliding group; () when the model keeps
    one pool for every layer: no sliding layer, or a family whose arrays are neither one
    per layer of the shared decoder nor named by `kv_source` (a hybrid's recurrent layers).
    Gemma 4: array `kv_source(i)` slides with the layers that write and read it (a shared
    layer is of its source's type, so they agree)."""
    if sliding_window(cfg) is None:
        return ()
    if hasattr(cfg, "kv_source"):
        slides = {cfg.kv_source(layer): cfg.window(layer) is not None for layer in range(cfg.num_layers)}
        assert sorted(slides) == list(range(len(cfg.kv_layout()))), "kv_source must name every array"
        return tuple(slides[a] for a in range(len(slides)))
    if getattr(type(cfg).kv_layout, "__qualname__", "") != "ModelConfig.kv_layout":
        return ()
    return tuple(cfg.window(layer) is not None for layer in range(cfg.num_layers))


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """How a model's cache splits into groups under some settings (`window_plan`)."""

    windowed: tuple[bool, ...]  # per cache array: the sliding group's (() : one pool for every layer)
    window: int  # the sliding group's window in tokens
    slot_bytes: int  # K+V bytes of one slot over the sliding arrays
    full_bytes: int  # K+V bytes of one block over the other arrays
    cap: int  # slots one row's table holds at most (`window_cap` of the largest step)
    parking: bool = False  # prefix caching is on: room for the finished rows' windows too

    def slots(self, max_seqs: int) -> int:
        """The sliding pool for `max_seqs` rows (the null slot not counted): each row's cap,
        twice over with prefix caching, so the windows of as many finished rows stay parked
        for a hit (a hit whose window slots were evicted is cut back and recomputed)."""
        return max_seqs * self.cap * (2 if self.parking else 1)


def window_plan(cfg, settings, block_size: int, itemsize: int) -> WindowPlan | None:
    """The sliding group of `cfg` under engine `settings` (`prefill_chunk`, `prefill_chunk_idle`,
    `speculative`, `kv_offload_gib`: the host tier copies every layer by block id, so it
    keeps one pool), or None: one pool for every layer. A draft model's cache is its own
    runner's, a block per block id: its bytes go with the full group's (`size_kv`)."""
    windowed = window_arrays(cfg)
    if not windowed or getattr(settings, "kv_offload_gib", 0):
        return None
    spec = getattr(settings, "speculative", None)
    step_tokens = max(settings.prefill_chunk, settings.prefill_chunk_idle,
                      1 + (spec.most_drafts if spec is not None else 0))
    window = sliding_window(cfg)
    per_array = [heads * (k_dim + v_dim) * block_size * itemsize for heads, k_dim, v_dim in cfg.kv_layout()]
    return WindowPlan(windowed, window, sum(b for b, w in zip(per_array, windowed) if w),
                      sum(b for b, w in zip(per_array, windowed) if not w),
                      math.ceil((window - 1 + step_tokens) / block_size) + 1,
                      bool(getattr(settings, "prefix_caching", False)))


class WindowPool:
    """The sliding group's slots: free, held (reference counted) or parked, each attached
    to the full block whose sliding K/V it holds. Owner thread only."""

    def __init__(self, num_slots: int, window: int, block_size: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"WindowPool.num_slots must be > 0; got {num_slots}")
        if window <= 0:
            raise ValueError(f"WindowPool.window must be > 0; got {window}")
        self.num_slots = num_slots
        self.window = window
        self.block_size = block_size
        self.num_reserved = 0  # sum of admitted jobs' quotas
        self.num_freed_behind = 0  # references dropped because the window passed their block (a counter)
        self.peak_held = 0
        self._free = list(range(num_slots, 0, -1))
        self._refs: dict[int, int] = {}
        self._parked: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached: set[int] = set()  # slots whose full block the prefix cache names
        self.slot_of: dict[int, int] = {}  # full block id -> its slot
        self._block_of: dict[int, int] = {}  # slot -> full block id
        self._starts: dict[object, int] = {}  # table owner (a JobState or a Row) -> its start

    # -- views ------------------------------------------------------------------------

    @property
    def num_held(self) -> int:
        return len(self._refs)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_free(self) -> int:
        """Slots not reserved by admitted jobs, parked ones counting as free (as the full
        group's idle cached blocks do)."""
        return self.num_slots - max(self.num_reserved, self.num_held)

    def has_slot(self, block_id: int) -> bool:
        return block_id in self.slot_of

    def start(self, owner: object) -> int:
        return self._starts.get(owner, 0)

    # -- admission --------------------------------------------------------------------

    def quota(self, per_row: int, n: int, step_tokens: int) -> int:
        """Slots a job of `n` rows reserves: its largest table (`window_cap`) per row."""
        return n * window_cap(self.window, self.block_size, step_tokens, per_row)

    def try_reserve(self, num_slots: int) -> bool:
        if self.num_reserved + num_slots > self.num_slots:
            return False
        self.num_reserved += num_slots
        return True

    def unreserve(self, num_slots: int) -> None:
        assert 0 <= num_slots <= self.num_reserved, f"unreserving {num_slots} of {self.num_reserved} slots"
        self.num_reserved -= num_slots

    def usable_hits(self, hits: list[int]) -> int:
        """How many leading blocks of a prefix hit the job may take: the longest run whose
        window blocks (those the first computed position's queries see) all have slots."""
        k = len(hits)
        while k > 0:
            first = first_window_block(k * self.block_size, self.window, self.block_size)
            if all(block_id in self.slot_of for block_id in hits[first:k]):
                return k
            k -= 1
        return 0

    # -- a table's slots ------------------------------------------------------------------

    def open(self, owner: object, block_ids: list[int], start: int) -> None:
        """A table starts referencing the slots of `block_ids[start:]` (a hit, a fork)."""
        self._starts[owner] = start
        for block_id in block_ids[start:]:
            self._share(block_id)

    def attach(self, owner: object, block_id: int) -> int:
        """A freshly allocated full block at the end of `owner`'s table gets a slot."""
        self._starts.setdefault(owner, 0)
        slot = self._free.pop() if self._free else self._evict_parked()
        self._refs[slot] = 1
        self.slot_of[block_id], self._block_of[slot] = slot, block_id
        self.peak_held = max(self.peak_held, len(self._refs))
        return slot

    def advance(self, owner: object, block_ids: list[int], position: int) -> None:
        """The table's next step computes from `position`: drop its references to the
        blocks wholly behind the window of that position."""
        start = self._starts.get(owner, 0)
        first = min(first_window_block(position, self.window, self.block_size), len(block_ids))
        for block_id in block_ids[start:first]:
            self._drop(block_id)
            self.num_freed_behind += 1
        self._starts[owner] = max(start, first)

    def replace(self, old_block: int, new_block: int) -> tuple[int, int]:
        """Copy-on-write replaced `old_block` in a table by `new_block` (already
        `attach`ed): drops the old reference; returns the (old, new) slots to copy."""
        old_slot = self.slot_of[old_block]
        self._drop(old_block)
        return old_slot, self.slot_of[new_block]

    def close(self, owner: object, block_ids: list[int]) -> None:
        """The table ends (its row finished, its job was preempted): drop every reference
        it still holds, tail first (parked tails are evicted before their heads)."""
        start = self._starts.pop(owner, 0)
        for block_id in reversed(block_ids[start:]):
            self._drop(block_id)

    def move(self, old_owner: object, new_owner: object) -> None:
        """The table changes owner (a job's prefill table becomes its first row's)."""
        self._starts[new_owner] = self._starts.pop(old_owner, 0)

    # -- the prefix cache's view ------------------------------------------------------

    def named(self, block_id: int) -> None:
        """The prefix cache named a full block: its slot parks when its references go."""
        slot = self.slot_of.get(block_id)
        if slot is not None:
            self._cached.add(slot)

    def block_evicted(self, block_id: int) -> None:
        """The prefix cache forgot a full block: its slot, if parked, goes free now."""
        slot = self.slot_of.get(block_id)
        if slot is None:
            return
        self._cached.discard(slot)
        if slot in self._parked:
            del self._parked[slot]
            self._release(slot)

    # -- internals --------------------------------------------------------------------

    def _share(self, block_id: int) -> None:
        slot = self.slot_of[block_id]
        count = self._refs.get(slot, 0)
        if count == 0:
            del self._parked[slot]
        self._refs[slot] = count + 1
        self.peak_held = max(self.peak_held, len(self._refs))

    def _drop(self, block_id: int) -> None:
        slot = self.slot_of[block_id]
        count = self._refs[slot]
        if count > 1:
            self._refs[slot] = count - 1
            return
        del self._refs[slot]
        if slot in self._cached:
            self._parked[slot] = None
        else:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self._cached.discard(slot)
        del self.slot_of[self._block_of.pop(slot)]
        self._free.append(slot)

    def _evict_parked(self) -> int:
        assert self._parked, "no free or parked slot (held slots exceed the reserved quotas)"
        slot, _ = self._parked.popitem(last=False)
        self._cached.discard(slot)
        del self.slot_of[self._block_of.pop(slot)]
        return slot

    def check(self, tables: list[tuple[object, list[int]]]) -> None:
        """Asserts the invariants against the live tables ((owner, block ids) pairs)."""
        free, held, parked = set(self._free), set(self._refs), set(self._parked)
        assert len(free) == len(self._free), "a slot is free twice"
        assert not (free & held) and not (free & parked) and not (held & parked), "a slot in two states"
        assert free | held | parked == set(range(1, self.num_slots + 1)), "a slot leaked or is unknown"
        assert set(self._block_of) == held | parked, "a held or parked slot without its block (or a free one with)"
        assert parked <= self._cached, "a parked slot whose block the prefix cache does not name"
        counts: collections.Counter[int] = collections.Counter()
        for owner, block_ids in tables:
            counts.update(self.slot_of[b] for b in block_ids[self._starts.get(owner, 0):])
        assert counts == collections.Counter(self._refs), "slot references differ from the tables' windows"
        assert len(held) <= max(self.num_reserved, 0) or not tables, "held slots exceed the reserved quotas"
