"""The host batch: built from a plan, numpy only, and unchanged by a trip through bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ferrox_jax.host_batch import BatchGeometry, HostBatch, SamplingArrays
from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.request import RowSampling

GEOMETRY = BatchGeometry(block_size=4, table_width=8, vocab_size=300)


def plan() -> StepPlan:
    """Two decode rows (one with penalties and a constraint), a middle chunk scoring its
    prompt, a pooling chunk, and a block copy."""
    penalised = RowSampling(temperature=0.7, top_p=0.9, top_k=40, seed=7, logprobs=3, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias=((5, 2.0),))
    decode = (RowPlan(row_id=3, token_ids=(11,), start_pos=9, block_ids=(4, 5, 6), sample=True, sampling=penalised,
                      num_prompt_tokens=6, history_token_ids=tuple(range(20, 30)), is_constrained=True),
              RowPlan(row_id=8, token_ids=(12,), start_pos=2, block_ids=(7,), sample=True))
    chunks = (RowPlan(row_id=9, token_ids=(1, 2, 3, 4, 5), start_pos=4, block_ids=(1, 2, 3), sample=False,
                      prompt_logprobs=True, next_token_id=6, num_prompt_tokens=12),
              RowPlan(row_id=10, token_ids=(7, 8), start_pos=0, block_ids=(9,), sample=False, pooling=True))
    return StepPlan(decode=decode, chunks=chunks, block_copies=((2, 9),))


def test_a_plan_becomes_arrays_in_decode_then_chunk_order():
    batch = HostBatch.build(plan(), GEOMETRY)
    assert batch.row_ids.tolist() == [3, 8, 9, 10]
    assert batch.row_starts.tolist() == [0, 1, 2, 7, 9]  # 1 + 1 + 5 + 2 tokens
    assert batch.token_ids.tolist() == [11, 12, 1, 2, 3, 4, 5, 7, 8]
    assert batch.positions.tolist() == [9, 2, 4, 5, 6, 7, 8, 0, 1]
    assert batch.block_tables.shape == (4, 8) and batch.block_tables[0].tolist() == [4, 5, 6, 0, 0, 0, 0, 0]
    # The chunk at positions 4..8 needs blocks 1 and 2 of its table (8 // 4 + 1 = 3 blocks: all three).
    assert batch.block_tables[2, :3].tolist() == [1, 2, 3]
    assert batch.num_logits.tolist() == [1, 1, 0, 0]
    assert batch.next_token_ids[2:7].tolist() == [2, 3, 4, 5, 6], "each position's following prompt token"
    assert batch.constrained.tolist() == [True, False, False, False] and batch.pooling.tolist()[3]
    assert batch.sampling.temperature.tolist() == pytest.approx([0.7, 1.0, 0.0, 0.0]), "rows that sample nothing: greedy padding"
    penalties = dict(zip(batch.sampling.penalty_ids[0].tolist(), batch.sampling.penalty_add[0].tolist()))
    # presence 0.5 over the generated tokens (history after the 6 prompt tokens: 26..29), bias +2 on token 5
    assert penalties[5] == pytest.approx(2.0) and penalties[27] == pytest.approx(-0.5) and penalties[21] == 0.0
    assert batch.block_copies.tolist() == [[2, 9]]


def test_a_host_batch_survives_bytes_bit_for_bit():
    batch = HostBatch.build(plan(), GEOMETRY)
    batch.bitmask = np.random.RandomState(0).randint(-2**31, 2**31 - 1, (4, 10), dtype=np.int64).astype(np.int32)
    back = HostBatch.from_bytes(batch.to_bytes())
    for field in dataclasses.fields(HostBatch):
        a, b = getattr(batch, field.name), getattr(back, field.name)
        if a is None:  # an optional column this batch has none of (images): none comes back
            assert b is None, field.name
            continue
        if isinstance(a, SamplingArrays):
            pairs = [(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(SamplingArrays)]
        else:
            pairs = [(a, b)]
        for x, y in pairs:
            assert x.dtype == y.dtype and x.shape == y.shape, field.name
            assert x.tobytes() == y.tobytes(), f"{field.name} changed in transit"
    assert HostBatch.from_bytes(HostBatch.build(plan(), GEOMETRY).to_bytes()).bitmask is None


def test_bytes_that_are_not_a_host_batch_are_refused():
    with pytest.raises(ValueError, match="not a serialized HostBatch"):
        HostBatch.from_bytes(b"hello")


def test_a_block_table_too_short_or_past_the_ceiling_is_a_plan_bug():
    short = RowPlan(row_id=1, token_ids=(1, 2, 3, 4, 5), start_pos=0, block_ids=(1,), sample=True)
    with pytest.raises(ValueError, match="block table has 1 blocks but positions up to 4 need 2"):
        HostBatch.build(StepPlan(chunks=(short,)), GEOMETRY)
    far = RowPlan(row_id=1, token_ids=(1,), start_pos=40, block_ids=tuple(range(1, 12)), sample=True)
    with pytest.raises(ValueError, match="beyond the context ceiling"):
        HostBatch.build(StepPlan(decode=(far,)), GEOMETRY)
