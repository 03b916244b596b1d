"""Sleep and wake on a model with recurrent state: a tiny random Qwen3.5 (as
tests/models/test_state_prefix_qwen3_5.py serves it, prefix caching on, blocks of 4).

Sleeping frees the KV cache, which carries the state pool (`KVCache.states`: the running
slots and the prefix cache's snapshot slots), and waking makes it again as zeros
(ferrox_jax/sleep.py). So the prefix cache must forget every block and every snapshot with
it: after a sleep nothing is held (no snapshot, no state slot, no cached block, the
bookkeeping's invariants hold), a prompt whose prefix was cached before comes back cold (0
cached tokens) and equal to its cold reply before the sleep, and the snapshots taken after
the wake serve hits equal to cold. Negative control: a sleep that kept the cache serves a
hit from the zeroed snapshot, and its reply differs from cold.

X is a 12-token prefix (3 blocks); A = X + 3 tokens keeps its snapshot at floor(14 / 4) * 4
= 12, B = X + 9 tokens at 20.
"""

from __future__ import annotations

import numpy as np
import pytest

from ferrox_jax import LLM, SamplingParams
from ferrox_jax.block_budget import BlockBudget
from tests.support import family_checks as fc

BS, PREFIX = 4, 12
SETTINGS = dict(dtype="float32", quantization="none", block_size=BS, max_seqs=2, prefill_chunk=16,
                max_context=96, kv_blocks=48)
TOL = 1e-5  # the same float32 forward over the same tokens; only the chunking differs (a hit starts at 20)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = fc.make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5")
    with LLM(str(path), **SETTINGS) as llm:
        yield llm


def tokens(seed, n):
    return np.random.RandomState(seed).randint(0, 250, n).tolist()


def generate(llm, prompt, max_tokens=8):
    """(greedy tokens, their logprobs, cached prompt tokens)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1, temperature=0)
    out, = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    choice = out.outputs[0]
    return choice.token_ids, np.asarray([lp[t].logprob for lp, t in zip(choice.logprobs, choice.token_ids)]), \
        out.num_cached_tokens


def sleep_and_wake(llm, level=1):
    assert llm.engine.sleep(level).result(120) == level
    blocks = llm.engine._batcher._scheduler.blocks  # the owner thread is idle: nothing moves under the reads
    held = (blocks.snapshots.num_held, blocks.states.num_held, blocks.num_cached_blocks)
    blocks.snapshots.check()
    blocks.budget.check()
    llm.engine.wake().result(120)
    return held


def test_sleep_drops_every_snapshot_and_a_hit_after_wake_equals_cold(llm):
    x = tokens(0, PREFIX)
    a, b = x + tokens(1, 3), x + tokens(2, 9)
    a_cold, a_lp, cached = generate(llm, a, max_tokens=2)
    assert cached == 0 and llm.engine._batcher._scheduler.blocks.snapshots.num_held > 0, "A's snapshot at 12"
    # level 2 moves the weights to host memory too; the pool is in the cache either way
    assert sleep_and_wake(llm, level=2) == (0, 0, 0), "(snapshots, state slots, cached blocks) after sleep"
    b_cold, b_cold_lp, cached = generate(llm, b)
    assert cached == 0, "X's blocks and A's snapshot went with the sleep: B is computed cold"
    a_again, a_again_lp, cached = generate(llm, a, max_tokens=2)
    assert cached == 0, "B's snapshot is at 20, none at 12: A is cold too"
    assert a_again == a_cold and float(np.abs(a_again_lp - a_lp).max()) < TOL, "cold after the wake == before"
    before = llm.engine.stats()
    b_hit, b_hit_lp, cached = generate(llm, b)
    assert cached == 20, "B hits its own 5 blocks, restoring the snapshot taken after the wake"
    assert llm.engine.stats().state_snapshots_restored == before.state_snapshots_restored + 1
    err = float(np.abs(b_hit_lp - b_cold_lp).max())
    print(f"qwen3_5 prefix hit after a sleep and wake vs cold: max |Δlogprob| {err:.2e}")
    assert b_hit == b_cold and err < TOL, f"a hit after the wake differs from cold by {err:.3g}"


def test_negative_control_a_sleep_that_keeps_the_cache_serves_a_wrong_hit(llm, monkeypatch):
    y = tokens(10, PREFIX)
    a, b = y + tokens(11, 3), y + tokens(12, 9)
    generate(llm, a, max_tokens=2)  # its snapshot at 12
    monkeypatch.setattr(BlockBudget, "forget_cached_blocks", lambda self: 0)
    assert sleep_and_wake(llm)[0] > 0, "the snapshot outlived the sleep"
    wrong, wrong_lp, cached = generate(llm, b)
    assert cached == PREFIX, "B hit X's blocks and the zeroed snapshot"
    monkeypatch.undo()
    assert sleep_and_wake(llm) == (0, 0, 0)
    cold, cold_lp, cached = generate(llm, b)
    assert cached == 0
    err = np.inf if wrong != cold else float(np.abs(wrong_lp - cold_lp).max())
    print(f"qwen3_5 hit on a snapshot kept across sleep vs cold: max |Δlogprob| {err:.2e} (inf: other tokens)")
    assert err > 1e-3, "a hit on state zeroed by the sleep went unnoticed"
