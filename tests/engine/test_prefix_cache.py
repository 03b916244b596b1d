"""Prefix caching in the scheduler, against the scripted runner (its fake paged cache reads
every token back through the block table, so a wrong hit, a missed copy or an overwritten
shared block changes the sampled tokens)."""

from __future__ import annotations

import dataclasses

import pytest

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.prefix_cache import chain_hashes
from ferrox_jax.request import Job, RowSampling
from ferrox_jax.scheduler import Scheduler
from tests.support.scripted import ByteTokenizer, ScriptedRunner, letters_token_fn, run_until_idle, tick

BS = 4  # block size in every test here


def make(*, num_blocks=64, caching=True, chunk=16, max_rows=8):
    runner = ScriptedRunner(block_size=BS, num_blocks=num_blocks + 1, max_rows=8, max_chunk_tokens=chunk,
                            token_fn=letters_token_fn())
    limits = SchedulerLimits(block_size=BS, num_blocks=num_blocks, max_rows=max_rows,
                             max_chunk_tokens=chunk, prefix_caching=caching)
    return Scheduler(limits, ByteTokenizer()), runner


def tokens(n, start=0):
    """n distinct token ids: prompts built from them share exactly the prefix they slice."""
    return tuple(100 + start + i for i in range(n))


def spec(request_id, prompt, max_tokens=5, **kw):
    return Job(request_id, tuple(prompt), max_tokens, **kw)


def run(scheduler, runner, *specs, outputs=None):
    for s in specs:
        scheduler.add_job(s)
    return run_until_idle(scheduler, runner, outputs)


def first_event(outputs, request_id):
    return outputs[(request_id, 0)].events[0]


def prefill_positions(runner, plans_from, row_id):
    return [step.start_pos + i for plan in runner.plans[plans_from:] for step in plan.chunks
            if step.row_id == row_id for i in range(len(step.token_ids))]


def uncached_tokens(s):
    """What the job samples on a scheduler without a cache (the reference)."""
    scheduler, runner = make(caching=False)
    return run(scheduler, runner, s)[(s.request_id, 0)].token_ids


# -- hits at block boundaries ---------------------------------------------------------

CACHED = tokens(12)  # 3 full blocks of 4


# The last prompt token is always computed and never in a hit block: a hit covers at most
# the (P - 1) // 4 blocks wholly before it.
@pytest.mark.parametrize("second, num_cached", [
    (CACHED, 8),  # the same prompt twice: 2 of its 3 blocks hit, the last block is recomputed
    (CACHED[:8] + tokens(5, 50), 8),  # a prefix of exactly 2 blocks, then other tokens
    (CACHED[:9] + tokens(5, 50), 8),  # 2 blocks + 1 token: the partly matching block is computed
    (CACHED[:9], 8),  # a prefix of the cached one: 2 blocks + its last token
    (CACHED[:8], 4),  # a prefix of the cached one ending on a block boundary: (8 - 1) // 4 = 1 block
    (CACHED[:6], 4),  # a prefix of the cached one ending inside a block
    (CACHED[:4], 0),  # one block, holding the last token: nothing to hit
    (tokens(12, 50), 0),  # nothing shared
])
def test_hits_at_block_boundaries_compute_only_the_rest_and_sample_the_same(second, num_cached):
    scheduler, runner = make()
    run(scheduler, runner, spec("first", CACHED))
    num_plans = len(runner.plans)
    outputs = run(scheduler, runner, spec("second", second))
    first_row = 2  # row ids: "first" took 1
    assert first_event(outputs, "second").num_cached_tokens == num_cached
    assert prefill_positions(runner, num_plans, first_row) == list(range(num_cached, len(second))), (
        "prefill starts right after the cached tokens and always computes the last prompt token")
    assert not [c for plan in runner.plans[num_plans:] for c in plan.block_copies], "a hit copies nothing"
    assert outputs[("second", 0)].token_ids == uncached_tokens(spec("second", second)), (
        "a cache hit must not change the sampled tokens")
    assert scheduler.blocks.num_hit_tokens == num_cached
    assert scheduler.blocks.num_queried_tokens == len(CACHED) + len(second)


def test_a_prompt_cached_whole_never_writes_into_a_cached_block():
    scheduler, runner = make()
    run(scheduler, runner, spec("first", CACHED, max_tokens=1))
    cached_ids = set(scheduler.blocks.cache.lookup(chain_hashes(CACHED, BS, scheduler.blocks.cache.root)))
    num_plans = len(runner.plans)
    run(scheduler, runner, spec("again", CACHED, max_tokens=6))
    written = {step.block_ids[pos // BS] for plan in runner.plans[num_plans:] for step in plan.chunks + plan.decode
               for pos in range(step.start_pos, step.start_pos + len(step.token_ids))}
    assert len(cached_ids) == 3 and not written & cached_ids, "cached blocks are read-only"


def test_generated_tokens_fill_cached_blocks_for_the_next_turn():
    scheduler, runner = make()
    turn1 = run(scheduler, runner, spec("turn1", tokens(6), max_tokens=9))[("turn1", 0)]
    # Positions 0..13 are computed (6 prompt + 8 of the 9 sampled tokens): 3 full blocks.
    turn2_prompt = tokens(6) + tuple(turn1.token_ids) + tokens(3, 50)
    outputs = run(scheduler, runner, spec("turn2", turn2_prompt))
    assert first_event(outputs, "turn2").num_cached_tokens == 12, "the reply's full blocks hit too"
    assert outputs[("turn2", 0)].token_ids == uncached_tokens(spec("turn2", turn2_prompt))


def test_prompt_logprobs_jobs_compute_every_position():
    scheduler, runner = make()
    run(scheduler, runner, spec("first", CACHED))
    outputs = run(scheduler, runner, spec("scored", CACHED, prompt_logprobs=True))
    assert first_event(outputs, "scored").num_cached_tokens == 0
    assert len(first_event(outputs, "scored").prompt_logprobs) == len(CACHED) - 1


def test_caching_off_keeps_nothing_and_hits_nothing():
    scheduler, runner = make(caching=False)
    run(scheduler, runner, spec("first", CACHED))
    outputs = run(scheduler, runner, spec("second", CACHED))
    assert first_event(outputs, "second").num_cached_tokens == 0
    assert scheduler.blocks.num_cached_blocks == 0 and scheduler.blocks.num_queried_tokens == 0
    assert scheduler.budget.free_block_ids() == set(range(1, 65)), "every block is plainly free"


# -- n > 1 is a prefix hit on the job's own prefill --------------------------------------

@pytest.mark.parametrize("prompt_len, cached_first, num_copies", [
    (10, False, 2),  # 9 prefilled: 2 full blocks shared, the partly filled one copied by 2 of 3 rows
    (9, False, 0),  # 8 prefilled: the rows write the last prompt token into blocks of their own
    (12, True, 2),  # cached whole: 2 blocks hit, 3 tokens prefilled into a block 2 of 3 rows copy
])
def test_n_rows_share_the_prompt_through_the_same_copy_on_write(prompt_len, cached_first, num_copies):
    scheduler, runner = make()
    prompt = tokens(prompt_len)
    if cached_first:
        run(scheduler, runner, spec("warm", prompt, max_tokens=1))
    num_plans = len(runner.plans)
    multi = spec("multi", prompt, 6, n=3, sampling=RowSampling(seed=3))
    outputs = run(scheduler, runner, multi)
    copies = [c for plan in runner.plans[num_plans:] for c in plan.block_copies]
    assert len(copies) == num_copies
    reference, ref_runner = make(caching=False)
    expected = run(reference, ref_runner, multi)
    for index in range(3):
        assert outputs[("multi", index)].token_ids == expected[("multi", index)].token_ids


# -- eviction and admission under pressure ---------------------------------------------

def test_idle_cached_blocks_count_as_free_and_admission_evicts_the_chain_tail_first():
    scheduler, runner = make(num_blocks=8)
    run(scheduler, runner, spec("a", tokens(16), max_tokens=2))  # 4 full prompt blocks stay cached
    stats_free = scheduler.budget.num_free_blocks
    assert scheduler.blocks.num_cached_blocks == 4 and stats_free == 8, "idle: every block counts as free"
    names = chain_hashes(tokens(16), BS, scheduler.blocks.cache.root)
    # "b" needs ceil((20 + 8) / 4) = 7 blocks: 4 plainly free, so 3 cached ones are evicted.
    scheduler.add_job(spec("b", tokens(20, 50), max_tokens=8))
    tick(scheduler, runner, {})
    assert scheduler.waiting_request_ids == (), "cached blocks never keep a job waiting"
    assert len(scheduler.blocks.cache.lookup(names)) == 1, "the chain's tail went first, its head stayed"
    run_until_idle(scheduler, runner)
    scheduler.budget.check()


def test_a_cached_block_in_use_is_never_evicted_and_a_job_waits_instead():
    scheduler, runner = make(num_blocks=8)
    run(scheduler, runner, spec("a", tokens(8), max_tokens=1))  # 2 cached blocks
    hit = spec("hit", tokens(8) + tokens(2, 50), max_tokens=10)
    outputs = {}
    scheduler.add_job(hit)  # shares both cached blocks; promised ceil(20 / 4) - 2 = 3 new
    tick(scheduler, runner, outputs)
    # 8 - 2 held - 3 promised = 3 free; "bigger" needs ceil((14 + 2) / 4) = 4.
    scheduler.add_job(spec("bigger", tokens(14, 80), max_tokens=2))
    tick(scheduler, runner, outputs)
    assert scheduler.waiting_request_ids == ("bigger",), "held cached blocks are not evictable"
    run_until_idle(scheduler, runner, outputs)
    assert outputs[("hit", 0)].token_ids == uncached_tokens(hit)
    assert outputs[("bigger", 0)].finish_reason == "length"


def test_a_hit_never_costs_more_than_no_hit_so_a_job_filling_the_budget_runs_twice():
    scheduler, runner = make(num_blocks=8)
    whole = spec("whole", tokens(16), max_tokens=16)  # ceil(32 / 4) = 8 blocks: the whole budget
    run(scheduler, runner, whole)
    assert scheduler.blocks.num_cached_blocks >= 4, "its prompt (and reply) blocks stay cached, idle"
    # Again: 3 blocks hit (the 4th holds the last prompt token), 8 - 3 = 5 new: 3 + 5 = 8 fit.
    outputs = run(scheduler, runner, dataclasses.replace(whole, request_id="again"))
    assert outputs[("again", 0)].finish_reason == "length" and first_event(outputs, "again").num_cached_tokens == 12


# -- cancellation with shared blocks ---------------------------------------------------

@pytest.mark.parametrize("victim", ["owner", "sharer"])
def test_cancelling_one_of_two_requests_sharing_blocks_leaves_the_other_intact(victim):
    scheduler, runner = make()
    owner = spec("owner", tokens(12) + tokens(2, 50), max_tokens=20)
    sharer = spec("sharer", tokens(12) + tokens(3, 70), max_tokens=20)
    outputs = {}
    scheduler.add_job(owner)
    for _ in range(3):  # prefill (14 tokens, one chunk) and two decode steps
        tick(scheduler, runner, outputs)
    scheduler.add_job(sharer)
    tick(scheduler, runner, outputs)
    assert first_event(outputs, "sharer").num_cached_tokens == 12, "the sharer hit the owner's blocks"
    refs = scheduler.block_references()
    assert sum(1 for count in refs.values() if count == 2) == 3, "3 prompt blocks referenced twice"
    scheduler.cancel(victim)
    tick(scheduler, runner, outputs)
    assert scheduler.budget.ref_counts() == dict(scheduler.block_references()), (
        "after the cancel the pool's counts are the survivor's references")
    scheduler.budget.check()
    run_until_idle(scheduler, runner, outputs)
    survivor = sharer if victim == "owner" else owner
    assert outputs[(victim, 0)].finish_reason == "cancelled"
    assert outputs[(survivor.request_id, 0)].token_ids == uncached_tokens(survivor), (
        "the survivor's tokens are those it samples alone")
    assert scheduler.budget.num_free_blocks == 64 and scheduler.budget.num_held_blocks == 0
