"""BlockBudget and PrefixCache: block states, the admission ledger, naming, eviction order."""

import pytest

from ferrox_jax.block_budget import BlockBudget
from ferrox_jax.prefix_cache import PrefixCache, chain_hashes, root_hash


def cached_budget(num_blocks):
    return BlockBudget(num_blocks, PrefixCache("test"))


def names(*ids):
    return [bytes([i]) * 32 for i in ids]


def test_block_ids_start_at_one_and_never_hand_out_the_null_block():
    budget = BlockBudget(4)
    assert budget.try_admit(4)
    ids = [budget.allocate() for _ in range(4)]
    assert sorted(ids) == [1, 2, 3, 4], "ids 1..num_blocks are handed out; 0 is the null block"
    budget.check()


def test_free_counts_what_admitted_jobs_hold_or_were_promised():
    budget = BlockBudget(10)
    assert budget.try_admit(6)
    budget.allocate()
    # 10 total - (1 held + 5 still promised) = 4 free, however much of the promise is used.
    assert budget.num_free_blocks == 4 and budget.num_reserved_blocks == 6
    assert budget.num_held_blocks == 1 and budget.num_owed_blocks == 5


def test_admission_says_not_now_without_changing_the_ledger():
    budget = BlockBudget(8)
    assert budget.try_admit(5)
    assert not budget.try_admit(4), "5 + 4 > 8 must not fit now"
    assert budget.num_reserved_blocks == 5, "a refused admission must not promise anything"
    assert budget.can_ever_fit(8) and not budget.can_ever_fit(9), "never = more than the whole budget"


def test_shared_block_returns_to_the_pool_after_its_last_reference():
    budget = BlockBudget(2)
    assert budget.try_admit(2)
    block_id = budget.allocate()
    budget.share(block_id)
    assert not budget.is_writable(block_id), "a block two tables reference must be copied before a write"
    budget.free(block_id)
    assert budget.ref_count(block_id) == 1 and budget.is_writable(block_id)
    budget.free(block_id)
    assert budget.num_held_blocks == 0, "the block is free after its last reference"
    assert budget.try_admit(1)  # 1 promise left + 1 more
    assert {budget.allocate(), budget.allocate()} == {1, 2}, "a freed id is handed out again"


def test_allocating_beyond_the_promise_is_an_invariant_violation():
    budget = BlockBudget(4)
    assert budget.try_admit(1)
    budget.allocate()
    with pytest.raises(AssertionError, match="beyond"):
        budget.allocate()


def test_double_free_is_an_invariant_violation():
    budget = BlockBudget(4)
    assert budget.try_admit(1)
    block_id = budget.allocate()
    budget.free(block_id)
    with pytest.raises(AssertionError, match="not held"):
        budget.free(block_id)


# -- with the prefix cache ------------------------------------------------------------

def test_a_named_block_goes_idle_when_released_and_counts_as_free():
    budget = cached_budget(4)
    assert budget.try_admit(2)
    named, plain = budget.allocate(), budget.allocate()
    assert budget.name(named, names(1)[0])
    assert not budget.is_writable(named), "a cached block is read-only even with one reference"
    budget.free(named)
    budget.free(plain)
    assert budget.num_idle_cached_blocks == 1 and budget.free_block_ids() == {plain, 3, 4}
    assert budget.num_free_blocks == 4, "an idle cached block counts as free: the server is idle"
    budget.check()


def test_a_hit_on_an_idle_block_costs_one_a_hit_on_a_held_block_costs_nothing():
    budget = cached_budget(4)
    assert budget.try_admit(2)
    held, idle = budget.allocate(), budget.allocate()
    budget.name(held, names(1)[0])
    budget.name(idle, names(2)[0])
    budget.free(idle)
    # 4 blocks - 1 held = 3 free (2 plain + 1 idle). Sharing `held` costs 0, `idle` costs 1:
    # 2 new + 1 = 3 fits, 3 new + 1 = 4 does not.
    assert not budget.try_admit(3, [held, idle])
    assert budget.ref_count(held) == 1, "a refused admission takes no references"
    assert budget.try_admit(2, [held, idle])
    assert budget.ref_count(held) == 2 and budget.ref_count(idle) == 1
    assert budget.num_idle_cached_blocks == 0 and budget.num_free_blocks == 0
    budget.check()


def test_admission_evicts_least_recently_released_first_and_allocation_never_evicts():
    budget = cached_budget(4)
    assert budget.try_admit(4)
    blocks = [budget.allocate() for _ in range(4)]
    for block_id, name in zip(blocks, names(1, 2, 3, 4)):
        budget.name(block_id, name)
    for block_id in reversed(blocks):  # a job releases tail first
        budget.free(block_id)
    assert budget.cache.idle_block_ids() == (4, 3, 2, 1), "tail first in eviction order"
    assert budget.try_admit(2), "four idle cached blocks count as free"
    assert budget.cache.lookup(names(1, 2, 3, 4)) == [1, 2], "the two evicted are the chain's tail"
    assert len(budget.free_block_ids()) == budget.num_owed_blocks == 2, "evicted exactly the promise"
    assert budget.allocate() in (3, 4) and budget.num_idle_cached_blocks == 2, "allocation took a free id"
    budget.check()


def test_a_hit_takes_the_block_out_of_eviction_order_until_released_again():
    budget = cached_budget(3)
    assert budget.try_admit(3)
    blocks = [budget.allocate() for _ in range(3)]
    for block_id, name in zip(blocks, names(1, 2, 3)):
        budget.name(block_id, name)
        budget.free(block_id)
    assert budget.cache.idle_block_ids() == (1, 2, 3)
    assert budget.try_admit(0, [1])
    budget.free(1)
    assert budget.cache.idle_block_ids() == (2, 3, 1), "a block used again is the last to go"


def test_a_name_is_kept_with_its_first_block():
    cache = PrefixCache()
    assert cache.insert(b"n" * 32, 5)
    assert not cache.insert(b"n" * 32, 6), "the same prefix computed twice keeps the first block"
    assert not cache.insert(b"m" * 32, 5), "a block has one name"
    assert cache.lookup([b"n" * 32, b"m" * 32]) == [5]


def test_block_names_cover_the_whole_prefix_and_the_salt():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, root_hash("m"))
    b = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, root_hash("m"))
    assert len(a) == 2, "only full blocks are named (9 tokens, blocks of 4)"
    assert a[1] != b[1], "block 1 has the same tokens but a different prefix: a different name"
    assert chain_hashes([1, 2, 3, 4], 4, root_hash("other model"))[0] != a[0], "the salt is in every name"
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, a[0], start_block=1) == a[1:], "chains resume"
