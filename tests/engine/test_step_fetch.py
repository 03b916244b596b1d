"""What a step hands back to the host, cheaply: the sampler's outputs as one packed array
(one fetch), read back bit for bit, the sampling columns not copied when the rows
already fill their bucket in order, and each host row's results picked from its padded rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.host_batch import BatchGeometry, HostBatch, SamplingArrays
from ferrox_jax.buckets import Buckets
from ferrox_jax.padding import pad_batch, split_sampled, unpad_results
from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.request import MAX_LOGPROBS, RowSampling
from ferrox_jax.step import SAMPLED_COLUMNS, pack_sampled

GEOMETRY = BatchGeometry(block_size=4, table_width=8, vocab_size=300)


def _sampled(rows: int = 3):
    """Sampler-shaped arrays whose floats include the values a value cast would lose: a
    fraction, -inf, a NaN with a payload, negative zero and a denormal."""
    rng = np.random.default_rng(0)
    tokens = np.array([7, 299, 0][:rows], np.int32)
    logprob = np.array([-0.125, -np.inf, np.float32(-3.3e-39)][:rows], np.float32)
    top_ids = rng.integers(0, 300, (rows, MAX_LOGPROBS)).astype(np.int32)
    top = rng.standard_normal((rows, MAX_LOGPROBS)).astype(np.float32) - 5
    top[0, 0] = np.frombuffer(np.uint32(0x7FC00123).tobytes(), np.float32)[0]  # NaN, payload 0x123
    top[1, 1] = -0.0
    finite = np.array([True, False, True][:rows])
    return tokens, logprob, top_ids, top, finite


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32) if a.dtype == np.float32 else a


def test_the_packed_sampler_output_reads_back_bit_for_bit():
    arrays = _sampled()
    packed = np.asarray(jax.jit(pack_sampled)(*map(jnp.asarray, arrays)).packed)
    assert packed.shape == (3, SAMPLED_COLUMNS) == (3, 3 + 2 * MAX_LOGPROBS) and packed.dtype == np.int32
    back = split_sampled(packed)
    for name, want, got in zip(("tokens", "logprob", "top ids", "top logprobs", "finite"), arrays, back):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{name} must come back bit for bit")


def test_a_value_cast_instead_of_a_bitcast_would_be_caught():
    """Negative control: packing the floats by value (what `astype(int32)` does) loses the
    fraction; the same comparison as above sees it."""
    tokens, logprob, top_ids, top, finite = _sampled()
    with np.errstate(invalid="ignore"):  # -inf has no int32 value: that is the point
        by_value = logprob[:, None].astype(np.int32)
    wrong = np.concatenate([tokens[:, None], by_value, top_ids, top.view(np.int32), finite[:, None].astype(np.int32)],
                           axis=1)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(_bits(split_sampled(wrong)[1]), _bits(logprob))


def test_a_packed_array_of_another_width_or_type_is_refused():
    with pytest.raises(ValueError, match=f"int32\\[R, {SAMPLED_COLUMNS}\\]"):
        split_sampled(np.zeros((2, SAMPLED_COLUMNS - 1), np.int32))
    with pytest.raises(ValueError, match="float32"):
        split_sampled(np.zeros((2, SAMPLED_COLUMNS), np.float32))


def _sampling(rows: int) -> SamplingArrays:
    plan = StepPlan(decode=tuple(
        RowPlan(row_id=r, token_ids=(5,), start_pos=3, block_ids=(1,), sample=True,
                sampling=RowSampling(temperature=0.5 + r, top_k=3, seed=r + 1, logprobs=2 if r else None))
        for r in range(rows)))
    return HostBatch.build(plan, GEOMETRY).sampling


def _fields(s: SamplingArrays) -> dict:
    return {name: np.array(value) for name, value in vars(s).items()}


def test_rows_in_order_filling_their_bucket_are_not_copied():
    sampling = _sampling(2)
    assert sampling.gather(np.arange(2), GEOMETRY.vocab_size) is sampling


@pytest.mark.parametrize("order", [[1, 0], [0, 1, -1, -1], [0, -1]], ids=["permuted", "padded", "short"])
def test_rows_out_of_order_or_padded_are_gathered_as_before(order):
    """Negative control of the no-copy path: any other order takes the copy, and what it
    gives is row order[j] in row j, greedy defaults in padding rows."""
    sampling = _sampling(2)
    before = _fields(sampling)
    order = np.array(order)
    got = sampling.gather(order, GEOMETRY.vocab_size)
    assert got is not sampling
    pad = SamplingArrays.padding(1, GEOMETRY.vocab_size)
    for name, value in _fields(got).items():
        for j, host in enumerate(order):
            want = before[name][host] if host >= 0 else getattr(pad, name)[0]
            np.testing.assert_array_equal(value[j], want, err_msg=f"{name}, padded row {j}")
    for name, value in _fields(sampling).items():  # the source is left as it was
        np.testing.assert_array_equal(value, before[name])


def _row(r: int, tokens: int, samples: int) -> RowPlan:
    return RowPlan(row_id=r, token_ids=tuple(range(5, 5 + tokens)), start_pos=3, block_ids=(1, 2, 3),
                   sample=samples > 0, num_draft_tokens=max(0, samples - 1) if samples == tokens else 0,
                   sampling=RowSampling(temperature=0.0))


@pytest.mark.parametrize("rows", [
    [(1, 1), (1, 1), (6, 1), (5, 0)],  # two decode rows, a last chunk and a middle one: plain picks
    [(1, 1), (3, 3), (6, 1)],  # a row verifying 2 drafts takes 3 padded rows: the general path
], ids=["plain", "speculating"])
def test_each_host_row_reads_its_own_padded_rows(rows):
    """Every padded row's outputs are distinct, so a host row that read another row's (or a
    padding row's) would show: row h's column j is its (j+1)-th padded row (its first where it
    sampled less), finite the AND over its padded rows."""
    plan = StepPlan(decode=tuple(_row(r, t, n) for r, (t, n) in enumerate(rows) if t == n or t == 1),
                    chunks=tuple(_row(r, t, n) for r, (t, n) in enumerate(rows) if not (t == n or t == 1)))
    batch = HostBatch.build(plan, GEOMETRY)
    shape, order, _ = pad_batch(batch, Buckets.derive(8, 16, 2), GEOMETRY.table_width, has_lora=False)
    p = shape.num_rows
    tokens = np.arange(p, dtype=np.int32) + 1000
    logprob = -np.arange(p, dtype=np.float32) / 8
    top_ids = (np.arange(p * MAX_LOGPROBS, dtype=np.int32) + 7).reshape(p, MAX_LOGPROBS)
    top = -top_ids.astype(np.float32)
    finite = np.arange(p) % 3 != 2
    got = unpad_results(batch, shape, order, [tokens, logprob, top_ids, top, finite], False, False)
    width = max(1, int(batch.num_logits.max()))
    assert got.tokens.shape == (batch.num_rows, width) and got.top_ids.shape == (batch.num_rows, width, MAX_LOGPROBS)
    for h in range(batch.num_rows):
        mine = np.flatnonzero(order == h)
        for j in range(width):
            at = mine[j] if j < max(1, batch.num_logits[h]) else mine[0]
            assert got.tokens[h, j] == tokens[at] and got.logprob[h, j] == logprob[at], (h, j)
            np.testing.assert_array_equal(got.top_ids[h, j], top_ids[at])
            np.testing.assert_array_equal(got.top_logprobs[h, j], top[at])
        assert got.finite[h] == finite[mine].all(), h
