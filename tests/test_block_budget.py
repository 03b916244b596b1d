"""BlockBudget: the reservation ledger and the reference-counted pool of block ids."""

import pytest

from ferrox_jax.block_budget import BlockBudget


def test_block_ids_start_at_one_and_never_hand_out_the_null_block():
    budget = BlockBudget(4)
    assert budget.try_reserve(4)
    ids = [budget.allocate() for _ in range(4)]
    assert sorted(ids) == [1, 2, 3, 4], "ids 1..num_blocks are handed out; 0 is the null block"


def test_free_counts_reservations_not_held_blocks():
    budget = BlockBudget(10)
    assert budget.try_reserve(6)
    budget.allocate()
    # 10 total - 6 reserved = 4 free, whatever is held inside the reservation.
    assert budget.num_free_blocks == 4, "free is total minus reserved"
    assert budget.num_held_blocks == 1


def test_reserve_says_not_now_without_changing_the_ledger():
    budget = BlockBudget(8)
    assert budget.try_reserve(5)
    assert not budget.try_reserve(4), "5 + 4 > 8 must not fit now"
    assert budget.num_reserved_blocks == 5, "a refused reservation must not reserve anything"
    assert budget.can_ever_fit(8) and not budget.can_ever_fit(9), "never = more than the whole budget"


def test_shared_block_returns_to_the_pool_after_its_last_reference():
    budget = BlockBudget(2)
    assert budget.try_reserve(2)
    block_id = budget.allocate()
    budget.share(block_id)
    budget.free(block_id)
    assert budget.ref_count(block_id) == 1, "one reference left after one of two frees"
    budget.free(block_id)
    assert budget.num_held_blocks == 0, "the block is free after its last reference"
    assert {budget.allocate(), budget.allocate()} == {1, 2}, "a freed id is handed out again"


def test_allocating_beyond_the_reservations_is_an_invariant_violation():
    budget = BlockBudget(4)
    assert budget.try_reserve(1)
    budget.allocate()
    with pytest.raises(AssertionError, match="reserved"):
        budget.allocate()


def test_double_free_is_an_invariant_violation():
    budget = BlockBudget(4)
    assert budget.try_reserve(1)
    block_id = budget.allocate()
    budget.free(block_id)
    with pytest.raises(AssertionError, match="not held"):
        budget.free(block_id)
