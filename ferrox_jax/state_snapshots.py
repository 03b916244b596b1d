"""State snapshots: the recurrent state at chosen block boundaries, for prefix hits. No jax here.

A model with recurrent (linear-attention) layers cannot take a prefix hit from K/V blocks
alone: its DeltaNet layers need the state after the hit's last token, which no block holds.
So the prefix cache keeps *snapshots* of that state beside some blocks (`StateSnapshots`,
the recurrent group's part of `ferrox_jax/block_tables.py`), in the spirit of vLLM's mamba
prefix caching in "align" mode (states cached at block boundaries, chunk ends aligned to
them) and SGLang's `MambaRadixCache` (a state at each chunk end of a prefill, and one at the
last tracked boundary of a finished request; a match is cut back to the last node holding a
state).

    slots      the state pool's device arrays hold, after the null slot and the running
               slots 1..R, S snapshot slots R + 1 .. R + S (`state_pool.pool_slots`: S is
               `--state-snapshots`, or two per row: see "how many" below)
    prompts    a prompt of P tokens is snapshotted at every multiple of the interval
               I = `--state-snapshot-interval` blocks (I * bs tokens) up to B, and at
               B = floor((P - 1) / bs) * bs, the end of its last full block before its last
               token (the longest hit a repeat of it can take); 0 < position <= B. The
               positions depend on the token position only, never on the prompt, so two
               prompts sharing a system prompt of several intervals both snapshot its
               boundaries, and the second hits the last one inside it. The scheduler cuts
               the prompt's chunking to end a chunk at each (`chunk_end`): after that step
               the row's running slot holds the state there, and the next step copies it to
               a snapshot slot before its forward (`StatePool.save`)
    decode     a row keeps one more snapshot, at its last full block of prompt + generated
               tokens: each time its computed tokens reach a block boundary (a decode step,
               a preempted row's recompute, or a prefill ending on one) the state there is
               saved and attached to that block, into the slot of the row's previous such
               snapshot (`moving_of`: it moves, one per row), so when the row ends the
               snapshot sits at the end of the last full block of its conversation, where
               the chat's next turn (this prompt + this reply + more) hits. With
               speculation a step may pass a boundary mid-step: the slot's entries hold the
               state after each verified token and the copy carries them all with the
               slot's position (`models/deltanet.py`, "Speculation"), so a row restored at
               the boundary reads the entry after it
    where      attached to the cached block ending at the position (`slot_of[block]`, the
               block the prefix cache names so: another job's when it computed the same
               prefix first): evicting the block frees the snapshot with it
               (`block_evicted`)
    a hit      admission cuts a hit back to its last block with a snapshot (`usable_hits`;
               none: no hit), and the row's running slot takes a copy of it before the row's
               first chunk (`StatePool.restore`); the row computes on from that block's end
    full       a new snapshot takes a free slot, else the snapshot of an idle cached block
               (its block stays cached, K/V only, and hits on it are cut back), else none
               is taken (a block held by a running row keeps its snapshot). Which idle
               block (`StateSnapshots.victim`): the least recently released one holding a
               prompt's snapshot, and only when none does, the least recently released
               holding a decode snapshot. A finished row's decode snapshot is where its
               chat's next turn starts, past everything a prompt snapshot of the same chat
               covers; first released, first taken would give it up first of all, as a
               row's blocks are released tail first (tested: a chat's next turn keeps its
               hit at the reply's end where the policy before fell back to the prompt's)
    host tier  with `--kv-offload-gib`, a snapshot the device drops (taken for a newer one,
               or its block evicted) is copied to host memory first, and a hit may restore
               a snapshot only the host holds (`ferrox_jax/kv_offload.py`, "Snapshots")

How many, and how often. A slot holds every DeltaNet layer's state: for Qwen3-Next (36
DeltaNet layers, 32 value heads of 128 x 128, f32) 75 MiB, the bf16 K/V of about 3,200 tokens
of its 12 attention layers; for the default `Qwen3_5TextConfig` 50 MiB. A snapshot on every
block (vLLM's "all" mode) would cost that per 16 tokens, so snapshots are a fixed pool of
slots (S, evicted least recently released first) and the interval decides which boundaries
compete for them. The default interval is 32 blocks, 512 tokens at the default block size: a
system prompt of N tokens keeps a hit on its first floor(N / 512) * 512 (SGLang spaces the
states it tracks 256 tokens apart), a 4k-token prompt takes 8 snapshots, not 256, and 512 is
a multiple of the default chunk (128) and of the chunk sizes commonly set, so full chunks
from position 0 already end on every interval boundary and are cut for none, while a prompt
starting elsewhere (after a hit, or after a chunk the step's budget shortened) is cut at its
next boundary, then runs aligned. 0 turns the interval off (B and the decode snapshot only).
The default slot count is two per row: each running row can hold its prompt's B snapshot and
its decode snapshot on its own (held, so unstealable) blocks; with one per row the running
rows' decode snapshots would take the slots new prompts' snapshots need. The interval
snapshots of long prompts take the remaining free or least recently released idle ones.

Chunk cuts add no compiled shape: a chunk cut short is padded to the token bucket at or
above its length, as any last chunk of a prompt is (`ferrox_jax/buckets.py`), so the cuts
cost steps, never compiles.

A snapshot whose save was in a step that failed is dropped (`forget_slots`): its contents are
unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from ferrox_jax.kv_offload import HostTier
from ferrox_jax.state_pool import SNAPSHOTS_PER_ROW, StatePool, host_id

# `--state-snapshot-interval`'s default, in blocks (the module docstring, "How many, and how often").
DEFAULT_INTERVAL_BLOCKS = 32


def snapshot_position(num_prompt_tokens: int, block_size: int) -> int:
    """B: a prompt's last snapshot (0: the prompt has no full block before its last token)."""
    return (num_prompt_tokens - 1) // block_size * block_size


def next_snapshot_position(start: int, num_prompt_tokens: int, block_size: int, interval_blocks: int) -> int:
    """The first of a prompt's snapshot positions after `start` (0: none is left): the next
    multiple of the interval (`interval_blocks` blocks; 0: none) below B, else B."""
    last = snapshot_position(num_prompt_tokens, block_size)
    if start >= last:
        return 0
    if interval_blocks:
        step = interval_blocks * block_size
        return min((start // step + 1) * step, last)
    return last


def is_snapshot_position(at: int, num_prompt_tokens: int, block_size: int, interval_blocks: int) -> bool:
    """Whether a prefill that has computed `at` tokens stands on one of its prompt's snapshot positions."""
    return 0 < at and next_snapshot_position(at - 1, num_prompt_tokens, block_size, interval_blocks) == at


def block_index(at: int, block_size: int) -> int:
    """The index in a chain of the block ending at position `at` (a multiple of the block size)."""
    return at // block_size - 1


class StateSnapshots:
    """Snapshot slots `first_slot .. first_slot + num_slots - 1` of the state pool, each
    attached to the cached block whose end it is the state at. Owner thread only."""

    def __init__(self, first_slot: int, num_slots: int) -> None:
        if num_slots <= 0 or first_slot <= 0:
            raise ValueError(f"StateSnapshots needs slots after the null slot; got first_slot={first_slot}, "
                             f"num_slots={num_slots}")
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.slot_of: dict[int, int] = {}  # cached block id -> the snapshot slot of the state at its end
        self.moving_of: dict[int, int] = {}  # row id -> the block of its decode snapshot (the module docstring)
        self.decode_blocks: set[int] = set()  # blocks holding a decode snapshot (moving, or left by a finished row)
        self.num_taken = 0  # snapshots taken (a counter; a decode snapshot counts each time it moves)
        self.num_restored = 0  # hits that restored one (a counter)
        self.num_dropped = 0  # snapshots freed without their block (stolen or moved for a newer one, a failed step)

    @property
    def num_held(self) -> int:
        return len(self.slot_of)

    def must_steal(self, block_id: int, reuse: int | None = None) -> bool:
        """Whether `take(block_id, ..., reuse)` would need another block's snapshot slot."""
        return block_id not in self.slot_of and reuse not in self.slot_of and not self._free

    def victim(self, idle_blocks: Iterable[int]) -> int | None:
        """The idle block whose snapshot a new one takes when every slot is held (the module
        docstring, "full"): the least recently released with a prompt's snapshot, else the
        least recently released with a decode snapshot; None: no idle block has one."""
        oldest_decode = None
        for block_id in idle_blocks:
            if block_id in self.slot_of:
                if block_id not in self.decode_blocks:
                    return block_id
                if oldest_decode is None:
                    oldest_decode = block_id
        return oldest_decode

    def take(self, block_id: int, idle_blocks: Iterable[int], reuse: int | None = None) -> int | None:
        """A slot for a new snapshot of `block_id`'s end: the slot of block `reuse`'s
        snapshot (a row's decode snapshot moving on), else a free one, else the snapshot of
        `victim(idle_blocks)`; None: none (or `block_id` has one already)."""
        if block_id in self.slot_of:
            return None
        if reuse in self.slot_of:
            self._detach(reuse)
            self.num_dropped += 1
        elif not self._free:
            victim = self.victim(idle_blocks)
            if victim is None:
                return None
            self._detach(victim)
            self.num_dropped += 1
        slot = self.slot_of[block_id] = self._free.pop()
        self.num_taken += 1
        return slot

    def block_evicted(self, block_id: int) -> None:
        """The prefix cache forgot `block_id`: its snapshot goes with it."""
        if block_id in self.slot_of:
            self._detach(block_id)

    def _detach(self, block_id: int) -> None:
        """Frees `block_id`'s snapshot slot; a row whose decode snapshot it was takes its next one afresh."""
        self._free.append(self.slot_of.pop(block_id))
        self.decode_blocks.discard(block_id)
        for row_id in [r for r, b in self.moving_of.items() if b == block_id]:
            del self.moving_of[row_id]

    def row_released(self, row_id: int) -> None:
        """A row ended: its decode snapshot stays (the chat's next turn hits it), and no longer moves."""
        self.moving_of.pop(row_id, None)

    def forget_slots(self, slots: Iterable[int]) -> None:
        """Drops the snapshots in `slots` (a failed step was to write them)."""
        slots = set(slots)
        for block_id in [b for b, slot in self.slot_of.items() if slot in slots]:
            self._detach(block_id)
            self.num_dropped += 1

    def check(self) -> None:
        """Asserts every slot is either free or attached to one block, never both."""
        held = list(self.slot_of.values())
        assert len(set(held)) == len(held), "a snapshot slot attached to two blocks"
        assert not set(held) & set(self._free), "a snapshot slot both free and held"
        assert len(held) + len(self._free) == self.num_slots, "a snapshot slot leaked"
        assert set(self.moving_of.values()) <= set(self.slot_of), "a row's decode snapshot without a slot"
        assert self.decode_blocks <= set(self.slot_of), "a decode snapshot without a slot"


def _lazy(ids) -> Iterator[int]:
    """`ids()` iterated only if a slot must be stolen (the idle list can be long; a moving
    decode snapshot never needs it)."""
    yield from ids()


class RecurrentGroup:
    """The recurrent layers' group as the block tables drive it (`ferrox_jax/block_tables.py`):
    the rows' running slots (`states`) and, with the prefix cache, the snapshots."""

    def __init__(self, states: StatePool, cache, block_size: int, num_snapshots: int | None = None,
                 interval_blocks: int = DEFAULT_INTERVAL_BLOCKS, tier: HostTier | None = None) -> None:
        """`cache`: the prefix cache (`ferrox_jax/prefix_cache.py`), None when off;
        `num_snapshots`: the snapshot slots after the running ones (None: two per row);
        `interval_blocks`: a prompt's snapshots every that many blocks (0: only at B);
        `tier`: the host KV tier, whose snapshot slots take the snapshots the device drops."""
        self.states = states
        self.cache = cache
        self.block_size = block_size
        self.interval_blocks = interval_blocks
        count = SNAPSHOTS_PER_ROW * (states.num_slots - 1) if num_snapshots is None else num_snapshots
        self.snapshots = (StateSnapshots(states.num_slots, count)
                          if states.enabled and cache is not None and count else None)
        self.tier = tier if self.snapshots is not None and tier is not None and tier.num_snapshot_slots else None

    def usable_hits(self, hits: Sequence[int], names: Sequence[bytes] = (), num_host: int = 0) -> int:
        """How many blocks of a hit a row can start after: `hits` (device blocks from block
        0), then `num_host` blocks more the host tier holds (`names`: the chain's names).
        All for a model without recurrent layers, else up to the last with a snapshot, on
        the device or in the host tier."""
        total = len(hits) + num_host
        if not self.states.enabled:
            return total
        if self.snapshots is None:
            return 0
        slot_of, tier = self.snapshots.slot_of, self.tier
        for k in range(total, 0, -1):
            if k <= len(hits) and hits[k - 1] in slot_of:
                return k
            if tier is not None and tier.snapshot_slot(names[k - 1]) is not None:
                return k
        return 0

    def host_snapshot(self, hits: Sequence[int], names: Sequence[bytes], num_host: int = 0) -> int | None:
        """The host slot a hit (`hits` device blocks, then `num_host` host ones; `names`: the
        chain's) restores its state from: None when the device holds the snapshot at its
        last block (or no hit)."""
        if not hits and not num_host or self.tier is None or not num_host and hits[-1] in self.snapshots.slot_of:
            return None
        return self.tier.snapshot_slot(names[len(hits) + num_host - 1])

    def restore(self, row, hits: Sequence[int], host_slot: int | None = None) -> None:
        """A row admitted after a hit takes the snapshot at the hit's end into its slot:
        the device's, or host slot `host_slot` of the tier (pinned by the admission)."""
        if hits and self.snapshots is not None:
            if host_slot is not None:
                self.tier.restore_snapshot(host_slot)
                self.states.restore(row.row_id, host_id(host_slot))
            else:
                self.states.restore(row.row_id, self.snapshots.slot_of[hits[-1]])
            self.snapshots.num_restored += 1

    def block_evicted(self, block_id: int, name: bytes | None) -> None:
        """The prefix cache forgot `block_id` (`name`: what it was named, offered to the host
        tier; None: its contents are gone): its snapshot goes to the tier first, then the slot is freed."""
        if self.snapshots is None:
            return
        if name is not None and block_id in self.snapshots.slot_of:
            self._spill(block_id, name)
        self.snapshots.block_evicted(block_id)

    def _spill(self, block_id: int, name: bytes) -> None:
        """The device drops `block_id`'s snapshot: a copy goes to the host tier's, under the
        name of its block, queued with the state copies (after those writing it, before those
        overwriting it)."""
        if self.tier is None:
            return
        host_slot = self.tier.offer_snapshot(name)
        if host_slot is not None:
            self.states.spill(self.snapshots.slot_of[block_id], host_slot)

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The state pool's copies for the step being planned; the host snapshots they read are unpinned."""
        if self.tier is not None:
            self.tier.snapshot_copies_taken()
        return self.states.take_copies()

    def chunk_end(self, job, start: int, end: int) -> int:
        """Where a prompt chunk [start, end) ends: cut at the prompt's next snapshot
        position when that lies inside it, so the state there exists after the step."""
        if self.snapshots is None:
            return end
        at = next_snapshot_position(start, len(job.submitted.prompt_token_ids), self.block_size,
                                    self.interval_blocks)
        return at if start < at < end else end

    def prefilled_to(self, job) -> None:
        """After a prefill step (its blocks named): on one of the prompt's snapshot
        positions the row's state there is saved (next step, before the forward) and
        attached to the cached block ending there; a prefill ending on a later block
        boundary (P a multiple of the block size) starts the row's decode snapshot there."""
        if self.snapshots is None:
            return
        at, prompt = job.num_computed_tokens, job.submitted.prompt_token_ids
        if is_snapshot_position(at, len(prompt), self.block_size, self.interval_blocks):
            self._save(job.block_names, at, job.rows[0].row_id, moving=False)
        elif at and at % self.block_size == 0 and job.is_prefilled:
            self._save(job.block_names, at, job.rows[0].row_id, moving=True)

    def row_named(self, row) -> None:
        """After a row's tokens named its blocks (a decode step, or a preempted row's
        recompute): when its computed tokens end on a block boundary, its decode snapshot
        moves there."""
        at = row.num_computed_tokens
        if self.snapshots is not None and at and at % self.block_size == 0:
            self._save(row.block_names, at, row.row_id, moving=True)

    def row_released(self, row) -> None:
        if self.snapshots is not None:
            self.snapshots.row_released(row.row_id)

    def _save(self, names: Sequence[bytes], at: int, row_id: int, moving: bool) -> None:
        """Saves the row's state (at `at` after the step just applied) as the snapshot of the
        cached block ending at `at`: a prompt's (kept) or the row's decode snapshot (moving)."""
        index = block_index(at, self.block_size)
        blocks = self.cache.lookup(names[index:index + 1]) if 0 <= index < len(names) else []
        if not blocks:
            return
        snapshots = self.snapshots
        previous = snapshots.moving_of.get(row_id) if moving else None
        idle = _lazy(self.cache.idle_block_ids)
        if self.tier is not None and snapshots.must_steal(blocks[0], previous):
            victim = snapshots.victim(idle)  # its snapshot goes to the host before the slot is written
            if victim is None:
                return
            self._spill(victim, self.cache.name_of(victim))
            idle = (victim,)
        slot = snapshots.take(blocks[0], idle, reuse=previous)
        if slot is None:
            return
        self.states.save(row_id, slot)
        if moving:
            snapshots.moving_of[row_id] = blocks[0]
            snapshots.decode_blocks.add(blocks[0])

    def fork(self, job) -> None:
        """n > 1: the state is per row, so the job's other rows copy the prefill row's."""
        if self.states.enabled and len(job.rows) > 1:
            self.states.fork(job.rows[0].row_id, [row.row_id for row in job.rows[1:]])
