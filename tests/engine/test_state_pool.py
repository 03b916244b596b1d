"""The recurrent state pool's host side (ferrox_jax/state_pool.py): slots handed to admitted rows,
named in every RowPlan, and given back at finish, abort and preemption (no device here; the
model side is tests/models/test_family_qwen3_5.py)."""

from __future__ import annotations

import dataclasses

import pytest

from ferrox_jax.admission import check_admission
from ferrox_jax.config import EngineConfig, SchedulerLimits
from ferrox_jax.request import Job
from ferrox_jax.scheduler import Scheduler
from ferrox_jax.state_pool import NULL_SLOT, StatePool, pool_bytes
from models.deltanet import DeltaNetSpec
from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle, tick

MAX_ROWS = 3


def make(*, policy="fcfs", max_rows=MAX_ROWS, num_blocks=64, chunk=8, prefix_caching=False):
    limits = SchedulerLimits(block_size=4, num_blocks=num_blocks, max_rows=max_rows, max_chunk_tokens=chunk,
                             prefix_caching=prefix_caching, scheduling_policy=policy, state_slots=max_rows + 1)
    runner = ScriptedRunner(block_size=4, num_blocks=num_blocks + 1, max_rows=16, max_chunk_tokens=chunk,
                            token_fn=letters_token_fn(), max_chunks=limits.max_chunks)
    return Scheduler(limits, ByteTokenizer()), runner


def job(request_id, prompt_len=9, max_tokens=12, **kw):
    prompt = tuple(100 + (i * 7 + len(request_id) * 3) % 20 for i in range(prompt_len))
    return Job(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, **kw)


def planned_rows(plan):
    return [*plan.decode, *plan.chunks]


def assert_slots_are_distinct_and_real(plan):
    slots = [row.state_slot for row in planned_rows(plan)]
    assert NULL_SLOT not in slots, f"a planned row has the null slot: {slots}"
    assert len(set(slots)) == len(slots), f"two rows of one step share a state slot: {slots}"


def test_pool_hands_out_distinct_slots_never_the_null_slot_and_takes_them_back():
    pool = StatePool(MAX_ROWS + 1)
    pool.acquire([10, 11, 12])
    assert sorted(pool.slot(r) for r in (10, 11, 12)) == [1, 2, 3]  # 4 slots - the null slot 0
    assert pool.num_free == 0 and pool.num_held == 3
    pool.release([11, 99])  # 99 holds nothing: a no-op
    pool.acquire([13])
    assert pool.slot(13) == 2 and pool.num_free == 0, "the freed slot is handed out again"
    with pytest.raises(AssertionError, match="no free state slot"):
        pool.acquire([14])


def test_pool_off_gives_every_row_the_null_slot_and_holds_nothing():
    pool = StatePool(0)
    pool.acquire([1, 2])
    assert pool.slot(1) == NULL_SLOT and pool.num_held == 0


def test_every_planned_row_names_its_own_slot_and_aborts_leave_none_held():
    scheduler, runner = make()
    outputs = {}
    for i in range(5):  # more jobs than rows: some wait, and take freed slots later
        scheduler.add_job(job(f"j{i}", prompt_len=5 + 4 * i, max_tokens=10))
    for _ in range(4):
        assert_slots_are_distinct_and_real(tick(scheduler, runner, outputs))
    assert scheduler.states.num_held == MAX_ROWS, "every admitted row holds a slot"
    scheduler.cancel("j0")  # decoding by now
    scheduler.cancel("j2")  # still prefilling (its prompt is 13 tokens, chunks of 8)
    scheduler.cancel("j4")  # still waiting: it never held a slot
    while scheduler.has_work:
        assert_slots_are_distinct_and_real(tick(scheduler, runner, outputs))
    assert scheduler.aborted == 3
    assert scheduler.states.num_held == 0 and scheduler.states.num_free == MAX_ROWS, "a slot leaked"
    assert {outputs["j1", 0].finish_reason, outputs["j3", 0].finish_reason} == {"length"}


def test_the_leak_check_catches_a_pool_that_never_frees(monkeypatch):
    # Negative control: rows that never give their slot back exhaust the pool.
    monkeypatch.setattr(StatePool, "release", lambda self, row_ids: None)
    scheduler, runner = make()
    for i in range(MAX_ROWS + 1):
        scheduler.add_job(job(f"j{i}", max_tokens=3))
    with pytest.raises(AssertionError, match="no free state slot"):
        run_until_idle(scheduler, runner)


def test_a_preempted_row_gives_its_slot_back_and_recomputes_from_position_zero():
    scheduler, runner = make(policy="priority", max_rows=2)
    outputs = {}
    scheduler.add_job(job("bg0", 9, 30, priority=5))
    scheduler.add_job(job("bg1", 9, 30, priority=5))
    for _ in range(6):
        tick(scheduler, runner, outputs)
    scheduler.add_job(job("fg", 6, 5, priority=0))
    plan = tick(scheduler, runner, outputs)
    assert scheduler.num_preemptions == 1
    assert scheduler.states.num_held == 2, "the urgent row took the preempted row's slot"
    assert_slots_are_distinct_and_real(plan)
    run_until_idle(scheduler, runner, outputs)
    assert scheduler.states.num_held == 0
    # bg1 (rows 1, 2 were bg0, bg1) recomputes everything from position 0: no prefix cache,
    # so its recurrent state is rebuilt from zeros rather than resumed mid-sequence.
    history = [row for p in runner.plans[7:] for row in p.chunks if row.row_id == 2]
    assert history and history[0].start_pos == 0, "the preempted row recomputes from its start"


def test_n_above_one_is_admitted_for_a_model_with_recurrent_state():
    # Forked rows copy the prefill row's state slot (tests/engine/test_state_snapshots.py).
    limits = SchedulerLimits(block_size=4, num_blocks=64, max_rows=4, max_chunk_tokens=8, state_slots=5)
    assert check_admission(job("n2", n=2), limits) is None


SPEC = DeltaNetSpec(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16, conv_kernel=4)


def test_pool_bytes_are_every_slot_of_every_layer():
    # per slot and layer: conv (4 - 1) x (2*2*16 + 4*16 = 128) + recurrent 4 x 16 x 16, f32
    per_slot = (3 * 128 + 4 * 16 * 16) * 4
    assert pool_bytes((SPEC, SPEC), 5) == 2 * per_slot * 5
    assert pool_bytes((), 5) == 0


def test_memory_bounds_count_the_pool_beside_the_kv_cache():
    from ferrox_jax.memory_bounds import Footprint, MemoryBoundError, Room
    from models.qwen3_5 import Qwen3_5Config

    cfg = Qwen3_5Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=32, max_position_embeddings=512,
                        linear_layers=(True, False, True, False), linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    config = EngineConfig(kv_blocks=64, max_seqs=3, prefill_chunk=32, max_context=256)
    demand = Footprint(cfg, 1024, 4, "cpu").demand(config)
    # max_seqs rows + the null slot, and with prefix caching (the default) two snapshot slots per row
    assert demand.state_bytes == pool_bytes(cfg.recurrent_specs(), 3 + 1 + 2 * 3)
    off = Footprint(cfg, 1024, 4, "cpu").demand(dataclasses.replace(config, prefix_caching=False))
    assert off.state_bytes == pool_bytes(cfg.recurrent_specs(), 3 + 1), "no snapshots without prefix caching"
    five = Footprint(cfg, 1024, 4, "cpu").demand(dataclasses.replace(config, state_snapshots=5))
    assert five.state_bytes == pool_bytes(cfg.recurrent_specs(), 3 + 1 + 5), "--state-snapshots 5"
    assert demand.total == demand.kv_bytes + demand.lora_bytes + demand.step_bytes + demand.state_bytes
    with pytest.raises(MemoryBoundError, match="recurrent state pool"):
        Footprint(cfg, 1024, 4, "cpu").check(config, Room(demand.total - 1, "host memory"))
    # tensor parallelism 2: each device holds half the pool (its value heads and conv channels), as its KV heads
    split = Footprint(cfg, 1024, 4, "cpu", kv_shards=2).demand(config)
    assert split.state_bytes * 2 == demand.state_bytes and split.kv_bytes * 2 == demand.kv_bytes


def test_the_state_snapshots_setting_is_validated_and_read_from_its_variable():
    from api.settings import env_defaults

    with pytest.raises(ValueError, match="EngineConfig.state_snapshots"):
        EngineConfig(model="unused", state_snapshots=-1)
    assert env_defaults({"FERROX_STATE_SNAPSHOTS": "6"})["state_snapshots"] == 6
    from api import cli

    args = cli.build_parser({}).parse_args(["serve", "--state-snapshots", "3", "--model", "unused"])
    assert cli.engine_config(args).state_snapshots == 3, "the flag reaches the engine's config"


def test_the_snapshot_interval_setting_is_validated_and_reaches_the_scheduler():
    from api import cli
    from api.settings import env_defaults
    from ferrox_jax.state_snapshots import DEFAULT_INTERVAL_BLOCKS

    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="EngineConfig.state_snapshot_interval"):
            EngineConfig(model="unused", state_snapshot_interval=bad)
    assert EngineConfig(model="unused", state_snapshot_interval=0).state_snapshot_interval == 0, "0: off"
    assert env_defaults({"FERROX_STATE_SNAPSHOT_INTERVAL": "8"})["state_snapshot_interval"] == 8
    default = cli.engine_config(cli.build_parser({}).parse_args(["serve", "--model", "unused"]))
    assert default.state_snapshot_interval == DEFAULT_INTERVAL_BLOCKS == 32, "the settings row's default is the engine's"
    args = cli.build_parser({}).parse_args(["serve", "--state-snapshot-interval", "4", "--model", "unused"])
    assert cli.engine_config(args).state_snapshot_interval == 4, "the flag reaches the engine's config"
    limits = SchedulerLimits(block_size=4, num_blocks=8, max_rows=2, max_chunk_tokens=8, state_slots=3,
                             state_snapshot_interval=0)
    assert limits.state_snapshot_interval == 0, "0 is a valid limit (no interval snapshots)"
