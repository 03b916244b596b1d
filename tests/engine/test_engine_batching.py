"""The real engine under the batcher: batching, chunking and cancelling never change tokens."""

import threading

import numpy as np
import pytest

from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
from ferrox_jax.request import Job, RowSampling

TIMEOUT_S = 120


class Collector:
    """Gathers RowEvents per request id; wait() returns once every row has finished."""

    def __init__(self):
        self.events = {}
        self.done = {}
        self.lock = threading.Lock()

    def expect(self, request_id, n=1):
        self.events[request_id] = []
        self.done[request_id] = (threading.Event(), n)

    def __call__(self, event):
        with self.lock:
            self.events[event.request_id].append(event)
            finished = sum(1 for e in self.events[event.request_id] if e.finish_reason)
        flag, n = self.done[event.request_id]
        if finished == n:
            flag.set()

    def tokens(self, request_id, index=0):
        assert self.done[request_id][0].wait(TIMEOUT_S), f"{request_id} did not finish"
        return [t for e in self.events[request_id] if e.index == index for t in e.token_ids]

    def finish_reason(self, request_id, index=0):
        self.done[request_id][0].wait(TIMEOUT_S)
        return [e.finish_reason for e in self.events[request_id] if e.index == index and e.finish_reason][0]


def _engine(path, prefill_chunk=32, max_seqs=16):
    engine = Engine.load(EngineConfig(model=str(path), block_size=8, kv_blocks=400, max_context=256,
                                      prefill_chunk=prefill_chunk, max_seqs=max_seqs))
    engine.warmup()
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    e = _engine(tiny_llama)
    yield e
    e.shutdown()


def _jobs(count, seed):
    rng = np.random.RandomState(seed)
    return [(rng.randint(3, 300, rng.randint(1, 90)).tolist(), int(rng.randint(1, 40))) for _ in range(count)]


def _run(engine, jobs, sampling_for, prefix):
    col = Collector()
    for i, (prompt, max_tokens) in enumerate(jobs):
        col.expect(f"{prefix}{i}")
    for i, (prompt, max_tokens) in enumerate(jobs):
        engine.submit(Job(f"{prefix}{i}", tuple(prompt), max_tokens, sampling_for(i),
                                  ignore_eos=True), col)
    return [col.tokens(f"{prefix}{i}") for i in range(len(jobs))]


def test_16_concurrent_greedy_jobs_equal_each_alone(engine):
    jobs = _jobs(16, seed=0)
    greedy = lambda i: RowSampling(temperature=0.0)
    together = _run(engine, jobs, greedy, "g")
    alone = [_run(engine, [job], greedy, f"a{i}-")[0] for i, job in enumerate(jobs)]
    assert [len(t) for t in together] == [m for _, m in jobs], "each job produced max_tokens tokens"
    assert together == alone, "batching changed greedy tokens"
    assert engine.stats().recompiles_after_warmup == 0


def test_8_seeded_sampled_jobs_equal_each_alone(engine):
    jobs = _jobs(8, seed=1)
    sampled = lambda i: RowSampling(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i)
    together = _run(engine, jobs, sampled, "s")
    alone = [_run(engine, [job], lambda _, i=i: sampled(i), f"sa{i}-")[0] for i, job in enumerate(jobs)]
    assert together == alone, "batching changed seeded samples"


def test_prefill_chunk_size_never_changes_tokens(tiny_llama, engine):
    jobs = _jobs(4, seed=2) + [(list(range(5, 205)), 8)]  # one 200-token prompt: many chunks
    greedy = lambda i: RowSampling(temperature=0.0)
    reference = _run(engine, jobs, greedy, "c32-")
    for chunk in (1, 7, 128):
        e = _engine(tiny_llama, prefill_chunk=chunk)
        try:
            assert _run(e, jobs, greedy, f"c{chunk}-") == reference, f"chunk size {chunk} changed tokens"
        finally:
            e.shutdown()


def test_cancelled_neighbour_leaves_other_rows_bit_identical(engine):
    jobs = _jobs(4, seed=3)
    jobs = [(p, 30) for p, _ in jobs]
    greedy = lambda i: RowSampling(temperature=0.0)
    reference = _run(engine, jobs, greedy, "r")
    col = Collector()
    for i in range(4):
        col.expect(f"x{i}")
    for i, (prompt, max_tokens) in enumerate(jobs):
        engine.submit(Job(f"x{i}", tuple(prompt), max_tokens, greedy(i), ignore_eos=True), col)
    engine.cancel("x1")
    assert col.finish_reason("x1") == "cancelled"
    for i in (0, 2, 3):
        assert col.tokens(f"x{i}") == reference[i], f"row {i} changed when its neighbour was cancelled"
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "blocks returned once idle"


# -- prefix caching: a hit changes nothing but speed ----------------------------------

@pytest.fixture(scope="module")
def uncached(tiny_llama):
    e = Engine.load(EngineConfig(model=str(tiny_llama), block_size=8, kv_blocks=400, max_context=256,
                                 prefill_chunk=32, max_seqs=16, prefix_caching=False))
    e.warmup()
    e.start()
    yield e
    e.shutdown()


def _run_logprobs(engine, prompts, prefix, max_tokens=12, n=1):
    """Greedy (n = 1) or seeded (n > 1) tokens and chosen-token logprobs of each prompt, run together."""
    col = Collector()
    sampling = RowSampling(temperature=0.0 if n == 1 else 0.8, seed=5, logprobs=1)
    for i, prompt in enumerate(prompts):
        col.expect(f"{prefix}{i}", n)
    for i, prompt in enumerate(prompts):
        engine.submit(Job(f"{prefix}{i}", tuple(prompt), max_tokens, sampling, n=n,
                          ignore_eos=True), col)
    out = []
    for i in range(len(prompts)):
        col.tokens(f"{prefix}{i}")  # waits
        events = col.events[f"{prefix}{i}"]
        for index in range(n):
            mine = [e for e in events if e.index == index]
            out.append(([t for e in mine for t in e.token_ids], [lp.logprob for e in mine for lp in e.logprobs],
                        mine[0].num_cached_tokens))
    return out


SHARED = list(range(7, 47))  # 40 tokens: 5 blocks of 8


def test_cache_hits_change_nothing_but_speed_alone_and_batched(engine, uncached):
    # logprobs: the hit's K/V was computed in other chunks, so sums run in another order:
    # float32 noise, atol 1e-4 on logprobs of a 2-layer model.
    warm = _run_logprobs(engine, [SHARED + [300, 301]], "warm")
    assert warm[0][2] == 0, "a cold prompt computes everything"
    cases = {
        "same prompt": [SHARED + [300, 301]],  # 42 tokens: 5 blocks hit, 2 tokens computed
        "whole prompt cached": [SHARED],  # 40 tokens, all cached: 4 blocks hit, the last recomputed
        "prefix of a cached prompt": [SHARED[:20]],  # 2 blocks hit
        "batched": [SHARED + [200 + i] * (i + 1) for i in range(6)],  # 6 prompts on one prefix
    }
    for name, prompts in cases.items():
        got = _run_logprobs(engine, prompts, f"hit-{name}-")
        expected = _run_logprobs(uncached, prompts, f"ref-{name}-")
        for (tokens, logprobs, cached), (ref_tokens, ref_logprobs, ref_cached) in zip(got, expected):
            assert ref_cached == 0 and cached > 0, f"{name}: a hit on one engine only"
            assert tokens == ref_tokens, f"{name}: a cache hit changed greedy tokens"
            np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4, err_msg=f"{name}: logprobs")
    assert [c for _, _, c in _run_logprobs(engine, [SHARED], "again-")] == [32], (
        "the blocks wholly before the last prompt token: (40 - 1) // 8 = 4")
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.kv_blocks_cached > 0, (
        "idle: cached blocks are resident and count as free")
    assert stats.recompiles_after_warmup == 0


def test_n_rows_on_a_cached_prompt_sample_as_without_the_cache(engine, uncached):
    prompt = SHARED + [250, 251, 252]
    _run_logprobs(engine, [prompt], "n-warm-")
    got = _run_logprobs(engine, [prompt], "n-hit-", n=3)
    expected = _run_logprobs(uncached, [prompt], "n-ref-", n=3)
    assert [t for t, _, _ in got] == [t for t, _, _ in expected], "seeded rows sample the same tokens"
    assert all(c == 40 for _, _, c in got), "the rows' shared prefill came from the cache"
