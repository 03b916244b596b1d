"""Pooling jobs (embeddings) in the scheduler, against a scripted runner: prefill chunks
only, the prompt's blocks only, the pooled vector in the one event, and generation traffic
decoding every tick alongside. No device."""

from __future__ import annotations

import numpy as np
import pytest

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.request import Job
from ferrox_jax.scheduler import Scheduler
from tests.support.scripted import ByteTokenizer, ScriptedRunner, run_until_idle, tick

BLOCK_SIZE, CHUNK = 4, 8


class PoolingRunner(ScriptedRunner):
    """The hidden state of the token at position p is [p, token id]: sums are checkable by hand."""

    def _result(self, batch, r, arrays):
        if not batch.pooling[r]:
            return super()._result(batch, r, arrays)
        lo, hi = batch.row_starts[r], batch.row_starts[r + 1]
        states = np.stack([batch.positions[lo:hi], batch.token_ids[lo:hi]], axis=1).astype(np.float32)  # [T, 2]
        arrays.hidden_sum[r], arrays.last_hidden[r] = states.sum(axis=0), states[-1]


def make(num_blocks=64):
    runner = PoolingRunner(block_size=BLOCK_SIZE, num_blocks=num_blocks + 1, max_chunk_tokens=CHUNK)
    limits = SchedulerLimits(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_rows=8,
                             max_chunk_tokens=CHUNK, max_context=64)
    return Scheduler(limits, ByteTokenizer()), runner


def pooling(request_id, prompt, kind="mean"):
    return Job(request_id=request_id, prompt_token_ids=tuple(prompt), max_tokens=0, pooling=kind)


@pytest.mark.parametrize("kind", ["mean", "last"])
def test_pooled_vector_over_a_chunked_prompt(kind):
    scheduler, runner = make()
    prompt = list(range(30, 50))  # 20 tokens: chunks of 8, 8, 4
    scheduler.add_job(pooling("e", prompt, kind))
    out = run_until_idle(scheduler, runner)[("e", 0)]
    event = out.events[-1]
    assert out.num_events == 1 and event.finish_reason == "stop" and event.token_ids == ()
    expected = [np.mean(range(20)), np.mean(prompt)] if kind == "mean" else [19, prompt[-1]]
    np.testing.assert_allclose(event.embedding, expected)
    assert [len(s.token_ids) for p in runner.plans for s in p.chunks] == [8, 8, 4]
    assert not any(s.sample for p in runner.plans for s in p.chunks), "nothing is sampled"
    assert scheduler.budget.num_free_blocks == 64 and scheduler.tokens_generated == 0


def test_a_pooling_job_reserves_only_its_prompt_blocks():
    scheduler, runner = make()
    scheduler.add_job(pooling("e", range(30, 50)))
    tick(scheduler, runner, {})
    assert scheduler.budget.num_free_blocks == 64 - 20 // BLOCK_SIZE, "ceil(20 / 4) = 5 blocks, no room to generate"


def test_generation_keeps_decoding_while_embeddings_prefill():
    scheduler, runner = make()
    scheduler.add_job(Job(request_id="g", prompt_token_ids=(1, 2, 3), max_tokens=12))
    outputs = {}
    tick(scheduler, runner, outputs)  # g prefilled and sampled its first token
    for i in range(3):
        scheduler.add_job(pooling(f"e{i}", range(40, 64)))  # 3 chunks each
    run_until_idle(scheduler, runner, outputs)
    busy = [p for p in runner.plans[1:] if p.chunks]
    assert len(busy) == 9 and all(len(p.decode) == 1 for p in busy[:5]), "one chunk per tick, g decodes every tick"
    assert outputs[("g", 0)].finish_reason == "length" and len(outputs[("g", 0)].token_ids) == 12
    assert all(outputs[(f"e{i}", 0)].events[-1].embedding is not None for i in range(3))


def test_a_cancelled_pooling_job_frees_its_blocks_without_a_vector():
    scheduler, runner = make()
    scheduler.add_job(pooling("e", range(30, 50)))
    outputs = {}
    tick(scheduler, runner, outputs)
    scheduler.cancel("e")
    run_until_idle(scheduler, runner, outputs)
    event = outputs[("e", 0)].events[-1]
    assert event.finish_reason == "cancelled" and event.embedding is None
    assert scheduler.budget.num_free_blocks == 64


def test_pooling_needs_max_tokens_0_and_n_1():
    with pytest.raises(ValueError, match="pooling"):
        Job(request_id="x", prompt_token_ids=(1,), max_tokens=1, pooling="mean")
    with pytest.raises(ValueError, match="pooling"):
        Job(request_id="x", prompt_token_ids=(1,), max_tokens=0, pooling="max")


@pytest.mark.parametrize("kind,cached", [("mean", 0), ("last", 16)])
def test_mean_pooling_never_takes_a_prompt_from_the_prefix_cache(kind, cached):
    """Mean pooling sums every position's hidden state, which cached blocks do not recompute;
    last pooling only needs the last token, which is always computed."""
    scheduler, runner = make()
    prompt = list(range(30, 50))  # 20 tokens: 4 full blocks before the last token, 16 positions
    scheduler.add_job(pooling("first", prompt, kind))
    first = run_until_idle(scheduler, runner)[("first", 0)].events[-1]
    scheduler.add_job(pooling("again", prompt, kind))
    again = run_until_idle(scheduler, runner)[("again", 0)].events[-1]
    assert again.num_cached_tokens == cached
    np.testing.assert_allclose(again.embedding, first.embedding)
