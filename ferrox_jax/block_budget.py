"""BlockBudget: the KV block ledger and the pool of block ids behind it. No jax here.

Two things are tracked, and kept apart on purpose:

- the *ledger* (reservations): admission reserves a job's lifetime worst case up front
  (`ceil((prompt + max_tokens) / block_size)` blocks, the ferrox-server contract), so a job
  that was admitted can always grow to its end; `num_free_blocks` = total - reserved;
- the *pool* (held blocks): real block ids handed to rows as they grow, with reference
  counts so the n rows of one request can share its prompt's full blocks.

Block ids are 1..num_blocks; block 0 is the cache's null block (padded rows write into it)
and is never handed out. Held blocks never exceed reserved ones (asserted): a row only
allocates inside its job's reservation.
"""

from __future__ import annotations


class BlockBudget:
    """Reservations and reference-counted block ids for a cache of `num_blocks + 1` blocks."""

    def __init__(self, num_blocks: int) -> None:
        """Args:
            num_blocks: usable blocks; ids 1..num_blocks are handed out (0 is the null block).
        """
        if num_blocks <= 0:
            raise ValueError(f"BlockBudget.num_blocks must be > 0; got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_reserved_blocks = 0
        # Popped from the end: low ids first, which keeps small tests readable.
        self._free_ids = list(range(num_blocks, 0, -1))
        self._ref_counts: dict[int, int] = {}

    # -- the ledger -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not reserved by any admitted job (the contract's `kv_blocks_free`)."""
        return self.num_blocks - self.num_reserved_blocks

    def can_ever_fit(self, num_blocks: int) -> bool:
        """False means "never": more blocks than the whole budget (refused as too_large)."""
        return num_blocks <= self.num_blocks

    def try_reserve(self, num_blocks: int) -> bool:
        """Reserves `num_blocks` if the ledger has room; False means "not now" (keep waiting)."""
        assert num_blocks >= 0, f"cannot reserve {num_blocks} blocks"
        if num_blocks > self.num_free_blocks:
            return False
        self.num_reserved_blocks += num_blocks
        return True

    def unreserve(self, num_blocks: int) -> None:
        assert 0 <= num_blocks <= self.num_reserved_blocks, (
            f"unreserving {num_blocks} blocks with {self.num_reserved_blocks} reserved")
        self.num_reserved_blocks -= num_blocks
        assert self.num_held_blocks <= self.num_reserved_blocks, (
            f"{self.num_held_blocks} blocks held but only {self.num_reserved_blocks} reserved")

    # -- the pool ---------------------------------------------------------------------

    @property
    def num_held_blocks(self) -> int:
        """Distinct block ids currently handed out (a shared block counts once)."""
        return len(self._ref_counts)

    def allocate(self) -> int:
        """Hands out one block id with reference count 1; must stay inside the reservations."""
        assert self._free_ids, "block pool exhausted: a row allocated beyond its reservation"
        block_id = self._free_ids.pop()
        self._ref_counts[block_id] = 1
        assert self.num_held_blocks <= self.num_reserved_blocks, (
            f"{self.num_held_blocks} blocks held but only {self.num_reserved_blocks} reserved")
        return block_id

    def share(self, block_id: int) -> None:
        """Adds a reference to a held block (another row reads the same prompt block)."""
        assert block_id in self._ref_counts, f"sharing block {block_id}, which is not held"
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drops one reference; the id returns to the pool when none is left."""
        count = self._ref_counts.get(block_id, 0)
        assert count > 0, f"freeing block {block_id}, which is not held"
        if count == 1:
            del self._ref_counts[block_id]
            self._free_ids.append(block_id)
        else:
            self._ref_counts[block_id] = count - 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts.get(block_id, 0)
