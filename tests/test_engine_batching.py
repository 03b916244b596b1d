"""The real engine under the batcher: batching, chunking and cancelling never change tokens."""

import threading

import numpy as np
import pytest

from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
from ferrox_jax.request import GenerationRequest, SamplingParams

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
        engine.submit(GenerationRequest(f"{prefix}{i}", tuple(prompt), max_tokens, sampling_for(i),
                                                ignore_eos=True), col)
    return [col.tokens(f"{prefix}{i}") for i in range(len(jobs))]


def test_16_concurrent_greedy_jobs_equal_each_alone(engine):
    jobs = _jobs(16, seed=0)
    greedy = lambda i: SamplingParams(temperature=0.0)
    together = _run(engine, jobs, greedy, "g")
    alone = [_run(engine, [job], greedy, f"a{i}-")[0] for i, job in enumerate(jobs)]
    assert [len(t) for t in together] == [m for _, m in jobs], "each job produced max_tokens tokens"
    assert together == alone, "batching changed greedy tokens"
    assert engine.stats().recompiles_after_warmup == 0


def test_8_seeded_sampled_jobs_equal_each_alone(engine):
    jobs = _jobs(8, seed=1)
    sampled = lambda i: SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i)
    together = _run(engine, jobs, sampled, "s")
    alone = [_run(engine, [job], lambda _, i=i: sampled(i), f"sa{i}-")[0] for i, job in enumerate(jobs)]
    assert together == alone, "batching changed seeded samples"


def test_prefill_chunk_size_never_changes_tokens(tiny_llama, engine):
    jobs = _jobs(4, seed=2) + [(list(range(5, 205)), 8)]  # one 200-token prompt: many chunks
    greedy = lambda i: SamplingParams(temperature=0.0)
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
    greedy = lambda i: SamplingParams(temperature=0.0)
    reference = _run(engine, jobs, greedy, "r")
    col = Collector()
    for i in range(4):
        col.expect(f"x{i}")
    for i, (prompt, max_tokens) in enumerate(jobs):
        engine.submit(GenerationRequest(f"x{i}", tuple(prompt), max_tokens, greedy(i), ignore_eos=True), col)
    engine.cancel("x1")
    assert col.finish_reason("x1") == "cancelled"
    for i in (0, 2, 3):
        assert col.tokens(f"x{i}") == reference[i], f"row {i} changed when its neighbour was cancelled"
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "blocks returned once idle"
