"""The host KV tier for a model with recurrent state, through the whole engine: a tiny random
Qwen3.5 (tests/support/family_checks.py) served with a small device cache and a host tier
(`--kv-offload-gib`), whose snapshots the device drops go to host memory beside its blocks
(ferrox_jax/kv_offload.py, "Snapshots"), against the same checkpoint with prefix caching off.

A chat's first turn (10 tokens, a 12-token reply: its decode snapshot at 20), then other
prompts until its blocks and snapshot have left the device, then its second turn: served
from the host tier (blocks and state), it must equal cold.
"""

from __future__ import annotations

import numpy as np
import pytest

from ferrox_jax import LLM
from ferrox_jax.kv_offload import HostTier, host_tier_snapshots
from tests.models.test_state_prefix_qwen3_5 import TOL, generate, tokens
from tests.support import family_checks as fc

BS = 4
SETTINGS = dict(dtype="float32", quantization="none", block_size=BS, max_seqs=2, prefill_chunk=16,
                max_context=96, state_snapshot_interval=3)
TIER = dict(kv_blocks=24, kv_offload_gib=0.0004)  # 23 device blocks; the host: 74 blocks, 11 snapshots


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return fc.make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def tiered(checkpoint):
    with LLM(str(checkpoint), **SETTINGS, **TIER) as llm:
        yield llm


@pytest.fixture(scope="module")
def cold(checkpoint):
    with LLM(str(checkpoint), prefix_caching=False, kv_blocks=48, **SETTINGS) as llm:
        yield llm


def chat_from_the_host(llm, seed, churn=4):
    """Turn 1, `churn` prompts of 25 tokens (7-8 blocks each) pushing it out of the device
    (4 do: asserted), turn 2: (turn 2's prompt, its tokens and logprobs, its cached tokens)."""
    turn1 = tokens(seed, 10)
    [(reply, _)], _ = generate(llm, turn1, max_tokens=12)
    for i in range(churn):
        generate(llm, tokens(seed + 10 + i, 25), max_tokens=4)
    cache = llm.engine._batcher._scheduler.blocks.cache
    assert churn < 4 or not cache.lookup(chain(turn1 + list(reply), cache.root)[:1]), "turn 1 left the device"
    turn2 = turn1 + list(reply) + tokens(seed + 1, 5)
    return (turn2, *generate(llm, turn2))


def chain(ids, root):
    from ferrox_jax.prefix_cache import chain_hashes

    return chain_hashes(ids, BS, root)


def against_cold(llm, cold, seed):
    before = llm.engine.stats()
    prompt, [(ids, lp)], cached = chat_from_the_host(llm, seed)
    after = llm.engine.stats()
    [(cold_ids, cold_lp)], _ = generate(cold, prompt)
    err = float(np.abs(lp - cold_lp).max()) if ids == cold_ids else np.inf
    return cached, err, ids == cold_ids, before, after


def test_a_chats_turn_from_the_host_tier_equals_cold(tiered, cold):
    cached, err, same, before, after = against_cold(tiered, cold, 700)
    print(f"qwen3_5 chat turn 2 from the host tier vs cold: cached {cached}, max |Δlogprob| {err:.2e}")
    assert cached == 20, "turn 2 hits turn 1's decode snapshot at 20, from host memory"
    assert after.prefix_cache_hits_host - before.prefix_cache_hits_host == 20, "all 5 blocks came from the host"
    assert after.kv_offload_snapshots_restored - before.kv_offload_snapshots_restored == 1
    assert after.kv_offload_snapshots_stored > before.kv_offload_snapshots_stored
    assert same and err < TOL, f"a hit from the host tier differs from cold by {err:.3g}"
    # a snapshot: 2 DeltaNet layers' conv (3 x 128) and recurrent (4 x 16 x 16) f32 states; the
    # tier's bytes split between blocks and snapshots as the device cache splits its own
    limits = tiered.engine._batcher._scheduler.limits
    snapshot = 2 * (3 * 128 + 4 * 16 * 16) * 4
    assert after.kv_offload_snapshot_bytes == snapshot and after.kv_offload_snapshots_total == host_tier_snapshots(
        TIER["kv_offload_gib"], limits.kv_bytes_per_block, snapshot, limits.num_blocks, limits.state_snapshots)
    assert after.recompiles_after_warmup == 0, "the host copies were compiled at warm-up"


def other_snapshot(self, name):
    """The tier's snapshot lookup answering with another snapshot than `name`'s."""
    slot = self._snapshot_by_name.get(name)
    others = [s for s in self._name_by_snapshot if s != slot]
    return None if slot is None else (others[-1] if others else slot)


def test_negative_control_restoring_another_host_snapshot_fails(tiered, cold, monkeypatch):
    monkeypatch.setattr(HostTier, "snapshot_slot", other_snapshot)
    cached, err, _, before, after = against_cold(tiered, cold, 800)
    print(f"qwen3_5 turn 2 restoring another host snapshot: cached {cached}, max |Δlogprob| {err:.2e}")
    assert cached == 20 and after.kv_offload_snapshots_restored > before.kv_offload_snapshots_restored
    assert err > 1e-3, f"a wrong host snapshot went unnoticed ({err:.3g})"


def test_eight_chats_under_small_budgets_leak_nothing_and_compile_nothing(tiered):
    for i in range(8):
        chat_from_the_host(tiered, 900 + 10 * i, churn=2)
    stats = tiered.engine.stats()
    blocks = tiered.engine._batcher._scheduler.blocks
    blocks.snapshots.check()
    blocks.tier.check()
    assert not +blocks.tier._snapshot_pins and not +blocks.tier._pins, "a host slot is still pinned"
    assert stats.state_slots_held == 0 and stats.kv_blocks_free == stats.kv_blocks_total, "a slot or block leaked"
    assert stats.kv_offload_snapshots_cached <= stats.kv_offload_snapshots_total
    assert stats.kv_offload_snapshots_restored > 0 and stats.recompiles_after_warmup == 0


def test_with_speculation_a_turn_from_the_host_tier_equals_cold(checkpoint, cold):
    """With speculation a slot keeps 1 + k state entries and a position (models/deltanet.py,
    "Speculation"): the host snapshot must carry them all, or the restored row reads another
    entry than its start position names."""
    from ferrox_jax.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    with LLM(str(checkpoint), speculative=spec, **SETTINGS, **TIER) as llm:
        cached, err, same, before, after = against_cold(llm, cold, 1000)
    print(f"qwen3_5 with ngram speculation, turn 2 from the host tier vs cold: cached {cached}, "
          f"max |Δlogprob| {err:.2e}, drafts {after.spec_decode_num_draft_tokens}")
    assert cached == 20 and after.kv_offload_snapshots_restored - before.kv_offload_snapshots_restored == 1
    assert after.kv_offload_snapshot_bytes == 4 * 2 * (3 * 128 + 4 * 16 * 16) * 4 + 4, "4 entries and a position"
    assert after.spec_decode_num_draft_tokens > 0, "nothing was verified: the entries were never read"
    # 2e-5: this chat's turn 2 differs from cold by 1.17e-5 with the hit served from the device
    # too (the verification rows' summation order, not the tier); a wrong entry is off by far more
    assert same and err < 2e-5, f"a speculating hit from the host tier differs from cold by {err:.3g}"
    assert after.recompiles_after_warmup == 0 and after.state_slots_held == 0
