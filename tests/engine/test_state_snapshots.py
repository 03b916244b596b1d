"""Recurrent state snapshots for prefix hits, and n > 1 forks, on the host side
(ferrox_jax/state_snapshots.py, ferrox_jax/state_pool.py): where a prompt's chunking is cut,
which slot copies each step carries, what a hit restores, eviction and stealing, a failed
step. No device here; the engine-level parity (a hit == cold) is
tests/models/test_state_prefix_qwen3_5.py.

Block size 4, chunks of 8, 3 rows: running slots 1..3, snapshot slots 4..6 (`pool_slots`).
"""

from __future__ import annotations

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.request import Job
from ferrox_jax.scheduler import Scheduler
from ferrox_jax.state_snapshots import StateSnapshots, snapshot_position
from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle, tick

BS, CHUNK, ROWS = 4, 8, 3


def make(*, max_rows=ROWS, num_blocks=64):
    limits = SchedulerLimits(block_size=BS, num_blocks=num_blocks, max_rows=max_rows, max_chunk_tokens=CHUNK,
                             prefix_caching=True, state_slots=max_rows + 1)
    runner = ScriptedRunner(block_size=BS, num_blocks=num_blocks + 1, max_rows=16, max_chunk_tokens=CHUNK,
                            token_fn=letters_token_fn(), max_chunks=limits.max_chunks)
    return Scheduler(limits, ByteTokenizer()), runner


def prompt(seed, length):
    return tuple(100 + (i * 7 + seed * 13) % 97 for i in range(length))


def job(request_id, tokens, max_tokens=4, **kw):
    return Job(request_id=request_id, prompt_token_ids=tuple(tokens), max_tokens=max_tokens, **kw)


def ticks(scheduler, runner, n):
    outputs = {}
    return [tick(scheduler, runner, outputs) for _ in range(n)]


def test_snapshot_position_is_the_last_full_block_before_the_last_token():
    assert [snapshot_position(p, 4) for p in (1, 4, 5, 8, 9, 14)] == [0, 0, 4, 4, 8, 12]


def test_the_chunking_ends_at_the_snapshot_and_the_next_step_saves_it():
    scheduler, runner = make()
    scheduler.add_job(job("a", prompt(0, 14)))  # B = 12: chunks [0, 8), [8, 12) cut there, [12, 14)
    plans = ticks(scheduler, runner, 3)
    assert [(c.start_pos, len(c.token_ids)) for p in plans for c in p.chunks] == [(0, 8), (8, 4), (12, 2)]
    assert plans[1].state_copies == (), "nothing to save before the step that reaches B"
    # running slot 1 -> the first snapshot slot (4), before the forward of the step after B
    assert plans[2].state_copies == ((1, 4),)
    snapshots = scheduler.blocks.snapshots
    block = scheduler.blocks.cache.lookup(scheduler._jobs["a"].block_names[:3])[2]
    assert snapshots.slot_of == {block: 4}, "the snapshot is attached to the block ending at B"


def test_a_hit_is_restored_into_the_rows_slot_and_starts_at_the_snapshot():
    scheduler, runner = make()
    a = prompt(1, 14)
    scheduler.add_job(job("a", a))
    run_until_idle(scheduler, runner)
    scheduler.add_job(job("b", a[:12] + prompt(2, 5)))  # 17 tokens: blocks 0..2 cached, with a snapshot at 12
    plan = ticks(scheduler, runner, 1)[0]
    assert plan.chunks[0].start_pos == 12, "b starts at the snapshot's block boundary"
    assert plan.state_copies == ((4, plan.chunks[0].state_slot),), "the snapshot goes into b's running slot"
    assert scheduler.blocks.snapshots.num_restored == 1 and scheduler.blocks.num_hit_tokens == 12
    run_until_idle(scheduler, runner)
    assert scheduler.states.num_held == 0


def test_a_hit_longer_than_the_last_snapshot_is_cut_back_to_it():
    scheduler, runner = make()
    a = prompt(3, 14)
    scheduler.add_job(job("a", a))
    run_until_idle(scheduler, runner)
    # c shares a's first 2 blocks: their K/V are cached, but no state at position 8 is
    scheduler.add_job(job("c", a[:8] + prompt(4, 9)))
    plan = ticks(scheduler, runner, 1)[0]
    assert plan.chunks[0].start_pos == 0 and plan.state_copies == (), "no snapshot at 8: the prompt is computed"
    # d extends a past its snapshot: the cached blocks 0..2 hit; the hit ends at the snapshot (12)
    scheduler.add_job(job("d", a + prompt(5, 10)))
    run_until_idle(scheduler, runner)
    d_chunks = [c for p in runner.plans for c in p.chunks if c.row_id == scheduler._next_row_id - 1]
    assert d_chunks[0].start_pos == 12


def test_n_rows_copy_the_prefill_rows_state_at_the_fork():
    scheduler, runner = make()
    scheduler.add_job(job("n2", prompt(6, 10), n=2))
    plans = ticks(scheduler, runner, 3)
    decode = next(p for p in plans if p.decode)
    slots = [r.state_slot for r in decode.decode]
    assert len(set(slots)) == 2
    prefill_slot = plans[0].chunks[0].state_slot
    other = next(s for s in slots if s != prefill_slot)
    assert (prefill_slot, other) in decode.state_copies, "the second row starts from the prefill's state"
    run_until_idle(scheduler, runner)
    assert scheduler.states.num_held == 0


def test_a_full_pool_takes_the_least_recently_released_idle_snapshot():
    scheduler, runner = make(max_rows=1)  # one snapshot slot (2)
    for i, name in enumerate("ab"):
        scheduler.add_job(job(name, prompt(10 + i, 10)))
        run_until_idle(scheduler, runner)
    snapshots = scheduler.blocks.snapshots
    assert snapshots.num_taken == 2 and snapshots.num_held == 1 and snapshots.num_dropped == 1
    snapshots.check()


def run_past_the_budget():
    """8 prompts of 4 blocks (3 full before the last token) into 12 blocks: cached blocks are evicted."""
    scheduler, runner = make(num_blocks=12)
    for i in range(8):
        scheduler.add_job(job(f"j{i}", prompt(20 + i, 14)))
        run_until_idle(scheduler, runner)
    snapshots = scheduler.blocks.snapshots
    # slots freed with their block: taken, neither held now nor stolen for a newer snapshot
    return scheduler, snapshots.num_taken - snapshots.num_held - snapshots.num_dropped


def test_eviction_frees_the_snapshot_with_its_block_and_nothing_leaks():
    scheduler, freed_with_blocks = run_past_the_budget()
    blocks = scheduler.blocks
    assert blocks.cache.num_evicted_blocks > 0 and blocks.snapshots.num_taken == 8
    assert freed_with_blocks > 0, "evicting a block gave its snapshot slot back"
    assert all(blocks.cache.is_cached(b) for b in blocks.snapshots.slot_of), "a snapshot outlived its block"
    blocks.snapshots.check()
    assert scheduler.states.num_held == 0 and blocks.budget.num_held_blocks == 0


def test_negative_control_a_snapshot_kept_after_its_block_went_is_caught(monkeypatch):
    # A snapshot not freed with its block stays attached to the block id (reused for other
    # tokens): slots come back only by stealing, and the count above sees none freed.
    monkeypatch.setattr(StateSnapshots, "block_evicted", lambda self, block_id: None)
    _, freed_with_blocks = run_past_the_budget()
    assert freed_with_blocks == 0


def test_a_failed_step_forgets_the_snapshots_it_was_to_write():
    scheduler, runner = make()
    scheduler.add_job(job("a", prompt(30, 14)))
    ticks(scheduler, runner, 2)
    assert scheduler.blocks.snapshots.num_held == 1
    plan = scheduler.schedule()
    assert plan.state_copies == ((1, 4),)
    scheduler.fail_step(plan, "the device went away")
    assert scheduler.blocks.snapshots.num_held == 0, "its contents are unknown: no hit may restore it"
    scheduler.blocks.snapshots.check()
    assert scheduler.states.num_held == 0


def test_the_snapshot_slot_count_follows_its_limit():
    limits = SchedulerLimits(block_size=BS, num_blocks=64, max_rows=ROWS, max_chunk_tokens=CHUNK,
                             prefix_caching=True, state_slots=ROWS + 1, state_snapshots=5)
    snapshots = Scheduler(limits, ByteTokenizer()).blocks.snapshots
    taken = [snapshots.take(block_id, idle_blocks=()) for block_id in range(1, 7)]
    assert taken[:5] == [4, 5, 6, 7, 8], "5 slots after the running slots 1..3"
    assert taken[5] is None, "full, and no idle block's snapshot to take"


def test_without_snapshot_slots_a_recurrent_model_takes_no_hit():
    limits = SchedulerLimits(block_size=BS, num_blocks=64, max_rows=ROWS, max_chunk_tokens=CHUNK,
                             prefix_caching=True, state_slots=ROWS + 1, state_snapshots=0)
    scheduler, runner = Scheduler(limits, ByteTokenizer()), make()[1]
    assert scheduler.blocks.snapshots is None
    a = prompt(40, 14)
    for name in "ab":  # the same prompt twice: its blocks are cached, but no state is kept for them
        scheduler.add_job(job(name, a))
        run_until_idle(scheduler, runner)
    assert scheduler.blocks.num_cached_blocks >= 3, "a's blocks are in the prefix cache"
    assert scheduler.blocks.num_hit_tokens == 0, "without a snapshot a hit would skip tokens whose state it lacks"
