"""Recurrent-state snapshots in the host KV tier, and which snapshot a full pool gives up, on the
host side (ferrox_jax/kv_offload.py "Snapshots", ferrox_jax/state_snapshots.py,
ferrox_jax/prefix_hits.py). No device here: the `StateOracle` of test_state_snapshots.py replays
every plan's state copies, host slots included (a host slot h is the copy id -1 - h), so a hit
restoring the wrong host snapshot, or one block off, fails here as it would on the model; the
engine-level parity (a hit from the host tier == cold) is tests/models/test_state_tier_qwen3_5.py.

Block size 4, chunks of 8, 3 rows: running slots 1..3, snapshot slots 4.. after them.
"""

from __future__ import annotations

import pytest

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.kv_offload import HostTier, host_tier_blocks, host_tier_snapshots
from ferrox_jax.scheduler import Scheduler
from ferrox_jax.state_snapshots import RecurrentGroup, StateSnapshots
from tests.engine.test_state_snapshots import BS, CHUNK, StateOracle, cached_blocks, chunks_of, job, prompt, run_checked
from ferrox_jax.step_output import run_plan
from tests.support.scripted import ByteTokenizer, ScriptedRunner, collect, letters_token_fn


def make(*, max_rows=3, num_blocks=16, tier_blocks=0, tier_snapshots=0, **limits):
    limits = SchedulerLimits(block_size=BS, num_blocks=num_blocks, max_rows=max_rows, max_chunk_tokens=CHUNK,
                             prefix_caching=True, state_slots=max_rows + 1, kv_offload_blocks=tier_blocks,
                             kv_offload_snapshots=tier_snapshots, **limits)
    runner = ScriptedRunner(block_size=BS, num_blocks=num_blocks + 1, max_rows=16, max_chunk_tokens=CHUNK,
                            token_fn=letters_token_fn(), max_chunks=limits.max_chunks, kv_offload_blocks=tier_blocks,
                            kv_offload_snapshots=tier_snapshots)
    return Scheduler(limits, ByteTokenizer()), runner


def chat_then_churn(scheduler, runner, oracle, churn=6):
    """Turn 1 (10 tokens, a 12-token reply: its decode snapshot at 20), then `churn` other
    prompts of 13 tokens that evict its blocks and snapshots from the device; then turn 2
    (turn 1, its reply, 5 more). Returns turn 2's first chunk's start."""
    turn1, outputs = prompt(90, 10), {}
    scheduler.add_job(job("t1", turn1, max_tokens=12))
    run_checked(scheduler, runner, oracle, outputs)
    for i in range(churn):
        scheduler.add_job(job(f"o{i}", prompt(200 + i, 13), max_tokens=4))
        run_checked(scheduler, runner, oracle)
    history = turn1 + tuple(outputs["t1", 0].token_ids)
    assert not cached_blocks(scheduler, history, 5), "turn 1's blocks left the device"
    before = len(runner.plans)
    scheduler.add_job(job("t2", history + prompt(91, 5)))
    run_checked(scheduler, runner, oracle)
    row_id = next(c.row_id for p in runner.plans[before:] for c in p.chunks)
    return chunks_of(runner, row_id)[0][0]


def assert_nothing_leaked(scheduler):
    blocks = scheduler.blocks
    blocks.tier.check()
    blocks.snapshots.check()
    blocks.budget.check()
    assert not +blocks.tier._pins and not +blocks.tier._snapshot_pins, "a host slot is still pinned"
    assert scheduler.states.num_held == 0 and blocks.budget.num_held_blocks == 0
    assert blocks.snapshots.moving_of == {}


def test_a_hit_whose_blocks_and_snapshot_left_the_device_restores_both_from_the_host():
    scheduler, runner = make(tier_blocks=32, tier_snapshots=16)
    oracle = StateOracle(scheduler)
    start = chat_then_churn(scheduler, runner, oracle)
    tier = scheduler.blocks.tier
    assert start == 20, "turn 2 starts at turn 1's decode snapshot, its blocks and state from host memory"
    assert scheduler.blocks.num_host_hit_tokens >= 20 and tier.num_snapshots_restored == 1
    assert tier.num_snapshots_stored >= 2 and oracle.num_checked > 0
    # the copies: a host save (dst < 0) of the snapshot before its slot was written again, and
    # a host restore (src < 0) into turn 2's running slot
    copies = [pair for p in runner.plans for pair in p.state_copies]
    assert any(dst < 0 for _, dst in copies) and any(src < 0 for src, _ in copies)
    assert_nothing_leaked(scheduler)


def test_without_the_tiers_snapshots_the_same_chat_computes_turn_2_from_0():
    scheduler, runner = make(tier_blocks=32, tier_snapshots=0)  # blocks in host memory, no state
    start = chat_then_churn(scheduler, runner, StateOracle(scheduler))
    assert start == 0 and scheduler.blocks.num_hit_tokens == 0, "host blocks without a state are no hit"


def wrong_slot(self, name):
    """The tier's snapshot lookup answering with another snapshot than `name`'s."""
    slot = self._snapshot_by_name.get(name)
    others = [s for s in self._name_by_snapshot if s != slot]
    return None if slot is None else (others[-1] if others else slot)


def test_negative_control_restoring_another_host_snapshot_is_caught(monkeypatch):
    monkeypatch.setattr(HostTier, "snapshot_slot", wrong_slot)
    scheduler, runner = make(tier_blocks=32, tier_snapshots=16)
    with pytest.raises(AssertionError, match="not its own"):
        chat_then_churn(scheduler, runner, StateOracle(scheduler))


def shared_prefix_then_churn(scheduler, runner, oracle, churn=6):
    """a (17 tokens: with an interval of 1 block, snapshots at 4, 8, 12 and 16), `churn` other
    prompts that push it out of the device, then b = a's first 16 tokens and 5 others.
    Returns b's first chunk's start."""
    a = prompt(70, 17)
    scheduler.add_job(job("a", a, max_tokens=1))
    run_checked(scheduler, runner, oracle)
    for i in range(churn):
        scheduler.add_job(job(f"o{i}", prompt(200 + i, 13), max_tokens=4))
        run_checked(scheduler, runner, oracle)
    assert not cached_blocks(scheduler, a, 4), "a's blocks left the device"
    before = len(runner.plans)
    scheduler.add_job(job("b", a[:16] + prompt(71, 5)))
    run_checked(scheduler, runner, oracle)
    return next(c.start_pos for p in runner.plans[before:] for c in p.chunks)


def test_negative_control_a_host_snapshot_one_block_off_is_caught(monkeypatch):
    # the hit's restore reads the host snapshot of the block before its last: the state 4
    # tokens short of where the row starts
    host_snapshot = RecurrentGroup.host_snapshot

    def one_block_early(self, hits, names, num_host=0):
        slot = host_snapshot(self, hits, names, num_host)
        end = len(hits) + num_host
        early = self.tier.snapshot_slot(names[end - 2]) if slot is not None and end >= 2 else None
        assert slot is None or early is not None, "the block before has a host snapshot to misplace"
        return early if slot is not None else None

    scheduler, runner = make(tier_blocks=32, tier_snapshots=40, state_snapshot_interval=1)
    assert shared_prefix_then_churn(scheduler, runner, StateOracle(scheduler)) == 16, "a hit from the host"
    assert scheduler.blocks.tier.num_snapshots_restored == 1
    monkeypatch.setattr(RecurrentGroup, "host_snapshot", one_block_early)
    scheduler, runner = make(tier_blocks=32, tier_snapshots=40, state_snapshot_interval=1)
    with pytest.raises(AssertionError, match="not its own"):
        shared_prefix_then_churn(scheduler, runner, StateOracle(scheduler))


def test_eight_chats_under_small_budgets_leak_nothing_and_hit_the_host():
    # 16 device blocks, 24 host blocks and 4 host snapshots: 8 first turns push each other out
    # of both tiers; the second turns, newest chat first, hit the device, the host, or nothing
    scheduler, runner = make(num_blocks=16, tier_blocks=24, tier_snapshots=4, state_snapshot_interval=2)
    oracle, histories = StateOracle(scheduler), {}
    for i in range(8):
        first, outputs = prompt(100 + i, 13), {}
        scheduler.add_job(job(f"c{i}", first, max_tokens=9))
        run_checked(scheduler, runner, oracle, outputs)
        histories[i] = first + tuple(outputs[f"c{i}", 0].token_ids)
    for i in reversed(range(8)):
        scheduler.add_job(job(f"d{i}", histories[i] + prompt(110 + i, 3)))
        run_checked(scheduler, runner, oracle)
    tier = scheduler.blocks.tier
    assert tier.num_snapshots_evicted > 0, "the 4 host snapshot slots turned over"
    assert tier.num_snapshots_restored > 0 and scheduler.blocks.num_host_hit_tokens > 0
    assert tier.num_cached_snapshots <= 4 and oracle.num_checked > 0
    assert_nothing_leaked(scheduler)


def preempted_then_resumed():
    """Priority policy, 2 rows: bg0 and bg1 decode 10 ticks, then an urgent 13-token prompt
    preempts bg1 and its two snapshots take bg1's idle ones (to host memory first); bg1
    resumes from the host's. Returns (scheduler, bg1's chunks, every reply)."""
    scheduler, runner = make(max_rows=2, num_blocks=64, tier_blocks=16, tier_snapshots=8,
                             state_snapshot_interval=0, scheduling_policy="priority")
    oracle, outputs = StateOracle(scheduler), {}
    for name, seed in (("bg0", 1), ("bg1", 2)):
        scheduler.add_job(job(name, prompt(seed, 9), max_tokens=30, priority=1))
    for _ in range(10):
        plan = scheduler.schedule()
        oracle.step(plan)
        runner.plans.append(plan)
        scheduler.update(plan, run_plan(runner, plan))
        collect(outputs, scheduler.take_events())
    scheduler.add_job(job("fg", prompt(3, 13), max_tokens=8, priority=0))
    run_checked(scheduler, runner, oracle, outputs)
    assert scheduler.num_preemptions == 1 and oracle.num_checked > 0
    return scheduler, chunks_of(runner, 2), outputs


def test_a_preempted_row_resumes_from_its_snapshot_in_the_host_tier():
    scheduler, chunks, outputs = preempted_then_resumed()
    tier = scheduler.blocks.tier
    assert tier.num_snapshots_restored == 1 and chunks[-1][0] == 12, "bg1 recomputes from the host's state at 12"
    alone, runner = make(max_rows=2, num_blocks=64, state_snapshot_interval=0)
    alone.add_job(job("bg1", prompt(2, 9), max_tokens=30, priority=1))
    assert run_checked(alone, runner, StateOracle(alone))["bg1", 0].token_ids == outputs["bg1", 0].token_ids
    assert_nothing_leaked(scheduler)


def test_negative_control_a_resumed_row_given_another_host_snapshot_is_caught(monkeypatch):
    monkeypatch.setattr(HostTier, "snapshot_slot", wrong_slot)
    with pytest.raises(AssertionError, match="not its own"):
        preempted_then_resumed()


def test_a_failed_step_forgets_the_host_snapshots_it_was_to_save():
    scheduler, runner = make(tier_blocks=32, tier_snapshots=16)
    tier = scheduler.blocks.tier
    slot = tier.offer_snapshot(b"x" * 32)
    scheduler.blocks.forget_failed_saves((), ((4, -1 - slot), (1, 5)))
    assert tier.snapshot_slot(b"x" * 32) is None and tier.num_cached_snapshots == 0
    tier.check()


def test_the_tier_splits_its_bytes_as_the_device_does_and_refuses_too_little():
    # device: 100 blocks of 1,000 bytes beside 4 snapshots of 25,000: the snapshots take half
    assert host_tier_snapshots(1e-3, 1000, 25000, 100, 4) == int(2 ** 30 * 1e-3 / 2) // 25000
    snapshots = host_tier_snapshots(1e-3, 1000, 25000, 100, 4)
    blocks = host_tier_blocks(1e-3, 1000, snapshot_bytes=snapshots * 25000)
    assert blocks * 1000 + snapshots * 25000 <= 2 ** 30 * 1e-3 < (blocks + 1) * 1000 + snapshots * 25000
    assert host_tier_snapshots(1e-3, 1000, 0, 100, 4) == 0, "no recurrent layers: no snapshots"
    with pytest.raises(ValueError, match="holds no recurrent-state snapshot"):
        host_tier_snapshots(1e-5, 1000, 25000, 100, 4)


def test_limits_asking_for_more_host_snapshots_than_the_runner_has_are_refused():
    from ferrox_jax.runner_protocol import check_limits

    scheduler, runner = make(tier_blocks=8, tier_snapshots=4)
    check_limits(scheduler.limits, runner)
    runner.kv_offload_snapshots = 3
    with pytest.raises(ValueError, match="kv_offload_snapshots"):
        check_limits(scheduler.limits, runner)


# -- which snapshot a full pool gives up: a prompt's before a finished row's decode snapshot ------


def chat_after_other_prompts(max_rows=1):
    """One row, two snapshot slots, interval off. Turn 1 (10 tokens, 12 generated) leaves its
    prompt's snapshot (8) and its decode snapshot (20); another prompt's snapshot then needs a
    slot; turn 2 follows. Returns turn 2's start."""
    scheduler, runner = make(max_rows=max_rows, num_blocks=32, state_snapshot_interval=0)
    oracle, outputs = StateOracle(scheduler), {}
    turn1 = prompt(90, 10)
    scheduler.add_job(job("t1", turn1, max_tokens=12))
    run_checked(scheduler, runner, oracle, outputs)
    scheduler.add_job(job("p", prompt(60, 13), max_tokens=1))  # its snapshot at 12 takes one of turn 1's
    run_checked(scheduler, runner, oracle)
    before = len(runner.plans)
    scheduler.add_job(job("t2", turn1 + tuple(outputs["t1", 0].token_ids) + prompt(91, 5)))
    run_checked(scheduler, runner, oracle)
    scheduler.blocks.snapshots.check()
    return next(c.start_pos for p in runner.plans[before:] for c in p.chunks)


def test_a_full_pool_gives_up_an_old_prompts_snapshot_before_a_chats_decode_snapshot():
    assert chat_after_other_prompts() == 20, "turn 2 still hits its reply's end"


def test_negative_control_first_released_first_taken_loses_the_chats_turn(monkeypatch):
    # the policy before: the least recently released idle snapshot, whatever it is. Turn 1's
    # blocks are released tail first, so its decode snapshot goes before its prompt's
    monkeypatch.setattr(StateSnapshots, "victim",
                        lambda self, idle: next((b for b in idle if b in self.slot_of), None))
    assert chat_after_other_prompts() == 8, "turn 2 falls back to turn 1's prompt snapshot"


# -- the device copy of state slots stops where the padding starts --------------------------------


def test_state_slot_copies_run_in_order_up_to_the_padding():
    import jax.numpy as jnp
    import numpy as np

    from ferrox_jax.kv_cache import copy_state_slots
    from models.deltanet import DeltaNetSpec, create_states

    spec = DeltaNetSpec(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16, conv_kernel=4)
    states = create_states((spec,), 6, entries=2)
    states = states.replace(recurrent=(jnp.arange(states.recurrent[0].size, dtype=jnp.float32).reshape(
        states.recurrent[0].shape),), positions=jnp.arange(6, dtype=jnp.int32) * 10)
    before = np.asarray(states.recurrent[0])

    def copied(src, dst):
        out = copy_state_slots(states, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
        return np.asarray(out.recurrent[0]), np.asarray(out.positions)

    after, positions = copied([1, 3, 0, 0], [3, 4, 0, 0])  # 1 -> 3, then 3 -> 4 reads what 1 -> 3 wrote
    for entry in range(2):  # entry j of slot s is pool row s + 6 j
        assert (after[4 + 6 * entry] == before[1 + 6 * entry]).all() and (after[3 + 6 * entry] == before[1 + 6 * entry]).all()
    assert (after[[0, 1, 2, 5]] == before[[0, 1, 2, 5]]).all() and positions[4] == 10
    after, _ = copied([1, 2, 3, 4], [2, 3, 4, 5])  # no padding: every pair runs, the last reads the chain
    assert (after[5] == before[1]).all()
