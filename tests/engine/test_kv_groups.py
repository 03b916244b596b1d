"""The sliding KV group's pool (ferrox_jax/kv_groups.py) driven by the scheduler against the
scripted runner: window 16 tokens, block 8, rows generating past several windows."""

from __future__ import annotations

import dataclasses
import math

import pytest

import ferrox_jax.kv_groups as kv_groups
from ferrox_jax.config import SchedulerLimits, SpeculativeConfig
from ferrox_jax.kv_groups import WindowPool
from ferrox_jax.prefix_cache import chain_hashes
from ferrox_jax.request import Job, RowSampling
from ferrox_jax.scheduler import Scheduler
from ferrox_jax.step_output import run_plan
from tests.support.scripted import ByteTokenizer, ScriptedRunner, collect, letters_token_fn

WINDOW, BS = 16, 8


def make(window=WINDOW, num_blocks=96, max_rows=6, chunk=24, speculative=None):
    limits = SchedulerLimits(block_size=BS, num_blocks=num_blocks, max_rows=max_rows, max_chunk_tokens=chunk,
                             kv_window=window, speculative=speculative)
    rows = speculative.step_rows(max_rows) if speculative is not None else max_rows
    runner = ScriptedRunner(block_size=BS, num_blocks=num_blocks + 1, max_rows=rows, max_chunk_tokens=chunk,
                            max_chunks=limits.max_chunks, token_fn=letters_token_fn())
    return Scheduler(limits, ByteTokenizer()), runner


def job(request_id, prompt_len, max_tokens, **kw):
    prompt = tuple(100 + (i * 7 + len(request_id)) % 23 for i in range(prompt_len))
    return Job(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **kw)


def check_windows(scheduler, plan):
    """Every planned step's queries find the slots of every key they see held (counted
    here, not with the module's own helper), and no table holds more than its cap."""
    pool = scheduler.blocks.window
    for step in plan.rows:
        start, end = step.start_pos, step.start_pos + len(step.token_ids)
        first = max(0, start - WINDOW + 1) // BS
        for block_id in step.block_ids[first:math.ceil(end / BS)]:
            slot = pool.slot_of.get(block_id)
            assert slot is not None and pool._refs.get(slot, 0) > 0, (
                f"row {step.row_id} at {start}: block {block_id} in its window has no held slot")
    tables = scheduler.blocks.window_tables(scheduler._prefilling, scheduler._rows_with_tables())
    pool.check(tables)
    cap = kv_groups.window_cap(WINDOW, BS, scheduler.blocks.step_tokens, 10 ** 6)
    for owner, block_ids in tables:
        assert len(block_ids) - pool.start(owner) <= cap, "a table holds more slots than its window's cap"


def run(scheduler, runner, jobs, max_ticks=2000):
    outputs = {}
    for spec in jobs:
        scheduler.add_job(spec)
    held = []
    for _ in range(max_ticks):
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        if plan.draft_requests:
            from ferrox_jax.speculative import NgramProposer
            plan = scheduler.add_drafts(plan, NgramProposer(scheduler.limits.speculative).propose(plan))
        check_windows(scheduler, plan)
        held.append(scheduler.blocks.window.num_held)
        if not plan.is_empty:
            runner.plans.append(plan)
            scheduler.update(plan, run_plan(runner, plan))
        collect(outputs, scheduler.take_events())
    assert not scheduler.has_work
    return outputs, held


def tokens(outputs):
    return {key: out.token_ids for key, out in outputs.items()}


def assert_no_leaks(scheduler):
    pool = scheduler.blocks.window
    pool.check([])
    assert pool.num_held == 0 and pool.num_reserved == 0, "slots or reservations left after every job ended"
    scheduler.budget.check()
    assert scheduler.budget.num_held_blocks == 0


JOBS = [job("a", 21, 60), job("b", 5, 44), job("c", 40, 30),
        job("n2", 13, 35, n=2, sampling=RowSampling(seed=3))]


def test_rows_past_several_windows_hold_only_their_window_and_leak_nothing():
    scheduler, runner = make()
    outputs, held = run(scheduler, runner, JOBS)
    pool = scheduler.blocks.window
    assert all(len(out.token_ids) == spec.max_tokens for spec in JOBS for key, out in outputs.items()
               if key[0] == spec.request_id)
    assert pool.num_freed_behind > 0, "no reference was dropped behind the window"
    # 5 rows, none above ceil((W - 1 + 24) / 8) + 1 = 6 slots: far below their full tables
    assert max(held) <= 5 * 6 < scheduler.kv_blocks_peak
    assert pool.peak_held == max(held)
    assert_no_leaks(scheduler)


def test_batched_equals_alone_and_no_window_group_changes_nothing():
    batched, _ = run(*make(), JOBS)
    for spec in JOBS:
        alone, _ = run(*make(), [spec])
        plain = make(window=None)
        scheduler, runner = plain
        for s in [spec]:
            scheduler.add_job(s)
        from tests.support.scripted import run_until_idle
        without = run_until_idle(scheduler, runner)
        assert tokens(alone) == {k: v for k, v in tokens(batched).items() if k[0] == spec.request_id}
        assert tokens(alone) == tokens(without)


def test_a_prefix_hit_takes_parked_window_slots_and_equals_cold():
    scheduler, runner = make()
    cold, _ = run(scheduler, runner, [job("p", 45, 20)])
    pool = scheduler.blocks.window
    assert pool.num_parked > 0, "the finished row's cached window blocks should stay parked"
    warm, _ = run(scheduler, runner, [job("p", 45, 20)])
    assert warm[("p", 0)].events[0].num_cached_tokens == 40, "the hit should cover the 5 full prompt blocks"
    assert tokens(warm) == tokens(cold)
    assert_no_leaks(scheduler)


def test_a_hit_whose_window_slots_were_evicted_is_cut_back_and_recomputed():
    scheduler, runner = make()
    spec = job("p", 45, 3)
    cold, _ = run(scheduler, runner, [spec])
    pool, cache = scheduler.blocks.window, scheduler.blocks.cache
    hits = cache.lookup(chain_hashes(spec.prompt_token_ids, BS, cache.root))
    assert len(hits) == 5 and pool.has_slot(hits[4])
    pool.block_evicted(hits[4])  # the last prompt block's parked slot goes: its sliding keys are gone
    assert not pool.has_slot(hits[4])
    warm, _ = run(scheduler, runner, [spec])
    # position 32's window (17..32) needs block 4... so 4 blocks (32 tokens) are the most it may take
    assert warm[("p", 0)].events[0].num_cached_tokens == 32
    assert tokens(warm) == tokens(cold)
    assert_no_leaks(scheduler)


def test_usable_hits_needs_every_window_block_of_the_first_computed_position():
    pool = WindowPool(8, window=WINDOW, block_size=BS)
    for block_id in (11, 12, 13, 14):
        pool.attach("t", block_id)
    pool.close("t", [])  # ownerless now: keep the slots held for the lookup below
    assert pool.usable_hits([11, 12, 13, 14]) == 4
    hits = [10, 11, 12, 13, 14]  # block 10 has no slot, but position 40's window starts in block 3
    assert pool.usable_hits(hits) == 5
    assert pool.usable_hits([11, 10, 13]) == 1, "block 10 lies in the window of position 16 and 24"


def test_speculative_rows_keep_their_window_through_rollback():
    spec = SpeculativeConfig(num_speculative_tokens=3)
    scheduler, runner = make(speculative=spec)
    outputs, _ = run(scheduler, runner, [job("s", 30, 50), job("t", 9, 40)])
    alone, _ = run(*make(), [job("s", 30, 50), job("t", 9, 40)])
    assert tokens(outputs) == tokens(alone)
    assert_no_leaks(scheduler)


def test_negative_control_a_window_off_by_one_block_is_caught(monkeypatch):
    """Dropping one block too early (the window one block short) leaves a query without
    the slot of a key it sees: the coverage check must fail."""
    real = kv_groups.first_window_block
    monkeypatch.setattr(kv_groups, "first_window_block", lambda p, w, bs: real(p, w, bs) + 1)
    monkeypatch.setattr("ferrox_jax.block_tables.first_window_block",
                        lambda p, w, bs: real(p, w, bs) + 1, raising=True)
    scheduler, runner = make()
    with pytest.raises(AssertionError, match="has no held slot|differ"):
        run(scheduler, runner, [job("a", 21, 60)])


def test_stats_report_the_sliding_group():
    from ferrox_jax.stats import scheduler_fields
    scheduler, runner = make()
    scheduler.add_job(job("a", 30, 40))
    for _ in range(36):
        plan = scheduler.schedule()
        scheduler.update(plan, run_plan(runner, plan))
    fields = scheduler_fields(scheduler)
    pool = scheduler.blocks.window
    assert fields["kv_window_slots_total"] == pool.num_slots > 0
    # one decoding row: its window's ceil(16 / 8) + 1 slots, against its whole table
    assert 0 < fields["kv_window_slots_held"] <= 3 < len(next(iter(scheduler._decoding.values())).block_ids)
    assert fields["kv_window_blocks_passed"] > 0
    assert fields["kv_window_slots_free"] == pool.num_slots - pool.num_reserved
    assert dataclasses.is_dataclass(scheduler.limits)


def test_preemption_drops_every_window_and_the_resumed_rows_reply_as_alone():
    limits = SchedulerLimits(block_size=BS, num_blocks=40, max_rows=2, max_chunk_tokens=24, kv_window=WINDOW,
                             scheduling_policy="priority")
    runner = ScriptedRunner(block_size=BS, num_blocks=41, max_rows=8, max_chunk_tokens=24,
                            max_chunks=limits.max_chunks, token_fn=letters_token_fn())
    scheduler = Scheduler(limits, ByteTokenizer())
    background = [job("bg0", 19, 60, priority=5), job("bg1", 11, 60, priority=5)]
    urgent = job("fg", 14, 20, priority=0)
    outputs, held = {}, []
    for spec in background:
        scheduler.add_job(spec)
    for i in range(200):
        if not scheduler.has_work:
            break
        if i == 30:
            scheduler.add_job(urgent)
        plan = scheduler.schedule()
        check_windows(scheduler, plan)
        if not plan.is_empty:
            runner.plans.append(plan)
            scheduler.update(plan, run_plan(runner, plan))
        collect(outputs, scheduler.take_events())
    assert scheduler.num_preemptions >= 1
    for spec in [*background, urgent]:
        expected, _ = run(*make(), [spec])
        assert outputs[(spec.request_id, 0)].token_ids == expected[(spec.request_id, 0)].token_ids
    assert_no_leaks(scheduler)


# -- the scheduler's stateful property test, with a sliding group ------------------------

from hypothesis import settings  # noqa: E402
from hypothesis.stateful import invariant  # noqa: E402

from tests.engine.test_scheduler import LIMITS, SchedulerMachine  # noqa: E402

MACHINE_WINDOW = 6  # keys; blocks of 4: a row's window spans 2 or 3 blocks


class WindowedSchedulerMachine(SchedulerMachine):
    """Random submit / cancel / tick / runner-failure sequences (n > 1, shared prefixes,
    stop strings) with a sliding group: after every step the pool's references are exactly
    the tables' windows, and every table still holds the slots its next query sees."""

    limits = dataclasses.replace(LIMITS, kv_window=MACHINE_WINDOW)

    @invariant()
    def window_slots_follow_the_tables(self):
        scheduler = self.scheduler
        pool = scheduler.blocks.window
        live = [(job, job.prefill_block_ids, job.num_computed_tokens) for job in scheduler._prefilling]
        live += [(row, row.block_ids, row.num_computed_tokens) for row in scheduler._rows_with_tables()]
        pool.check([(owner, block_ids) for owner, block_ids, _ in live])
        for owner, block_ids, pos in live:
            assert pool.start(owner) <= max(0, pos - MACHINE_WINDOW + 1) // 4, "a window block was dropped early"


TestWindowedSchedulerMachine = WindowedSchedulerMachine.TestCase
TestWindowedSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
