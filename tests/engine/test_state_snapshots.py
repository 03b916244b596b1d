"""Recurrent state snapshots for prefix hits, and n > 1 forks, on the host side
(ferrox_jax/state_snapshots.py, ferrox_jax/state_pool.py): where a prompt's chunking is cut
(its last full block, and every interval), a row's decode snapshot moving with it, which slot
copies each step carries, what a hit restores, eviction and stealing, a failed step. No device
here: a `StateOracle` replays each plan's copies and rows over slots holding the tokens a
state has seen, so a snapshot at the wrong boundary fails here as it would on the model; the
engine-level parity (a hit == cold) is tests/models/test_state_prefix_qwen3_5.py.

Block size 4, chunks of 8, 3 rows: running slots 1..3, snapshot slots 4..9 (two per row,
`pool_slots`). The default interval (32 blocks, 128 tokens here) lies past every prompt
below unless a test sets one.
"""

from __future__ import annotations

import pytest

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.prefix_cache import chain_hashes
from ferrox_jax.request import Job
from ferrox_jax.scheduler import Scheduler
from ferrox_jax.state_snapshots import (StateSnapshots, is_snapshot_position, next_snapshot_position,
                                       snapshot_position)
from ferrox_jax.speculative import NgramProposer
from ferrox_jax.step_output import run_plan
from tests.support.scripted import ByteTokenizer, ScriptedRunner, collect, letters_token_fn, run_until_idle, tick

BS, CHUNK, ROWS = 4, 8, 3


def make(*, max_rows=ROWS, num_blocks=64, **limits):
    limits = SchedulerLimits(block_size=BS, num_blocks=num_blocks, max_rows=max_rows, max_chunk_tokens=CHUNK,
                             prefix_caching=True, state_slots=max_rows + 1, **limits)
    runner = ScriptedRunner(block_size=BS, num_blocks=num_blocks + 1, max_rows=16, max_chunk_tokens=CHUNK,
                            token_fn=letters_token_fn(), max_chunks=limits.max_chunks)
    return Scheduler(limits, ByteTokenizer()), runner


def prompt(seed, length):
    return tuple(100 + (i * 7 + seed * 13) % 97 for i in range(length))


def job(request_id, tokens, max_tokens=4, **kw):
    return Job(request_id=request_id, prompt_token_ids=tuple(tokens), max_tokens=max_tokens, **kw)


def cached_blocks(scheduler, tokens, num_blocks):
    """The cached blocks of the chain of `tokens` (prompt + output), its first `num_blocks`."""
    cache = scheduler.blocks.cache
    return cache.lookup(chain_hashes(tokens, BS, cache.root)[:num_blocks])


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
    scheduler, runner = make(max_rows=1)  # two snapshot slots (2, 3)
    outputs = {}
    for i, name in enumerate("ab"):
        scheduler.add_job(job(name, prompt(10 + i, 10)))
        run_until_idle(scheduler, runner, outputs)
    snapshots = scheduler.blocks.snapshots
    # each job takes 2: its prompt's at 8, its row's decode one at 12 (10 + 3 computed tokens = 13).
    # b's two find no free slot and take a's: its prompt's first (a finished row's decode
    # snapshot is given up last: `StateSnapshots.victim`), then its decode snapshot
    assert snapshots.num_taken == 4 and snapshots.num_held == 2 and snapshots.num_dropped == 2
    b_blocks = cached_blocks(scheduler, prompt(11, 10) + tuple(outputs["b", 0].token_ids), 3)
    assert set(snapshots.slot_of) == {b_blocks[1], b_blocks[2]}, "b's snapshots at 8 and 12 hold the slots"
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
    # each prompt's snapshot at 12 and its row's decode snapshot at 16 (14 + 3 computed tokens)
    assert blocks.cache.num_evicted_blocks > 0 and blocks.snapshots.num_taken == 16
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


# -- where snapshots are taken: every interval of a prompt, and a row's latest block --------------


class StateOracle:
    """The recurrent state as the tokens it has seen: each plan's slot copies applied in order,
    then every planned row must find in its slot exactly its tokens before its start (a row
    starting at 0 starts fresh), and leaves them through its chunk's end. A snapshot saved at
    one boundary and attached to another, or a hit restoring the wrong one, fails here."""

    def __init__(self, scheduler):
        self.scheduler, self.slots, self.num_checked = scheduler, {}, 0

    def step(self, plan):
        for src, dst in plan.state_copies:
            self.slots[dst] = self.slots.get(src)
        for step in plan.chunks + plan.decode:
            row = self.scheduler._rows[step.row_id]
            seen = () if step.start_pos == 0 else self.slots.get(step.state_slot)
            expected = tuple(row.token_ids[:step.start_pos])
            assert seen == expected, (f"row {step.row_id} starts at {step.start_pos} from a state that has seen "
                                      f"{None if seen is None else len(seen)} tokens, not its own")
            self.slots[step.state_slot] = seen + tuple(step.token_ids)
            self.num_checked += step.start_pos > 0


def run_checked(scheduler, runner, oracle, outputs=None):
    """`run_until_idle` with every plan replayed by the oracle before it runs."""
    outputs = {} if outputs is None else outputs
    while scheduler.has_work:
        plan = scheduler.schedule()
        if plan.draft_requests:  # prompt lookup's drafts, as `tick` proposes them
            plan = scheduler.add_drafts(plan, NgramProposer(scheduler.limits.speculative).propose(plan))
        if not plan.is_empty:
            oracle.step(plan)
            runner.plans.append(plan)
            scheduler.update(plan, run_plan(runner, plan))
        collect(outputs, scheduler.take_events())
    return outputs


def chunks_of(runner, row_id):
    return [(c.start_pos, len(c.token_ids)) for p in runner.plans for c in p.chunks if c.row_id == row_id]


def test_snapshot_positions_are_every_interval_up_to_the_last_full_block():
    # 30 tokens, blocks of 4: B = 28; an interval of 3 blocks adds 12 and 24
    assert [p for p in range(31) if is_snapshot_position(p, 30, 4, 3)] == [12, 24, 28]
    assert [p for p in range(31) if is_snapshot_position(p, 30, 4, 0)] == [28], "0: B only"
    assert [next_snapshot_position(s, 30, 4, 3) for s in (0, 12, 13, 24, 28)] == [12, 24, 24, 28, 0]
    assert [p for p in range(13) if is_snapshot_position(p, 13, 4, 3)] == [12], "an interval boundary that is B"


def test_the_chunking_ends_on_every_interval_boundary_and_b_and_each_is_saved():
    scheduler, runner = make(state_snapshot_interval=3)
    oracle = StateOracle(scheduler)
    scheduler.add_job(job("a", prompt(70, 30), max_tokens=1))
    run_checked(scheduler, runner, oracle)
    # chunks of 8 cut at 12, 24 and 28: [0, 8) [8, 12) [12, 20) [20, 24) [24, 28) [28, 30)
    assert chunks_of(runner, 1) == [(0, 8), (8, 4), (12, 8), (20, 4), (24, 4), (28, 2)]
    blocks = cached_blocks(scheduler, prompt(70, 30), 7)
    assert set(scheduler.blocks.snapshots.slot_of) == {blocks[2], blocks[5], blocks[6]}, "at 12, 24 and 28"
    scheduler.blocks.snapshots.check()


def shared_system_prompt(interval, before=lambda scheduler: None):
    """a = S + 9 tokens, then b = S + 7 other tokens, S a 16-token system prompt (4 blocks):
    b's hit (the oracle checking every state) and the scheduler."""
    scheduler, runner = make(state_snapshot_interval=interval)
    oracle = StateOracle(scheduler)
    system = prompt(80, 16)
    scheduler.add_job(job("a", system + prompt(81, 9)))  # B = 24; with an interval of 3, 12 too
    run_checked(scheduler, runner, oracle)
    before(scheduler)
    scheduler.add_job(job("b", system + prompt(82, 7)))
    run_checked(scheduler, runner, oracle)
    return chunks_of(runner, 2)[0][0], scheduler, oracle


def test_a_prompt_sharing_only_a_system_prompt_hits_its_last_interval_boundary():
    start, scheduler, oracle = shared_system_prompt(3)
    assert start == 12 and scheduler.blocks.num_hit_tokens == 12, "b starts at S's last interval boundary"
    assert scheduler.blocks.snapshots.num_restored == 1 and oracle.num_checked > 0
    # without the interval a's only prompt snapshot is at 24, past S: b's hit on S's blocks has no state
    start, scheduler, _ = shared_system_prompt(0)
    assert start == 0 and scheduler.blocks.num_hit_tokens == 0


def test_negative_control_a_snapshot_attached_one_block_off_is_caught(monkeypatch):
    from ferrox_jax import state_snapshots

    # the state at 12 attached to the block ending at 8, the state at 16 to the one ending at 12
    monkeypatch.setattr(state_snapshots, "block_index", lambda at, block_size: at // block_size - 2)
    with pytest.raises(AssertionError, match="not its own"):
        shared_system_prompt(1)


def test_a_rows_decode_snapshot_moves_with_it_and_the_next_turn_hits_past_its_reply():
    scheduler, runner = make()
    oracle = StateOracle(scheduler)
    turn1 = prompt(90, 10)
    outputs = {}
    scheduler.add_job(job("t1", turn1, max_tokens=12))
    run_checked(scheduler, runner, oracle, outputs)
    history = turn1 + tuple(outputs["t1", 0].token_ids)  # 22 tokens, 21 computed: full blocks up to 20
    snapshots = scheduler.blocks.snapshots
    blocks = cached_blocks(scheduler, history, 5)
    # the prompt's at B = 8, and one decode snapshot, moved 12 -> 16 -> 20 in one slot
    assert set(snapshots.slot_of) == {blocks[1], blocks[4]}, "the decode snapshot ends at the last full block"
    saves = [dst for p in runner.plans for _, dst in p.state_copies]
    assert saves == [4, 5, 5, 5], "the prompt's snapshot, then the decode snapshot moving in its own slot"
    assert snapshots.num_taken == 4 and snapshots.num_dropped == 2 and snapshots.moving_of == {}
    scheduler.add_job(job("t2", history + prompt(91, 5)))  # 27 tokens: 6 blocks before its last token
    run_checked(scheduler, runner, oracle)
    assert chunks_of(runner, 2)[0][0] == 20, "turn 2 starts at turn 1's last full block, past its prompt (10)"
    assert snapshots.num_restored == 1 and oracle.num_checked > 0
    snapshots.check()
    assert scheduler.states.num_held == 0


def test_negative_control_a_decode_snapshot_that_never_moves_holds_a_slot_per_block(monkeypatch):
    take = StateSnapshots.take
    monkeypatch.setattr(StateSnapshots, "take", lambda self, block_id, idle_blocks, reuse=None:
                        take(self, block_id, idle_blocks))
    scheduler, runner = make()
    scheduler.add_job(job("t1", prompt(90, 10), max_tokens=12))
    run_until_idle(scheduler, runner)
    assert scheduler.blocks.snapshots.num_held == 4, "12, 16 and 20 each kept a slot besides B's"


def test_every_row_of_n_2_keeps_its_own_decode_snapshot_and_releases_its_marker():
    scheduler, runner = make()
    oracle = StateOracle(scheduler)
    scheduler.add_job(job("n2", prompt(95, 9), n=2, max_tokens=8))
    outputs = run_checked(scheduler, runner, oracle)
    snapshots = scheduler.blocks.snapshots
    rows = [prompt(95, 9) + tuple(outputs["n2", i].token_ids) for i in range(2)]
    ends = {cached_blocks(scheduler, tokens, 4)[3] for tokens in rows}  # 16 computed: the block ending at 16
    assert ends <= set(snapshots.slot_of) and snapshots.moving_of == {}
    snapshots.check()


def test_eviction_and_chats_under_a_small_budget_leak_nothing():
    scheduler, runner = make(num_blocks=16, state_snapshot_interval=2)
    oracle = StateOracle(scheduler)
    for i in range(6):
        first = prompt(100 + i, 13)
        outputs = {}
        scheduler.add_job(job(f"c{i}", first, max_tokens=9))
        run_checked(scheduler, runner, oracle, outputs)
        scheduler.add_job(job(f"d{i}", first + tuple(outputs[f"c{i}", 0].token_ids) + prompt(110 + i, 3)))
        run_checked(scheduler, runner, oracle)
    blocks = scheduler.blocks
    snapshots = blocks.snapshots
    assert blocks.cache.num_evicted_blocks > 0 and snapshots.num_restored > 0
    snapshots.check()
    assert all(blocks.cache.is_cached(b) for b in snapshots.slot_of), "a snapshot outlived its block"
    assert snapshots.moving_of == {} and scheduler.states.num_held == 0 and blocks.budget.num_held_blocks == 0


class SpeculativeStateOracle(StateOracle):
    """`StateOracle` with speculation's entries (`models/deltanet.py`, "Speculation"): a slot
    holds a position p and entries, entry j the tokens through position p + j; a row starting
    at s reads entry s - 1 - p; a decode row of 1 + d tokens from s leaves d + 1 entries and
    p = s, a chunk ending at e one entry and p = e - 1; a copy takes the whole slot."""

    def step(self, plan):
        for src, dst in plan.state_copies:
            self.slots[dst] = self.slots.get(src)
        for step in plan.chunks + plan.decode:
            row = self.scheduler._rows[step.row_id]
            seen, entry, num_entries = (), 0, 0
            if step.start_pos:
                pos, entries = self.slots[step.state_slot]
                entry = step.start_pos - 1 - pos
                assert 0 <= entry < len(entries), f"row {step.row_id} reads entry {entry} of {len(entries)}"
                seen, num_entries = entries[entry], len(entries)
            assert seen == tuple(row.token_ids[:step.start_pos]), f"row {step.row_id}'s state is not its own"
            self.entries_read.append((step.row_id, step.start_pos, entry, num_entries))
            if step in plan.decode:
                self.slots[step.state_slot] = (step.start_pos, [seen + tuple(step.token_ids[:j + 1])
                                                                for j in range(len(step.token_ids))])
            else:
                self.slots[step.state_slot] = (step.start_pos + len(step.token_ids) - 1,
                                               [seen + tuple(step.token_ids)])

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.entries_read = []


class OneEntryStateOracle(SpeculativeStateOracle):
    """A pool without speculation's entries: a decode row leaves only the state after its
    last token (what a snapshot passed mid-step would hold without them)."""

    def step(self, plan):
        super().step(plan)
        for step in plan.decode:
            pos, entries = self.slots[step.state_slot]
            self.slots[step.state_slot] = (pos + len(entries) - 1, entries[-1:])


def speculative_chat(oracle_cls):
    """Turn 1 (13 tokens) replies round a cycle prompt lookup drafts, in steps of 4 tokens from
    13 (13-16, 17-20, 21-24: each passes a block boundary before its last token); turn 2 is
    turn 1, its reply and 3 more: (turn 2's start, the entry it read of how many, the plans)."""
    from ferrox_jax.config import SpeculativeConfig
    from tests.support.scripted import script_token_fn

    cycle = tuple(range(200, 210))
    first = cycle + cycle[:3]
    reply = (cycle * 3)[3:17]
    turn2 = first + reply + (150, 151, 152)  # 30 tokens; turn 1 computed 13 + 13 = 26: full blocks up to 24
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    limits = SchedulerLimits(block_size=BS, num_blocks=64, max_rows=ROWS, max_chunk_tokens=CHUNK,
                             prefix_caching=True, state_slots=ROWS + 1, speculative=spec)
    scheduler = Scheduler(limits, ByteTokenizer())
    runner = ScriptedRunner(block_size=BS, num_blocks=65, max_rows=16, max_chunk_tokens=CHUNK,
                            token_fn=script_token_fn({first: reply, turn2: (160, 161)}))
    oracle = oracle_cls(scheduler)
    outputs = {}
    scheduler.add_job(job("t1", first, max_tokens=len(reply)))
    run_checked(scheduler, runner, oracle, outputs)
    assert tuple(outputs["t1", 0].token_ids) == reply
    scheduler.add_job(job("t2", turn2, max_tokens=2))
    run_checked(scheduler, runner, oracle)
    scheduler.blocks.snapshots.check()
    start, entry, num_entries = next(read[1:] for read in oracle.entries_read if read[0] == 2)
    return start, (entry, num_entries), runner.plans


def test_with_speculation_a_decode_snapshot_passed_mid_step_restores_the_entry_after_it():
    start, entry, plans = speculative_chat(SpeculativeStateOracle)
    assert any(r.num_draft_tokens for p in plans for r in p.decode), "turn 1 verified drafts"
    assert start == 24, "turn 2 hits turn 1's decode snapshot at 24"
    # saved after the step over 21..24: entry 24 - 1 - 21 = 2 of its 4, the state after 23
    assert entry == (2, 4), "the boundary was passed mid-step: the restored row reads an entry before the last"


def test_negative_control_without_the_entries_a_snapshot_passed_mid_step_is_caught():
    with pytest.raises(AssertionError, match="not its own|reads entry"):
        speculative_chat(OneEntryStateOracle)
