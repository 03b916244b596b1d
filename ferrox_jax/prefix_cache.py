"""PrefixCache: full KV blocks named by their content, so requests sharing a prefix share its blocks. No jax here.

A *full* block (all `block_size` positions computed) is named by a hash chain over the
token ids that produced it:

    h_0 = sha256(root || ids of block 0)        root = sha256("ferrox-prefix-cache" || salt)
    h_i = sha256(h_{i-1} || ids of block i)     ids packed as little-endian int32

so a name covers the block's tokens *and every token before it* (K/V at a position depend
on the whole prefix), and the salt covers whatever else changes the K/V: the engine passes
the model, dtype and block size. A job with a LoRA adapter starts its chain from the root
hashed with the adapter's key (`adapter_root`). sha256 rather than Python's `hash()`: a collision would
serve one user's K/V to another prompt, so names must not be forgeable.

The cache is an index, not an owner: `BlockBudget` (`ferrox_jax/block_budget.py`) owns the
block ids and their reference counts. A cached block is in one of two states:

- *held*: some row or prefilling job references it (its ref count is > 0); it cannot go;
- *idle*: nobody references it; it stays resident so a later prompt can hit it, and is
  evictable. Idle blocks are kept in least-recently-released order; a job releases its
  blocks tail first, so a chain's tail is evicted before its head (a head evicted first
  would leave its descendants unreachable).

`lookup(hashes)` returns the blocks of the longest run of cached names at the start of a
prompt. `insert` names a block once its positions are computed; a name already taken
(another job computed the same prefix at the same time) is left with its first block.

A model with a sliding KV group (`ferrox_jax/kv_groups.py`) or recurrent state snapshots
(`ferrox_jax/state_snapshots.py`) hears of each eviction (`on_evict`): the sliding K/V parked
with the block goes with it, and its snapshot (to the host tier first, when there is one).

With a host tier under it (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`), an evicted
block is offered to the tier before its name is forgotten, so the tier copies its K/V to
host memory before the block id is written again.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence

from ferrox_jax.kv_offload import HostTier

_ROOT_TAG = b"ferrox-prefix-cache"


def root_hash(salt: str) -> bytes:
    """The parent of every chain's first block; differs per model, dtype and block size."""
    return hashlib.sha256(_ROOT_TAG + salt.encode("utf-8")).digest()


def adapter_root(root: bytes, adapter_key: str | None) -> bytes:
    """The chain root of a job run with a LoRA adapter (None: the base model's `root`).
    An adapter changes every K/V it computes, so its blocks form chains of their own:
    two adapters, or an adapter and the base model, never share a block."""
    if adapter_key is None:
        return root
    return hashlib.sha256(root + b"lora:" + adapter_key.encode("utf-8")).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes, start_block: int = 0,
                 num_blocks: int | None = None) -> list[bytes]:
    """Names of full blocks `start_block, start_block + 1, ...` of `token_ids`.

    Args:
      token_ids: the sequence from position 0 (prompt, or prompt + generated tokens).
      parent: the name of block `start_block - 1`, or `root_hash(salt)` when start_block is 0.
      num_blocks: how many to name (default: every full block from start_block on).
    Returns:
      one 32-byte name per block, in order.
    """
    end_block = len(token_ids) // block_size
    if num_blocks is not None:
        end_block = min(end_block, start_block + num_blocks)
    names = []
    for i in range(start_block, end_block):
        ids = token_ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}i", *ids)).digest()
        names.append(parent)
    return names


class PrefixCache:
    """Name <-> block id index of cached full blocks, and the idle ones in eviction order."""

    def __init__(self, salt: str = "", tier: HostTier | None = None) -> None:
        self.root = root_hash(salt)
        self.tier = tier  # where evicted blocks go (None: forgotten)
        self._block_by_name: dict[bytes, int] = {}
        self._name_by_block: dict[int, bytes] = {}
        # Idle cached blocks (ref count 0), least recently released first.
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_evicted_blocks = 0
        # Called with each evicted block id and its name (None: its contents are gone, sleep):
        # the sliding KV group's pool and the recurrent state snapshots hear of it.
        self.on_evict = None

    @property
    def num_cached_blocks(self) -> int:
        """Resident cached blocks, held or idle."""
        return len(self._name_by_block)

    @property
    def num_idle_blocks(self) -> int:
        """Cached blocks nobody references: evictable, so they count as free."""
        return len(self._idle)

    def idle_block_ids(self) -> tuple[int, ...]:
        """Idle blocks in eviction order (next to go first)."""
        return tuple(self._idle)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._name_by_block

    def name_of(self, block_id: int) -> bytes:
        """The name of cached block `block_id`."""
        return self._name_by_block[block_id]

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of `names` (a prompt's chain, from block 0) in the cache."""
        blocks = []
        for name in names:
            block_id = self._block_by_name.get(name)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def insert(self, name: bytes, block_id: int) -> bool:
        """Names a computed full block; False when the name (or the block) is already cached."""
        if name in self._block_by_name or block_id in self._name_by_block:
            return False
        self._block_by_name[name] = block_id
        self._name_by_block[block_id] = name
        return True

    # -- driven by BlockBudget as reference counts reach and leave zero -------------------

    def park(self, block_id: int) -> None:
        """A cached block lost its last reference: idle, evicted after those parked before it."""
        assert block_id in self._name_by_block, f"parking block {block_id}, which is not cached"
        assert block_id not in self._idle, f"block {block_id} parked twice"
        self._idle[block_id] = None

    def unpark(self, block_id: int) -> None:
        """An idle cached block is referenced again (a prefix hit): no longer evictable."""
        assert block_id in self._idle, f"block {block_id} is not idle"
        del self._idle[block_id]

    def evict(self, offload: bool = True) -> int:
        """Forgets the least recently released idle block; returns its id (now plain free).
        `offload`: offer it to the host tier first (False: its contents are gone, sleep)."""
        assert self._idle, "no idle cached block to evict"
        block_id, _ = self._idle.popitem(last=False)
        name = self._name_by_block.pop(block_id)
        del self._block_by_name[name]
        if offload and self.tier is not None:
            self.tier.offer(name, block_id)
        self.num_evicted_blocks += 1
        if self.on_evict is not None:
            self.on_evict(block_id, name if offload and self.tier is not None else None)
        return block_id
