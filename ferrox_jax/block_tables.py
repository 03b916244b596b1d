"""BlockTables: the block tables of jobs and rows, over the block budget and the prefix cache. No jax here.

The scheduler decides *when* work runs; this module decides *which blocks* it runs in. One
rule holds throughout: a row never writes into a block that another table or the prefix
cache also holds. Before its first write into such a block it copies it into a block of its
own (`StepPlan.block_copies`, run first in the step): copy-on-write.

A job's life, as block tables see it (P prompt tokens, M = max_tokens, n rows, bs = block
size):

1. Admission (`try_admit`). The prompt's full blocks are named (`prefix_cache.chain_hashes`)
   and the first `S = (P - 1) // bs` of them, the blocks wholly before the last prompt
   token, are looked up: the longest run of cached names from block 0, k <= S blocks, is
   shared into the job's table, and prefill starts at `c = k * bs` (`num_cached_tokens`).
   The last prompt token is always computed, so the first sampled token has fresh logits,
   and it never lies in a hit block: a prompt that is cached whole (P a multiple of bs)
   recomputes its last block into a block of its own, as vLLM does, rather than copying
   the cached one (a copy would cost the job one block more than no hit at all, and a job
   needing the whole budget could then never be admitted). Jobs asking for prompt
   logprobs need every position computed and skip the lookup.
   With the host tier (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`) the lookup goes on
   where the device run ends: the next h names the tier holds are host hits. Each takes a
   fresh block at once, out of the job's promise (a host hit costs the block its
   computation would have; the promise is the same as without it), and the step planned
   now restores it first thing (`StepPlan.kv_restores`); prefill starts at
   `c = (k + h) * bs`. Restored blocks are named like computed ones, after the step.
2. Prefill writes positions c.. into new blocks; each full block is named in the cache
   once the step that computed it has run.
3. Fork (`fork`), when the prefill is done: each of the n rows takes a table referencing
   the job's blocks. n > 1 is a prefix hit of each row on the job's prefill: full prompt
   blocks are shared read-only, and the partly filled last block is shared until a row
   writes into it; the first n - 1 rows to do so copy it, the last writes in place.
   (n > 1 jobs prefill P - 1 tokens; each row computes the last prompt token itself.)
4. Decode: rows grow by a block every bs tokens; each block they fill is named too (the
   next turn of a chat resends this turn's prompt and reply).
5. Release: a finished row frees its references; blocks the cache names go idle (kept,
   evictable), the rest free.
6. Preemption (the priority policy, `ferrox_jax/priority.py`): `preempt` releases a running
   job's every table and promise as if it had ended, keeping the names of its full blocks;
   those stay in the cache, idle. Re-admitted, a job whose rows had decoded comes back
   through `try_resume`: each open row looks its own tokens (prompt and output, all but its
   last, which its next decode step computes) up in the cache and promises the rest of its
   lifetime worst case, `per_row - hits` new blocks; it recomputes what was evicted. A job
   preempted while its prompt prefilled comes back through `try_admit`, as it first came.

What admission reserves (`blocks_to_reserve`). Each row's table reaches at most
`per_row = ceil((P + M) / bs)` blocks (the ferrox-server contract's lifetime worst case).
The first S of them are full prompt blocks every row shares; k of those come from the
cache hit and are never written. So a job promises

    new = (S - k) + n * (per_row - S)        # n = 1: per_row - k

new blocks (every row's own tail: its copy or in-place share of the partly filled block,
and the blocks it grows into), and it also holds the k hit blocks; admission charges a hit
block only when it is idle (nobody held it), so a hit never costs more than no hit. A
finished row gives back what it could still have allocated; the job's remainder goes
back when its last row ends.

The sliding-window group (`ferrox_jax/kv_groups.py`, a model with sliding layers): every
block a table allocates gets a slot of the sliding pool; `_prepare` first drops the
table's slots behind the window of the step's first position; copy-on-write copies the
slot too (`window_copies`), fork shares the window's slots, release and preemption drop
them. Admission also reserves the job's window quota (rows times `window_cap`), and cuts a
hit back to the blocks whose window slots are still there.

The recurrent group (a model with linear-attention layers): each row's state slot
(`self.states`, `ferrox_jax/state_pool.py`), and with the prefix cache the state snapshots
attached to cached blocks (`self.snapshots`, `ferrox_jax/state_snapshots.py`): admission
cuts a hit back to its last block with a snapshot and restores it into the row's slot;
naming a block at one of a prompt's snapshot positions takes one, and a row's blocks named
up to a block boundary move its decode snapshot there (`row_named`); fork copies the prefill
row's state to the other rows; eviction frees a block's snapshot with it (to the host tier
first, when there is one). What a hit can use across both tiers: `ferrox_jax/prefix_hits.py`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

from ferrox_jax.block_budget import BlockBudget
from ferrox_jax.config import SchedulerLimits
from ferrox_jax.images import hash_ids
from ferrox_jax.kv_groups import WindowPool, first_window_block, window_cap
from ferrox_jax.kv_offload import HostTier
from ferrox_jax.prefix_cache import PrefixCache, adapter_root, chain_hashes
from ferrox_jax.prefix_hits import Hit, find_hit, unpin, usable_device_hits
from ferrox_jax.request import JobState, Row
from ferrox_jax.state_pool import StatePool
from ferrox_jax.state_snapshots import RecurrentGroup


def blocks_to_reserve(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int,
                      num_cached_tokens: int = 0) -> int:
    """New blocks a job promises at admission (see the module docstring); `num_cached_tokens`
    is what its prefix-cache hit supplies (whole blocks), 0 for the worst case."""
    per_row = max(1, math.ceil((num_prompt_tokens + max_tokens) / block_size))
    shared = (num_prompt_tokens - 1) // block_size
    return shared - num_cached_tokens // block_size + n * (per_row - shared)


class BlockTables:
    """Tables of the scheduler's jobs and rows; see the module docstring. Owner thread only."""

    def __init__(self, limits: SchedulerLimits) -> None:
        self.block_size = limits.block_size
        self.tier = (HostTier(limits.kv_offload_blocks, limits.kv_offload_snapshots)
                     if limits.kv_offload_blocks and limits.prefix_caching else None)
        self.cache = PrefixCache(limits.prefix_cache_salt, self.tier) if limits.prefix_caching else None
        self.budget = BlockBudget(limits.num_blocks, self.cache)
        # The sliding KV group's pool (ferrox_jax/kv_groups.py), None without sliding layers:
        # the sliding arrays' own slots (`kv_window_slots`), else (those arrays hold every
        # block) accounting sized to refuse nothing the full group admits and to evict no
        # parked slot whose full block is still cached: every held or cached block may carry one.
        self.window: WindowPool | None = None
        self._quotas: dict[JobState, int] = {}  # the sliding group's reservation per admitted job
        if limits.kv_window:
            spec = limits.speculative
            self.step_tokens = max(limits.idle_chunk_tokens, 1 + (spec.most_drafts if spec is not None else 0))
            cap = window_cap(limits.kv_window, self.block_size, self.step_tokens, limits.num_blocks)
            self.window = WindowPool(limits.kv_window_slots or max(limits.num_blocks, limits.max_rows * cap),
                                     limits.kv_window, self.block_size)
        # Recurrent state slots by row (none for most models), snapshots with the prefix cache.
        self.recurrent = RecurrentGroup(StatePool(limits.state_slots), self.cache, self.block_size,
                                        limits.state_snapshots, limits.state_snapshot_interval, self.tier)
        self.states, self.snapshots = self.recurrent.states, self.recurrent.snapshots
        if self.cache is not None and (self.window is not None or self.snapshots is not None):
            self.cache.on_evict = self._block_evicted
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens admission took from the cache (not computed), both tiers
        self.num_host_hit_tokens = 0  # of those, tokens restored from the host tier
        self.snapshot_bytes = limits.kv_offload_snapshot_bytes  # host bytes of one of the tier's snapshots
        self._copies: list[tuple[int, int]] = []
        self.window_copies: list[tuple[int, int]] = []  # the sliding slots copy-on-write copies
        self._restoring: list[JobState] = []  # jobs admitted with host hits since the last plan

    @property
    def num_cached_blocks(self) -> int:
        """Blocks resident in the prefix cache (held or idle)."""
        return self.cache.num_cached_blocks if self.cache is not None else 0

    # -- admission ----------------------------------------------------------------------

    def try_admit(self, job: JobState) -> bool:
        """Looks the prompt up, promises the job its blocks; False means "not now"."""
        submitted = job.submitted
        prompt = submitted.prompt_token_ids
        if self.cache is not None and not job.block_names:
            job.block_names = chain_hashes(hash_ids(prompt, submitted.images), self.block_size,
                                           adapter_root(self.cache.root, submitted.adapter_key))
        hit = Hit()
        if self.cache is not None and not submitted.computes_every_position:
            hit = find_hit(self.cache, self.tier, self.window, self.recurrent,
                           job.block_names[:(len(prompt) - 1) // self.block_size])
        hits, host_slots = hit.blocks, hit.host_slots
        num_new = blocks_to_reserve(len(prompt), submitted.max_tokens, submitted.n, self.block_size,
                                    len(hits) * self.block_size)
        if not self._reserve_window(job, submitted.n) or not self.budget.try_admit(num_new, hits):
            self._unreserve_window(job)
            if self.tier is not None:
                unpin(self.tier, hit)
            return False
        job.num_owed_blocks = num_new
        job.prefill_block_ids = hits
        if self.window is not None:
            self.window.open(job, hits, first_window_block(len(hits) * self.block_size, self.window.window,
                                                           self.block_size))
        for slot in host_slots:  # a fresh block each, restored before the step's forward
            block_id = self._allocate(job, job)
            self.tier.restore(slot, block_id)
            job.prefill_block_ids.append(block_id)
        self.recurrent.restore(job.rows[0], job.prefill_block_ids, hit.snapshot)
        if host_slots:
            self._restoring.append(job)
        num_cached = len(job.prefill_block_ids) * self.block_size
        job.num_named_blocks = len(hits)
        job.num_cached_tokens = job.num_computed_tokens = num_cached
        if self.cache is not None and not submitted.computes_every_position:
            self.num_queried_tokens += len(prompt)
            self.num_hit_tokens += num_cached
            self.num_host_hit_tokens += len(host_slots) * self.block_size
        return True

    def preempt(self, job: JobState, rows: Iterable[Row]) -> None:
        """Frees every block the job's tables (its prefill's and its open `rows`') hold and
        what it was still owed; its rows will recompute from position 0 (step 6 above)."""
        for row in rows:
            self._close_window(row, row.block_ids)
            for block_id in reversed(row.block_ids):  # tail first: evicted before the head
                self.budget.free(block_id)
            row.block_ids, row.num_computed_tokens, row.num_named_blocks = [], 0, 0
        self._close_window(job, job.prefill_block_ids)
        for block_id in reversed(job.prefill_block_ids):
            self.budget.free(block_id)
        job.prefill_block_ids, job.num_computed_tokens, job.num_named_blocks = [], 0, 0
        self.budget.release(job.num_owed_blocks)
        job.num_owed_blocks = 0
        self._unreserve_window(job)

    def try_resume(self, job: JobState, rows: list[Row]) -> bool:
        """Re-admits a preempted job whose rows had decoded: each of its open `rows` takes
        its cached blocks of `token_ids[:-1]` and is promised the rest; False: "not now"."""
        hits_by_row = self._resume_hits(job, rows)
        num_new = sum(self._per_row(job) - len(hits) for hits in hits_by_row)
        # host snapshots pinned before the budget evicts (its spills must not take them)
        snapshots = [self.recurrent.host_snapshot(hits, row.block_names) for row, hits in zip(rows, hits_by_row)]
        for slot in filter(lambda slot: slot is not None, snapshots):
            self.tier.pin_snapshot(slot)
        if not self._reserve_window(job, len(rows)) or not self.budget.try_admit(
                num_new, [block_id for hits in hits_by_row for block_id in hits]):
            self._unreserve_window(job)
            for slot in filter(lambda slot: slot is not None, snapshots):
                self.tier.unpin_snapshot(slot)
            return False
        for row, hits, snapshot in zip(rows, hits_by_row, snapshots):
            row.block_ids, row.num_named_blocks, row.num_computed_tokens = list(hits), len(hits), len(hits) * self.block_size
            self.recurrent.restore(row, hits, snapshot)
            if self.window is not None:
                self.window.open(row, row.block_ids, first_window_block(row.num_computed_tokens, self.window.window,
                                                                        self.block_size))
        job.num_owed_blocks = num_new
        return True

    # -- the groups beside the full one: eviction (what a hit can use: prefix_hits.py) -------

    def _block_evicted(self, block_id: int, name: bytes | None) -> None:
        """The prefix cache forgot `block_id` (`name`: its name, for the host tier; None:
        contents gone): its parked window slot and its snapshot go too."""
        if self.window is not None:
            self.window.block_evicted(block_id)
        self.recurrent.block_evicted(block_id, name)

    # -- the sliding group (ferrox_jax/kv_groups.py) ------------------------------------

    def _reserve_window(self, job: JobState, num_rows: int) -> bool:
        """Reserves the job's sliding-group quota (its largest table per row); False: "not now"."""
        if self.window is None:
            return True
        quota = self.window.quota(self._per_row(job), num_rows, self.step_tokens)
        if not self.window.try_reserve(quota):
            return False
        self._quotas[job] = quota
        return True

    def _unreserve_window(self, job: JobState) -> None:
        if self.window is not None:
            self.window.unreserve(self._quotas.pop(job, 0))

    def _close_window(self, owner, block_ids: list[int]) -> None:
        if self.window is not None:
            self.window.close(owner, block_ids)

    def window_tables(self, jobs: Iterable[JobState], rows: Iterable[Row]) -> list[tuple[object, list[int]]]:
        """(owner, block ids) of every live table, for `WindowPool.check`."""
        return [(job, job.prefill_block_ids) for job in jobs] + [(row, row.block_ids) for row in rows]

    def _per_row(self, job: JobState) -> int:
        submitted = job.submitted
        return max(1, math.ceil((len(submitted.prompt_token_ids) + submitted.max_tokens) / self.block_size))

    def _resume_hits(self, job: JobState, rows: list[Row]) -> list[list[int]]:
        """Per row, its cached blocks of the tokens before its last (names computed as needed)."""
        bs, submitted = self.block_size, job.submitted
        hits_by_row = []
        for row in rows:
            num_full = (len(row.token_ids) - 1) // bs  # blocks wholly before its last token
            hits: list[int] = []
            if self.cache is not None and not submitted.computes_every_position:
                names = row.block_names
                if len(names) < num_full:
                    parent = names[-1] if names else adapter_root(self.cache.root, submitted.adapter_key)
                    names += chain_hashes(row.token_ids, bs, parent, start_block=len(names),
                                          num_blocks=num_full - len(names))
                hits = usable_device_hits(self.window, self.recurrent, self.cache.lookup(names[:num_full]), names)
            hits_by_row.append(hits)
        return hits_by_row

    def admission_cost(self, job: JobState, rows: list[Row]) -> int:
        """What admitting `job` now would take from `budget.num_free_blocks`: the new blocks
        it would be promised plus the idle cached blocks its hits would reference (what
        `try_admit` / `try_resume` charge; lookups only, nothing is taken)."""
        submitted, bs = job.submitted, self.block_size
        if job.has_forked:
            hits_by_row = self._resume_hits(job, rows)
            hits = [block_id for row_hits in hits_by_row for block_id in row_hits]
            num_new = sum(self._per_row(job) - len(row_hits) for row_hits in hits_by_row)
        else:
            prompt, hits = submitted.prompt_token_ids, []
            if self.cache is not None and not submitted.computes_every_position:
                names = job.block_names or chain_hashes(prompt, bs, adapter_root(self.cache.root, submitted.adapter_key))
                names = names[:(len(prompt) - 1) // bs]
                hits = usable_device_hits(self.window, self.recurrent, self.cache.lookup(names), names)
            num_new = blocks_to_reserve(len(prompt), submitted.max_tokens, submitted.n, bs, len(hits) * bs)
        return num_new + sum(1 for block_id in set(hits) if not self.budget.ref_count(block_id))

    def num_releasable(self, job: JobState, rows: Iterable[Row]) -> int:
        """Blocks preempting the job would give back to admission: what it is owed, and the
        blocks only its tables hold (those go free or idle; shared ones stay held)."""
        references = self.references([job], rows)
        return job.num_owed_blocks + sum(1 for block_id, count in references.items()
                                         if self.budget.ref_count(block_id) == count)

    def take_offload(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], list[JobState]]:
        """The host tier's copies for the step being planned (saves, restores) and the jobs
        whose restores they are (a failed step fails them too: their blocks are unknown)."""
        if self.tier is None:
            return (), (), []
        jobs, self._restoring = self._restoring, []
        return (*self.tier.take(), jobs)

    def forget_failed_saves(self, saves: Iterable[tuple[int, int]], state_copies: Iterable[tuple[int, int]]) -> None:
        """A step failed: the host slots it was to save, and the snapshots it was to write
        (on the device, or the host's: negative, `state_pool.host_id`), hold nothing known."""
        if self.tier is not None:
            self.tier.forget_slots(slot for _, slot in saves)
            self.tier.forget_snapshots(-1 - dst for _, dst in state_copies if dst < 0)
        if self.snapshots is not None:
            self.snapshots.forget_slots(dst for _, dst in state_copies if dst >= 0)

    # -- planning: make the positions a step writes writable ------------------------------

    def prepare_prefill(self, job: JobState, start: int, end: int) -> None:
        """Makes the job's table cover positions start..end-1, every block writable."""
        self._prepare(job, job, job.prefill_block_ids, start, end)

    def prepare_decode(self, row: Row, num_tokens: int = 1) -> None:
        """Makes the row's table cover its next `num_tokens` positions (more than one: its
        last token and drafts), the first in a block it alone holds; later ones fall in
        blocks it allocated itself."""
        pos = row.num_computed_tokens
        self._prepare(row.job, row, row.block_ids, pos, pos + num_tokens)

    def _prepare(self, job: JobState, owner, block_ids: list[int], start: int, end: int) -> None:
        """`owner`: the table's (the job for its prefill table, else the row), whose sliding
        references to the blocks wholly behind the window of `start` go first."""
        if self.window is not None:
            self.window.advance(owner, block_ids, start)
        index = start // self.block_size
        if index < len(block_ids) and not self.budget.is_writable(block_ids[index]):
            self._copy_on_write(job, owner, block_ids, index)
        while len(block_ids) * self.block_size < end:
            block_ids.append(self._allocate(job, owner))

    def _copy_on_write(self, job: JobState, owner, block_ids: list[int], index: int) -> None:
        """Replaces a shared or cached block by a private copy. The source reference is
        dropped now: it stays held by the others or idle in the cache, and idle blocks are
        only evicted at admission, so it is intact when the copy runs first in this step."""
        src = block_ids[index]
        dst = self._allocate(job, owner)
        self._copies.append((src, dst))
        if self.window is not None:
            self.window_copies.append(self.window.replace(src, dst))
        block_ids[index] = dst
        self.budget.free(src)

    def _allocate(self, job: JobState, owner) -> int:
        """A fresh block for the end of `owner`'s table (and its sliding slot)."""
        assert job.num_owed_blocks > 0, (
            f"job {job.submitted.request_id} allocated beyond the {blocks_to_reserve.__name__}() promise")
        job.num_owed_blocks -= 1
        block_id = self.budget.allocate()
        if self.window is not None:
            self.window.attach(owner, block_id)
        return block_id

    @property
    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        """The copies this step will run first, not yet taken (the draft model proposes
        before the step and must see them)."""
        return tuple(self._copies)

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        copies, self._copies = tuple(self._copies), []
        return copies

    def take_window_copies(self) -> tuple[tuple[int, int], ...]:
        """The sliding pool's slot copies of the copies `take_copies` gave (same step)."""
        copies, self.window_copies = tuple(self.window_copies), []
        return copies

    def window_slots(self, rows) -> tuple[tuple[int, int], ...]:
        """(block, slot) of every block of the planned `rows`' tables that has a slot."""
        if self.window is None:
            return ()
        slot_of = self.window.slot_of
        return tuple({block_id: slot_of[block_id] for row in rows for block_id in row.block_ids
                      if block_id in slot_of}.items())

    # -- after a step: name the blocks it filled ------------------------------------------

    def name_prefill_blocks(self, job: JobState) -> None:
        """Enters the prompt blocks the prefill has completed into the cache."""
        if self.cache is None:
            return
        num_full = min(job.num_computed_tokens // self.block_size, len(job.block_names))
        for i in range(job.num_named_blocks, num_full):
            self._name(job.prefill_block_ids[i], job.block_names[i])
        job.num_named_blocks = max(job.num_named_blocks, num_full)
        self.recurrent.prefilled_to(job)

    def name_row_blocks(self, row: Row) -> None:
        """Enters the row's newly completed blocks (prompt tail and generated tokens)."""
        if self.cache is None:
            return
        num_full = row.num_computed_tokens // self.block_size
        if num_full <= row.num_named_blocks:
            return
        names = row.block_names
        if len(names) < num_full:
            parent = names[-1] if names else adapter_root(self.cache.root, row.job.submitted.adapter_key)
            names += chain_hashes(hash_ids(row.token_ids, row.job.submitted.images), self.block_size, parent,
                                  start_block=len(names),
                                  num_blocks=num_full - len(names))
        for i in range(row.num_named_blocks, num_full):
            self._name(row.block_ids[i], names[i])
        row.num_named_blocks = num_full
        self.recurrent.row_named(row)

    def _name(self, block_id: int, name: bytes) -> None:
        if self.budget.name(block_id, name) and self.window is not None:
            self.window.named(block_id)

    # -- the prefill's blocks become the rows' -------------------------------------------

    def fork(self, job: JobState) -> None:
        """Gives every row a table over the job's blocks (row 0 takes over the job's
        references, the others add their own); see step 3 of the module docstring."""
        blocks, job.prefill_block_ids = job.prefill_block_ids, []
        start = self.window.start(job) if self.window is not None else 0
        for row in job.rows:
            if row.index > 0:
                for block_id in blocks:
                    self.budget.share(block_id)
                if self.window is not None:
                    self.window.open(row, blocks, start)
            elif self.window is not None:
                self.window.move(job, row)
            row.block_ids = list(blocks)
            row.block_names = list(job.block_names)
            row.num_named_blocks = job.num_named_blocks
        self.recurrent.fork(job)

    # -- release ------------------------------------------------------------------------

    def release_row(self, row: Row) -> None:
        """Frees a finished row's blocks; gives back what it could still have allocated
        while other rows of its job run on (the job's remainder goes at its end)."""
        job = row.job
        if row.block_ids and job.num_open_rows > 1:
            unused = self._row_need(row)
            assert unused <= job.num_owed_blocks, f"row {row.row_id} gives back more than its job was promised"
            job.num_owed_blocks -= unused
            self.budget.release(unused)
        self._close_window(row, row.block_ids)
        for block_id in reversed(row.block_ids):  # tail first: evicted before the head
            self.budget.free(block_id)
        row.block_ids = []
        self.recurrent.row_released(row)
        job.num_open_rows -= 1
        if job.num_open_rows == 0:
            self._close_window(job, job.prefill_block_ids)
            for block_id in reversed(job.prefill_block_ids):
                self.budget.free(block_id)
            job.prefill_block_ids = []
            self.budget.release(job.num_owed_blocks)
            job.num_owed_blocks = 0
            self._unreserve_window(job)

    def _row_need(self, row: Row) -> int:
        """Blocks a decoding row could still allocate: its growth up to `per_row`, plus a
        copy of the block it writes next if that one is shared or cached."""
        submitted = row.job.submitted
        per_row = max(1, math.ceil((len(submitted.prompt_token_ids) + submitted.max_tokens) / self.block_size))
        index = row.num_computed_tokens // self.block_size
        must_copy = index < len(row.block_ids) and not self.budget.is_writable(row.block_ids[index])
        return per_row - len(row.block_ids) + must_copy

    # -- measured from the tables ---------------------------------------------------------

    @staticmethod
    def held_block_ids(jobs: Iterable[JobState], rows: Iterable[Row]) -> set[int]:
        """Distinct blocks in prefilling jobs' and rows' tables (cheaper than `references`)."""
        held: set[int] = set()
        for job in jobs:
            held.update(job.prefill_block_ids)
        for row in rows:
            held.update(row.block_ids)
        return held

    @staticmethod
    def references(jobs: Iterable[JobState], rows: Iterable[Row]) -> collections.Counter[int]:
        """Block id -> references, counted from prefilling jobs' and rows' tables. O(blocks)."""
        counts: collections.Counter[int] = collections.Counter()
        for job in jobs:
            counts.update(job.prefill_block_ids)
        for row in rows:
            counts.update(row.block_ids)
        return counts
