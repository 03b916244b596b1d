"""The host KV tier under the prefix cache (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`).

Scheduler-level tests run against the scripted runner, whose fake paged cache reads every
token back through the block table (and whose host tier holds copies of its blocks), so a
restore into the wrong block, from the wrong slot, or not at all changes the sampled tokens
or trips its read-back check. The engine tests run the real model on a tiny checkpoint.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from ferrox_jax.config import EngineConfig, SchedulerLimits
from ferrox_jax.engine import Engine
from ferrox_jax.kv_offload import HostTier, host_tier_blocks
from ferrox_jax.memory_bounds import MemoryBoundError
from ferrox_jax.request import Job, RowSampling
from ferrox_jax.runner_protocol import RunnerWrapper, check_limits
from ferrox_jax.scheduler import Scheduler
from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle

BS = 4  # block size of the scheduler-level tests
PROMPT = 13  # tokens per prompt: (13 - 1) // 4 = 3 full blocks are looked up
MAX_TOKENS = 3  # 13 + 3 = 16 positions: ceil(16 / 4) = 4 blocks promised per job
DEVICE_BLOCKS = 16  # 4 jobs at once; 16 prompts x 3 named prompt blocks = 48 blocks of working set (3x the device)
NUM_PROMPTS = 16


def make(*, tier_slots=0, num_blocks=DEVICE_BLOCKS, runner_cls=ScriptedRunner, max_rows=4):
    runner = runner_cls(block_size=BS, num_blocks=num_blocks + 1, max_rows=max_rows, max_chunk_tokens=16,
                        token_fn=letters_token_fn(), kv_offload_blocks=tier_slots)
    limits = SchedulerLimits(block_size=BS, num_blocks=num_blocks, max_rows=max_rows, max_chunk_tokens=16,
                             kv_offload_blocks=tier_slots)
    return Scheduler(limits, ByteTokenizer()), runner


def prompt(i):
    """Prompt i: PROMPT token ids no other prompt shares (not even its first)."""
    return tuple(20 + i * PROMPT + j for j in range(PROMPT))  # byte ids: 20 + 16 * 13 < 256


def replay(scheduler, runner, tag, num=NUM_PROMPTS):
    for i in range(num):
        scheduler.add_job(Job(f"{tag}{i}", prompt(i), MAX_TOKENS, RowSampling(temperature=0.0)))
    outputs = run_until_idle(scheduler, runner)
    return [outputs[(f"{tag}{i}", 0)].token_ids for i in range(num)]


def assert_no_leak(scheduler):
    scheduler.budget.check()
    assert scheduler.budget.num_free_blocks == scheduler.budget.num_blocks, "blocks leaked (kv_blocks_free < total)"
    if scheduler.blocks.tier is not None:
        scheduler.blocks.tier.check()


def test_working_set_beyond_the_device_hits_the_host_tier_on_replay_with_the_same_tokens():
    reference = replay(*make(), "ref")  # no tier: every replay recomputes
    scheduler, runner = make(tier_slots=64)
    first = replay(scheduler, runner, "a")
    blocks = scheduler.blocks
    assert blocks.num_host_hit_tokens == 0, "nothing is shared in the first pass"
    assert blocks.tier.num_stored > 0, "evicted blocks were copied to the host tier"
    second = replay(scheduler, runner, "b")
    assert first == reference and second == reference, "host-tier hits changed the sampled tokens"
    # The device holds the last 4 jobs' blocks at most, so at least 12 of 16 prompts hit the host tier,
    # 3 blocks x 4 tokens each.
    assert blocks.num_host_hit_tokens >= 12 * 3 * BS, blocks.num_host_hit_tokens
    assert blocks.tier.num_restored * BS == blocks.num_host_hit_tokens
    restored = [plan for plan in runner.plans if plan.kv_restores]
    assert restored and all(plan.chunks for plan in restored), "a restore runs in the step of a job's chunk"
    assert_no_leak(scheduler)


class SkippingRunner(ScriptedRunner):
    """Negative control: drops every restore (the device block keeps what it held)."""

    def offload_blocks(self, saves, restores):
        super().offload_blocks(saves, np.zeros((0, 2), np.int32))


class WrongSlotRunner(ScriptedRunner):
    """Negative control: restores from the next slot over."""

    def offload_blocks(self, saves, restores):
        restores = np.asarray(restores).reshape(-1, 2).copy()
        restores[:, 0] = (restores[:, 0] + 1) % self.kv_offload_blocks
        super().offload_blocks(saves, restores)


class RestoresFirstRunner(ScriptedRunner):
    """Negative control: restores before saves (a restore may land in a block a save still has to read)."""

    def offload_blocks(self, saves, restores):
        super().offload_blocks(np.zeros((0, 2), np.int32), restores)
        super().offload_blocks(saves, np.zeros((0, 2), np.int32))


@pytest.mark.parametrize("runner_cls", [SkippingRunner, WrongSlotRunner, RestoresFirstRunner])
def test_a_wrong_restore_changes_the_tokens(runner_cls):
    reference = replay(*make(), "ref")
    scheduler, runner = make(tier_slots=64, runner_cls=runner_cls)
    replay(scheduler, runner, "a")
    try:
        second = replay(scheduler, runner, "b")
    except (AssertionError, KeyError) as failure:  # the read-back check saw a wrong position or an empty slot
        second = repr(failure)
    assert second != reference, "the test cannot tell a broken restore from a right one"


def test_the_tier_never_holds_more_than_its_slots_and_drops_the_least_recently_used():
    scheduler, runner = make(tier_slots=6)
    first = replay(scheduler, runner, "a")
    tier = scheduler.blocks.tier
    assert tier.num_cached_blocks <= 6 and tier.num_evicted > 0, "the LRU bound holds"
    tier.check()
    # The last prompts' blocks are the newest in the tier: replaying the last two hits, and tokens stay right.
    scheduler.add_job(Job("again", prompt(NUM_PROMPTS - 2), MAX_TOKENS, RowSampling(temperature=0.0)))
    out = run_until_idle(scheduler, runner)
    assert out[("again", 0)].token_ids == first[NUM_PROMPTS - 2]
    assert_no_leak(scheduler)


def test_lru_order_and_pins():
    tier = HostTier(2)
    tier.offer(b"a", 1)
    tier.offer(b"b", 2)
    assert tier.lookup([b"a", b"b"]) == [0, 1]
    tier.pin([0])
    tier.restore(0, 7)  # a hit on "a" makes it the most recently used
    tier.offer(b"c", 3)  # drops "b", the least recently used, not the pinned "a"
    assert tier.lookup([b"a"]) == [0] and tier.lookup([b"b"]) == [] and tier.lookup([b"c"]) == [1]
    tier.offer(b"d", 4)  # every slot pinned or just saved: "c"'s slot is free of pins, so "c" goes
    saves, restores = tier.take()
    # Slot 1 was saved twice this step ("b" then "c" then "d"): only its last save runs.
    assert saves == ((1, 0), (4, 1)) and restores == ((0, 7),)
    tier.pin([0, 1])
    tier.offer(b"e", 5)  # every slot pinned: dropped, as without the tier
    assert tier.lookup([b"e"]) == [] and tier.num_cached_blocks == 2
    tier.check()


def test_sleep_empties_the_host_tier():
    scheduler, runner = make(tier_slots=64)
    first = replay(scheduler, runner, "a")
    scheduler.budget.forget_cached_blocks()  # what sleep does
    assert scheduler.blocks.tier.num_cached_blocks == 0 and scheduler.blocks.tier.take() == ((), ())
    again = replay(scheduler, runner, "b")
    assert again == first and scheduler.blocks.num_host_hit_tokens == 0, "a slept engine starts cold"
    assert_no_leak(scheduler)


def test_a_failed_step_forgets_its_saves():
    scheduler, runner = make(tier_slots=64)
    replay(scheduler, runner, "a", num=4)  # fills the device cache
    runner.fail_when = lambda batch: len(batch.kv_saves) > 0
    replay(scheduler, runner, "b", num=8)  # prompts 4..7 evict 0..3: that step fails, and its saves with it
    assert scheduler.num_failed_jobs > 0
    tier = scheduler.blocks.tier
    assert tier.num_cached_blocks < tier.num_stored, "the failed step's saved names were dropped"
    tier.check()
    assert_no_leak(scheduler)


def test_limits_asking_for_more_host_slots_than_the_runner_has_are_refused():
    scheduler, runner = make(tier_slots=8)
    check_limits(scheduler.limits, runner)
    with pytest.raises(ValueError, match="kv_offload_blocks"):
        check_limits(dataclasses.replace(scheduler.limits, kv_offload_blocks=9), runner)


def test_the_setting_is_refused_where_it_cannot_work():
    assert host_tier_blocks(0.0, 1024) == 0
    assert host_tier_blocks(1.0, 1 << 20) == 1024  # 1 GiB of 1 MiB blocks
    for kw, word in [({"num_processes": 2}, "multi-host"), ({"prefix_caching": False}, "prefix caching"),
                     ({"draft": True}, "draft")]:
        with pytest.raises(ValueError, match=word):
            host_tier_blocks(1.0, 1024, **kw)
    with pytest.raises(ValueError, match="holds no KV block"):
        host_tier_blocks(1e-9, 1 << 20)
    assert host_tier_blocks(1.0, 1 << 20, host_room=1 << 30) == 1024  # exactly fits
    with pytest.raises(MemoryBoundError, match="kv_offload_gib 2 needs 2.00 GiB of host memory"):
        host_tier_blocks(2.0, 1 << 20, host_room=1 << 30)
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="kv_offload_gib"):
            EngineConfig(kv_offload_gib=bad)


# -- the real engine ----------------------------------------------------------------------

ENGINE_PROMPTS = 20  # 20 prompts x 4 looked-up blocks = 80 blocks of working set, 3.3x the device's 24
ENGINE_PROMPT_TOKENS = 40  # 5 blocks of 8; (40 - 1) // 8 = 4 looked up
ENGINE_MAX_TOKENS = 4  # ceil(44 / 8) = 6 blocks per job: 4 jobs at once in 24 blocks


class Collector:
    def __init__(self):
        self.tokens, self.done, self.lock = {}, {}, threading.Lock()

    def expect(self, request_id):
        self.tokens[request_id], self.done[request_id] = [], threading.Event()

    def __call__(self, event):
        with self.lock:
            self.tokens[event.request_id] += event.token_ids
            if event.finish_reason is not None:
                self.done[event.request_id].set()


def engine_replay(engine, tag):
    rng = np.random.RandomState(7)
    col = Collector()
    prompts = [tuple(rng.randint(3, 300, ENGINE_PROMPT_TOKENS).tolist()) for _ in range(ENGINE_PROMPTS)]
    for i, p in enumerate(prompts):
        col.expect(f"{tag}{i}")
        engine.submit(Job(f"{tag}{i}", p, ENGINE_MAX_TOKENS, RowSampling(temperature=0.0), ignore_eos=True), col)
    for i in range(len(prompts)):
        assert col.done[f"{tag}{i}"].wait(120), f"{tag}{i} did not finish"
    return [col.tokens[f"{tag}{i}"] for i in range(len(prompts))]


class RestoreSwitch(RunnerWrapper):
    """The negative control's switch: while `skip` is set, the step's restores are dropped."""

    skip = False

    def forward(self, batch):
        if self.skip:
            batch = dataclasses.replace(batch, kv_restores=np.zeros((0, 2), np.int32))
        return self.runner.forward(batch)


def load(tiny_llama, offload_gib, wrap=None):
    engine = Engine.load(EngineConfig(model=str(tiny_llama), block_size=8, kv_blocks=25, max_context=64,
                                      prefill_chunk=32, max_seqs=4, kv_offload_gib=offload_gib), wrap_runner=wrap)
    engine.warmup()
    engine.start()
    return engine


def test_engine_replays_from_the_host_tier_with_greedy_outputs_unchanged(tiny_llama):
    reference_engine = load(tiny_llama, 0.0)
    try:
        reference = engine_replay(reference_engine, "r")
    finally:
        reference_engine.shutdown()
    switches = []
    engine = load(tiny_llama, 0.01, wrap=lambda runner: switches.append(RestoreSwitch(runner)) or switches[0])
    try:
        first = engine_replay(engine, "a")
        second = engine_replay(engine, "b")
        stats = engine.stats()
        assert first == reference and second == reference, "the host tier changed greedy outputs"
        # At most the last 4 jobs' blocks stay on the device: 16 of 20 prompts hit the host tier, 4 blocks of 8 each.
        assert stats.prefix_cache_hits_host >= 16 * 4 * 8, stats
        assert stats.prefix_cache_hits == stats.prefix_cache_hits_device + stats.prefix_cache_hits_host
        assert stats.kv_offload_blocks_restored * 8 == stats.prefix_cache_hits_host
        assert stats.kv_blocks_free == stats.kv_blocks_total, "blocks leaked"
        assert stats.recompiles_after_warmup == 0, "the tier's gather and scatter were compiled at warm-up"

        # Sleep empties the host tier (the snapshot is published by the next tick: the replay's hits tell).
        assert engine.sleep().result(60) == 1 and engine.wake().result(60) is None
        hits_before = stats.prefix_cache_hits_host
        assert engine_replay(engine, "c") == reference
        assert engine.stats().prefix_cache_hits_host == hits_before, "after sleep the replay computes"

        switches[0].skip = True  # negative control: the tier now holds pass c's blocks; skip their restores
        broken = engine_replay(engine, "d")
        assert engine.stats().prefix_cache_hits_host > hits_before, "the control did hit the host tier"
        assert broken != reference, "skipping the restores must change the outputs"
    finally:
        engine.shutdown()
