"""BlockBudget: the KV block ids, their reference counts, and the ledger of what admission promised. No jax here.

Every usable block (ids 1..num_blocks; block 0 is the cache's null block, padded rows write
into it, and it is never handed out) is in exactly one of three states:

- *free*: holds nothing anyone needs; handed out by `allocate`;
- *held*: referenced by rows or prefilling jobs (reference counted: the n rows of a
  request, and requests whose prompts share a cached prefix, reference the same block);
- *idle cached*: named in the prefix cache (`ferrox_jax/prefix_cache.py`) but referenced
  by nobody; kept for a later hit, evicted least recently released first (into the host
  tier, `ferrox_jax/kv_offload.py`, when `--kv-offload-gib` is on).

    free + held + idle cached == num_blocks          (asserted by `check`)

The ledger. Admission promises a job every block it may still have to allocate over its
life (`num_owed_blocks`, summed over admitted jobs), so a job that was admitted can always
grow to its end and allocation never fails mid-step. Idle cached blocks count as free for
admission, and admission evicts as many as the promise needs right then, so afterwards

    len(free ids) >= num_owed_blocks                  (asserted)

and `allocate` only ever pops a free id: eviction happens at admission, never mid-step.
The contract's `kv_blocks_free` is `num_blocks - held - owed` (idle cached blocks count
as free), so an idle server shows every block free, cached or not.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox_jax.prefix_cache import PrefixCache


class BlockBudget:
    """Block ids, reference counts and the admission ledger of `num_blocks` usable blocks."""

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        """Args:
            num_blocks: usable blocks; ids 1..num_blocks are handed out (0 is the null block).
            cache: the prefix cache whose named blocks stay resident when released; None
              frees released blocks at once.
        """
        if num_blocks <= 0:
            raise ValueError(f"BlockBudget.num_blocks must be > 0; got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache
        self.num_owed_blocks = 0  # allocations promised to admitted jobs, not yet made
        # Popped from the end: low ids first, which keeps small tests readable.
        self._free_ids = list(range(num_blocks, 0, -1))
        self._ref_counts: dict[int, int] = {}

    # -- views ------------------------------------------------------------------------

    @property
    def num_held_blocks(self) -> int:
        """Distinct block ids referenced right now (a shared block counts once)."""
        return len(self._ref_counts)

    @property
    def num_idle_cached_blocks(self) -> int:
        return self.cache.num_idle_blocks if self.cache is not None else 0

    @property
    def num_reserved_blocks(self) -> int:
        """Held blocks plus those promised: what admitted jobs have or may still take."""
        return self.num_held_blocks + self.num_owed_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an admission may still promise (the contract's `kv_blocks_free`): free and
        idle cached blocks, minus what admitted jobs are owed."""
        return self.num_blocks - self.num_reserved_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts.get(block_id, 0)

    def is_writable(self, block_id: int) -> bool:
        """True when exactly one reference holds the block and the cache does not name it:
        only then may its holder write into it (otherwise it copies it first)."""
        return self._ref_counts.get(block_id, 0) == 1 and not (
            self.cache is not None and self.cache.is_cached(block_id))

    def free_block_ids(self) -> frozenset[int]:
        return frozenset(self._free_ids)

    def held_block_ids(self) -> frozenset[int]:
        return frozenset(self._ref_counts)

    def ref_counts(self) -> dict[int, int]:
        return dict(self._ref_counts)

    def can_ever_fit(self, num_blocks: int) -> bool:
        """False means "never": more blocks than the whole budget (refused as too_large)."""
        return num_blocks <= self.num_blocks

    # -- admission: the ledger ----------------------------------------------------------

    def try_admit(self, num_new_blocks: int, shared_ids: Sequence[int] = ()) -> bool:
        """Admits a job that will allocate at most `num_new_blocks` and starts with
        references to `shared_ids` (its prefix-cache hit); False means "not now".

        The cost is `num_new_blocks` plus the shared blocks that are idle now (referencing
        them takes them out of the evictable pool); shared blocks another job holds cost
        nothing. On success the references are taken and idle cached blocks are evicted
        until the free ids cover every promise.
        """
        assert num_new_blocks >= 0, f"cannot promise {num_new_blocks} blocks"
        num_idle_shared = sum(1 for block_id in set(shared_ids) if block_id not in self._ref_counts)
        if num_new_blocks + num_idle_shared > self.num_free_blocks:
            return False
        for block_id in shared_ids:
            self.share(block_id)
        self.num_owed_blocks += num_new_blocks
        while len(self._free_ids) < self.num_owed_blocks:
            assert self.cache is not None, "ledger promised more blocks than exist"
            self._free_ids.append(self.cache.evict())
        return True

    def release(self, num_blocks: int) -> None:
        """Takes back promised blocks a job will no longer allocate (it ended, or a row did)."""
        assert 0 <= num_blocks <= self.num_owed_blocks, (
            f"releasing {num_blocks} promised blocks with {self.num_owed_blocks} promised")
        self.num_owed_blocks -= num_blocks

    # -- the pool -----------------------------------------------------------------------

    def allocate(self) -> int:
        """Hands out one free block id with reference count 1, out of an admitted promise."""
        assert self.num_owed_blocks > 0, "a row allocated beyond what admission reserved"
        assert self._free_ids, "free ids short of the promises (admission evicts enough)"
        self.num_owed_blocks -= 1
        block_id = self._free_ids.pop()
        self._ref_counts[block_id] = 1
        return block_id

    def share(self, block_id: int) -> None:
        """Adds a reference: to a held block, or to an idle cached one (a prefix hit)."""
        count = self._ref_counts.get(block_id, 0)
        if count == 0:
            assert self.cache is not None and self.cache.is_cached(block_id), (
                f"sharing block {block_id}, which is neither held nor cached")
            self.cache.unpark(block_id)
        self._ref_counts[block_id] = count + 1

    def free(self, block_id: int) -> None:
        """Drops one reference; at the last one the block goes idle if cached, else free."""
        count = self._ref_counts.get(block_id, 0)
        assert count > 0, f"freeing block {block_id}, which is not held"
        if count > 1:
            self._ref_counts[block_id] = count - 1
            return
        del self._ref_counts[block_id]
        if self.cache is not None and self.cache.is_cached(block_id):
            self.cache.park(block_id)
        else:
            self._free_ids.append(block_id)

    def name(self, block_id: int, block_name: bytes) -> bool:
        """Enters a held, computed full block in the prefix cache; False if not entered
        (no cache, or the name is already cached with another block)."""
        assert block_id in self._ref_counts, f"naming block {block_id}, which is not held"
        return self.cache is not None and self.cache.insert(block_name, block_id)

    def forget_cached_blocks(self) -> int:
        """Evicts every idle cached block into the free list (the KV cache's contents are
        gone: sleep), and empties the host tier under the cache; returns how many device
        blocks. Held blocks stay (an idle engine holds none)."""
        num = 0
        while self.cache is not None and self.cache.num_idle_blocks:
            self._free_ids.append(self.cache.evict(offload=False))
            num += 1
        if self.cache is not None and self.cache.tier is not None:
            self.cache.tier.clear()
        return num

    def check(self) -> None:
        """Asserts the state invariants (tests call it after every step)."""
        free = set(self._free_ids)
        held = set(self._ref_counts)
        idle = set(self.cache.idle_block_ids()) if self.cache is not None else set()
        assert len(free) == len(self._free_ids), "a block id is in the free list twice"
        assert not (free & held) and not (free & idle) and not (held & idle), (
            "a block is in two states at once (free, held, idle cached)")
        assert len(free) + len(held) + len(idle) == self.num_blocks, (
            f"free {len(free)} + held {len(held)} + idle {len(idle)} != {self.num_blocks} blocks")
        assert free | held | idle == set(range(1, self.num_blocks + 1)), "block 0 or an unknown id in use"
        assert all(count > 0 for count in self._ref_counts.values()), "a held block with no reference"
        assert len(self._free_ids) >= self.num_owed_blocks, "promises exceed the free ids"
