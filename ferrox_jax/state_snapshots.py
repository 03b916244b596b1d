"""State snapshots: the recurrent state at a cached prompt's last full block, for prefix hits. No jax here.

A model with recurrent (linear-attention) layers cannot take a prefix hit from K/V blocks
alone: its DeltaNet layers need the state after the hit's last token, which no block holds.
So the prefix cache keeps a *snapshot* of that state beside the block (`StateSnapshots`, the
recurrent group's part of `ferrox_jax/block_tables.py`), in the spirit of vLLM's mamba
prefix caching in "align" mode (states cached at block boundaries, chunk ends aligned to
them) and SGLang's `MambaRadixCache` (a match is cut back to the last node holding a state).

    slots      the state pool's device arrays hold, after the null slot and the running
               slots 1..R, S snapshot slots R + 1 .. R + S (`state_pool.pool_slots`: S is
               `--state-snapshots`, or R)
    when       one per cached prompt of P tokens: at B = floor((P - 1) / bs) * bs, the end of
               its last full block before its last token (the longest hit a prompt can take).
               The scheduler cuts the prompt's chunking to end a chunk at B (`snapshot_end`),
               so after that step the row's running slot holds the state at B; the next step
               copies it to a snapshot slot before its forward (`StatePool.save`)
    where      attached to the cached block ending at B (`slot_of[block]`): evicting the
               block frees the snapshot with it (`block_evicted`)
    a hit      admission cuts a hit back to its last block with a snapshot (`usable_hits`;
               none: no hit), and the row's running slot takes a copy of it before the row's
               first chunk (`StatePool.restore`); the row computes on from that block's end
    full       a new snapshot takes a free slot, else the snapshot of the least recently
               released idle cached block (its block stays cached, K/V only, and hits on it
               are cut back), else none is taken

A snapshot whose save was in a step that failed is dropped (`forget_slots`): its contents are
unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ferrox_jax.state_pool import StatePool


def snapshot_position(num_prompt_tokens: int, block_size: int) -> int:
    """B: where a prompt's snapshot is taken (0: the prompt has no full block before its last token)."""
    return (num_prompt_tokens - 1) // block_size * block_size


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
        self.num_taken = 0  # snapshots taken (a counter)
        self.num_restored = 0  # hits that restored one (a counter)
        self.num_dropped = 0  # snapshots freed without their block (stolen for a newer one, or a failed step)

    @property
    def num_held(self) -> int:
        return len(self.slot_of)

    def usable_hits(self, hits: Sequence[int]) -> int:
        """How many of a hit's blocks (`hits`, from block 0) can be used: up to its last
        block with a snapshot, 0 when none has one."""
        for k in range(len(hits), 0, -1):
            if hits[k - 1] in self.slot_of:
                return k
        return 0

    def take(self, block_id: int, idle_blocks: Iterable[int]) -> int | None:
        """A slot for a new snapshot of `block_id`'s end: a free one, or the snapshot of the
        first of `idle_blocks` (least recently released first) that has one; None: none."""
        if block_id in self.slot_of:
            return None
        if not self._free:
            victim = next((b for b in idle_blocks if b in self.slot_of), None)
            if victim is None:
                return None
            self._free.append(self.slot_of.pop(victim))
            self.num_dropped += 1
        slot = self.slot_of[block_id] = self._free.pop()
        self.num_taken += 1
        return slot

    def block_evicted(self, block_id: int) -> None:
        """The prefix cache forgot `block_id`: its snapshot goes with it."""
        slot = self.slot_of.pop(block_id, None)
        if slot is not None:
            self._free.append(slot)

    def forget_slots(self, slots: Iterable[int]) -> None:
        """Drops the snapshots in `slots` (a failed step was to write them)."""
        slots = set(slots)
        for block_id in [b for b, slot in self.slot_of.items() if slot in slots]:
            self._free.append(self.slot_of.pop(block_id))
            self.num_dropped += 1

    def check(self) -> None:
        """Asserts every slot is either free or attached to one block, never both."""
        held = list(self.slot_of.values())
        assert len(set(held)) == len(held), "a snapshot slot attached to two blocks"
        assert not set(held) & set(self._free), "a snapshot slot both free and held"
        assert len(held) + len(self._free) == self.num_slots, "a snapshot slot leaked"


class RecurrentGroup:
    """The recurrent layers' group as the block tables drive it (`ferrox_jax/block_tables.py`):
    the rows' running slots (`states`) and, with the prefix cache, the snapshots."""

    def __init__(self, states: StatePool, cache, block_size: int, num_snapshots: int | None = None) -> None:
        """`cache`: the prefix cache (`ferrox_jax/prefix_cache.py`), None when off;
        `num_snapshots`: the snapshot slots after the running ones (None: one per row)."""
        self.states = states
        self.cache = cache
        self.block_size = block_size
        count = states.num_slots - 1 if num_snapshots is None else num_snapshots
        self.snapshots = (StateSnapshots(states.num_slots, count)
                          if states.enabled and cache is not None and count else None)

    def usable_hits(self, hits: Sequence[int]) -> int:
        """How many hit blocks a row can start after: all for a model without recurrent
        layers, else up to the last with a snapshot."""
        if not self.states.enabled:
            return len(hits)
        return self.snapshots.usable_hits(hits) if self.snapshots is not None else 0

    def restore(self, row, hits: Sequence[int]) -> None:
        """A row admitted after a hit takes the snapshot at the hit's end into its slot."""
        if hits and self.snapshots is not None:
            self.states.restore(row.row_id, self.snapshots.slot_of[hits[-1]])
            self.snapshots.num_restored += 1

    def chunk_end(self, job, start: int, end: int) -> int:
        """Where a prompt chunk [start, end) ends: cut at the prompt's snapshot position when
        that lies inside it, so the state there exists after the step."""
        if self.snapshots is None:
            return end
        at = snapshot_position(len(job.submitted.prompt_token_ids), self.block_size)
        return at if start < at < end else end

    def prefilled_to(self, job) -> None:
        """After a prefill step (its blocks named): at the prompt's snapshot position, the
        row's state there is saved (next step, before the forward) and attached to the
        cached block ending there."""
        at = snapshot_position(len(job.submitted.prompt_token_ids), self.block_size)
        if self.snapshots is None or not at or job.num_computed_tokens != at:
            return
        index = at // self.block_size - 1
        blocks = self.cache.lookup(job.block_names[index:index + 1])
        slot = self.snapshots.take(blocks[0], self.cache.idle_block_ids()) if blocks else None
        if slot is not None:
            self.states.save(job.rows[0].row_id, slot)

    def fork(self, job) -> None:
        """n > 1: the state is per row, so the job's other rows copy the prefill row's."""
        if self.states.enabled and len(job.rows) > 1:
            self.states.fork(job.rows[0].row_id, [row.row_id for row in job.rows[1:]])
