"""Prefix caching and n > 1 for a model with recurrent state, through the whole engine: a tiny
random Qwen3.5 (transformers 5.25, DeltaNet + gated attention layers, as
tests/models/test_family_qwen3_5.py builds it) served with prefix caching on (state snapshots,
ferrox_jax/state_snapshots.py) against the same checkpoint with it off (every prompt cold).

Blocks of 4: a shared prefix X of 12 tokens is 3 blocks. A = X + 3 tokens has its snapshot at
floor((15 - 1) / 4) * 4 = 12, the end of X; B = X + 9 other tokens then hits X's 3 blocks and
restores that snapshot, computing only its own 9 tokens.

Snapshots every 3 blocks (`state_snapshot_interval`, the 12 tokens of X) and at each row's
latest block while it decodes: a system prompt S of 3 blocks followed by one question leaves a
snapshot at 12 that a prompt with S and another question hits, and a chat's second turn (turn
1's prompt, its reply, a new message) hits turn 1's last full block, past its prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from ferrox_jax import LLM, SamplingParams
from ferrox_jax.request import derive_row_seed
from ferrox_jax.state_pool import StatePool
from ferrox_jax.state_snapshots import RecurrentGroup
from tests.support import family_checks as fc

BS, PREFIX = 4, 12
SETTINGS = dict(dtype="float32", quantization="none", block_size=BS, max_seqs=2, prefill_chunk=16,
                max_context=96, kv_blocks=48, state_snapshot_interval=PREFIX // BS)
TOL = 1e-5  # the same float32 forward over the same tokens; only the chunking differs (a hit starts at 12)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return fc.make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def warm(checkpoint):
    with LLM(str(checkpoint), **SETTINGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def cold(checkpoint):
    with LLM(str(checkpoint), prefix_caching=False, **SETTINGS) as llm:
        yield llm


def tokens(seed, n):
    return np.random.RandomState(seed).randint(0, 250, n).tolist()


def generate(llm, prompt, max_tokens=8, **params):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1, **{"temperature": 0, **params})
    out, = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return [(c.token_ids, np.asarray([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
            for c in out.outputs], out.num_cached_tokens


def hit_against_cold(warm, cold, seed, before_b=lambda: None):
    """(warm B's tokens, |warm - cold| logprobs, B's cached tokens, cold's tokens): A first,
    then `before_b()` (a negative control's patch), then B."""
    x = tokens(seed, PREFIX)
    b = x + tokens(seed + 1, 9)
    [(cold_tokens, cold_lp)], _ = generate(cold, b)
    generate(warm, x + tokens(seed + 2, 3), max_tokens=2)  # A: its snapshot at 12
    before_b()
    [(warm_tokens, warm_lp)], cached = generate(warm, b)
    return warm_tokens, float(np.abs(warm_lp - cold_lp).max()), cached, cold_tokens


def test_a_prefix_hit_restores_the_snapshot_and_equals_cold(warm, cold):
    before = warm.engine.stats()
    warm_tokens, err, cached, cold_tokens = hit_against_cold(warm, cold, 0)
    after = warm.engine.stats()
    assert cached == PREFIX and after.prefix_cache_hits - before.prefix_cache_hits == PREFIX, "B hits X's 3 blocks"
    assert after.state_snapshots_restored - before.state_snapshots_restored == 1
    print(f"qwen3_5 prefix hit vs cold: max |Δlogprob| {err:.2e}")
    assert warm_tokens == cold_tokens, "greedy tokens differ between a hit and cold"
    assert err < TOL, f"a hit's logprobs differ from cold by {err:.3g}"


def test_admin_stats_and_metrics_show_the_hit_and_the_snapshot_slots(warm):
    import httpx

    from api.app import create_app
    from tests.support.server_harness import ServerThread

    x = tokens(40, PREFIX)
    generate(warm, x + tokens(41, 3), max_tokens=2)
    with ServerThread(create_app(warm.engine)) as base, httpx.Client(base_url=base, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        before = http.get("/admin/stats").json()
        reply = http.post("/v1/completions", json={"model": model, "prompt": x + tokens(42, 5), "max_tokens": 2,
                                                   "temperature": 0})
        assert reply.status_code == 200
        stats = http.get("/admin/stats").json()
        assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == PREFIX, "cached tokens > 0"
        assert stats["state_snapshots_restored"] == before["state_snapshots_restored"] + 1
        # max_seqs 2: 2 running slots, 4 snapshot slots (two per row); every snapshot sits with a cached block
        assert stats["state_slots_total"] == 2 and stats["state_snapshot_slots_total"] == 4
        assert 0 < stats["state_snapshot_slots_held"] <= 4 and stats["state_slots_held"] == 0
        # per slot 2 DeltaNet layers x (3 x 128 conv + 4 x 16 x 16 recurrent) f32; null + 2 running + 4 snapshots
        assert stats["state_pool_bytes"] == 7 * 2 * (3 * 128 + 4 * 16 * 16) * 4
        metrics = http.get("/metrics").text
        assert "ferrox_state_snapshot_slots_total 4.0" in metrics and "ferrox_state_snapshots_restored" in metrics


def test_negative_control_the_snapshot_one_block_off_fails(warm, cold, monkeypatch):
    # A snapshot at 8 too (A8 = X[:8] + 3 tokens), then the hit at 12 restores the state at 8:
    # the row computes from 12 as if tokens 8..11 had never been seen.
    x = tokens(10, PREFIX)
    generate(warm, x[:8] + tokens(13, 3), max_tokens=2)

    def one_block_off(self, row, hits, host_slot=None):
        if hits:
            self.states.restore(row.row_id, self.snapshots.slot_of[hits[-2]])

    _, err, cached, _ = hit_against_cold(warm, cold, 10,
                                         lambda: monkeypatch.setattr(RecurrentGroup, "restore", one_block_off))
    print(f"qwen3_5 snapshot one block off vs cold: max |Δlogprob| {err:.2e}")
    assert cached == PREFIX
    assert err > 1e-3, f"the state of the wrong boundary went unnoticed ({err:.3g})"


def test_negative_control_a_hit_without_its_state_fails(warm, cold, monkeypatch):
    # No restore: the row reads whatever its running slot last held (another row's state).
    _, err, cached, _ = hit_against_cold(
        warm, cold, 20, lambda: monkeypatch.setattr(StatePool, "restore", lambda self, row_id, slot: None))
    print(f"qwen3_5 hit without its state vs cold: max |Δlogprob| {err:.2e}")
    assert cached == PREFIX
    assert err > 1e-3, f"a hit that restored no state went unnoticed ({err:.3g})"


def n2_against_two_requests(llm):
    prompt = tokens(30, 14)
    params = dict(temperature=0.9, seed=7, max_tokens=10)
    choices, _ = generate(llm, prompt, n=2, **params)
    singles = [generate(llm, prompt, **{**params, "seed": derive_row_seed(7, i)})[0][0] for i in range(2)]
    return max(float(np.abs(c[1] - s[1]).max()) if c[0] == s[0] else np.inf for c, s in zip(choices, singles))


def test_n_2_equals_two_requests_with_its_seeds(warm, cold):
    for llm in (warm, cold):
        err = n2_against_two_requests(llm)
        print(f"qwen3_5 n = 2 vs two requests: max |Δlogprob| {err:.2e}")
        assert err < TOL, f"a choice of n = 2 differs from its own request by {err:.3g}"


def test_negative_control_forked_rows_without_the_prefill_state_fail(cold, monkeypatch):
    monkeypatch.setattr(StatePool, "fork", lambda self, row_id, row_ids: None)
    err = n2_against_two_requests(cold)
    print(f"qwen3_5 n = 2 forked without the state: max |Δlogprob| {err:.2e} (inf: other tokens)")
    assert err > 1e-3, "a row forked without the prefill's state went unnoticed"


def shared_system_prompt(llm, seed):
    """a = S + 7 tokens (snapshots at 12, the end of S, and at its B = 16), then b = S + 9
    other tokens: (b's prompt, its tokens and logprobs, its cached tokens)."""
    system = tokens(seed, PREFIX)
    generate(llm, system + tokens(seed + 1, 7), max_tokens=2)
    b = system + tokens(seed + 2, 9)
    return (b, *generate(llm, b))


def chat(llm, seed):
    """Turn 1: 10 tokens and a 12-token greedy reply (21 computed: full blocks up to 20); then
    turn 2: turn 1, its reply and 5 new tokens. (turn 2's prompt, its tokens and logprobs,
    its cached tokens)."""
    turn1 = tokens(seed, 10)
    [(reply, _)], _ = generate(llm, turn1, max_tokens=12)
    turn2 = turn1 + list(reply) + tokens(seed + 1, 5)
    return (turn2, *generate(llm, turn2))


def against_cold(scenario, llm, cold, seed):
    """(cached tokens, |llm - cold| logprobs, whether the greedy tokens agree): the scenario's
    last request on `llm` after its first ones, against the same prompt on `cold`."""
    prompt, [(ids, lp)], cached = scenario(llm, seed)
    [(cold_ids, cold_lp)], _ = generate(cold, prompt)
    err = float(np.abs(lp - cold_lp).max()) if ids == cold_ids else np.inf
    return cached, err, ids == cold_ids


def test_prompts_sharing_only_a_system_prompt_hit_its_end_and_equal_cold(warm, cold):
    before = warm.engine.stats()
    cached, err, same = against_cold(shared_system_prompt, warm, cold, 200)
    after = warm.engine.stats()
    print(f"qwen3_5 shared system prompt, hit vs cold: cached {cached}, max |Δlogprob| {err:.2e}")
    assert cached == PREFIX, "b hits S's 3 blocks at the interval snapshot ending S"
    assert after.state_snapshots_restored - before.state_snapshots_restored == 1
    assert same and err < TOL, f"a hit on the system prompt differs from cold by {err:.3g}"


def test_a_chats_next_turn_hits_past_its_reply_and_equals_cold(warm, cold):
    before = warm.engine.stats()
    cached, err, same = against_cold(chat, warm, cold, 300)
    after = warm.engine.stats()
    print(f"qwen3_5 chat turn 2, hit vs cold: cached {cached}, max |Δlogprob| {err:.2e}")
    assert cached == 20, "turn 2 hits turn 1's decode snapshot at its last full block, past its 10-token prompt"
    assert after.state_snapshots_restored - before.state_snapshots_restored == 1
    assert same and err < TOL, f"a hit on the previous turn differs from cold by {err:.3g}"
    assert after.recompiles_after_warmup == 0, "the cut chunks and the decode snapshots' copies compiled nothing"


@pytest.mark.parametrize("scenario", [shared_system_prompt, chat])
def test_negative_control_a_snapshot_attached_one_block_off_fails(warm, cold, monkeypatch, scenario):
    # every snapshot attached to the block before the one it ends (a prompt's at 12 to the
    # block ending at 8, a row's at 20 to the one ending at 16): a hit restores the state of
    # a block later than where it starts
    from ferrox_jax import state_snapshots

    monkeypatch.setattr(state_snapshots, "block_index", lambda at, block_size: at // block_size - 2)
    cached, err, _ = against_cold(scenario, warm, cold, 400 + 10 * (scenario is chat))
    print(f"qwen3_5 {scenario.__name__} with snapshots one block off: cached {cached}, max |Δlogprob| {err:.2e}")
    assert cached > 0, "the misplaced snapshot was restored"
    assert err > 1e-3, f"a snapshot one block off went unnoticed ({err:.3g})"


def test_eviction_frees_snapshots_nothing_leaks_and_nothing_recompiles(warm, cold):
    # 48 blocks; each prompt holds 6-7 blocks and caches 4: 12 of them evict the oldest.
    for i in range(12):
        generate(warm, tokens(100 + i, 21), max_tokens=6)
    stats = warm.engine.stats()
    assert stats.state_slots_held == 0 and stats.kv_blocks_free == stats.kv_blocks_total, "a slot or block leaked"
    assert stats.state_snapshots_taken > stats.state_snapshot_slots_total
    blocks = warm.engine._batcher._scheduler.blocks
    blocks.snapshots.check()
    assert all(blocks.cache.is_cached(b) for b in blocks.snapshots.slot_of), "a snapshot outlived its block"
    assert blocks.cache.num_evicted_blocks > 0
    for llm in (warm, cold):
        assert llm.engine.stats().recompiles_after_warmup == 0


def test_chats_under_a_small_budget_evict_and_leak_nothing(warm):
    # each chat holds up to 9 blocks (27 + 8 tokens) and caches 6-7 in 48: the oldest go
    for i in range(8):
        chat(warm, 500 + 10 * i)
    stats = warm.engine.stats()
    blocks = warm.engine._batcher._scheduler.blocks
    snapshots = blocks.snapshots
    snapshots.check()  # every slot free or attached once; every row's decode snapshot has one
    assert all(blocks.cache.is_cached(b) for b in snapshots.slot_of), "a snapshot outlived its block"
    assert snapshots.moving_of == {}, "an ended row still moves a snapshot"
    assert stats.state_slots_held == 0 and stats.kv_blocks_free == stats.kv_blocks_total, "a slot or block leaked"
    assert blocks.cache.num_evicted_blocks > 0 and stats.recompiles_after_warmup == 0


def test_a_prefix_hit_and_n_2_with_speculation_equal_cold(checkpoint, cold):
    """With speculation each slot keeps 1 + k state entries and a position (models/deltanet.py,
    "Speculation"): the snapshot's save and restore and the fork must carry them all, or the
    row reads another entry than its start position names."""
    from ferrox_jax.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    with LLM(str(checkpoint), speculative=spec, **SETTINGS) as llm:
        warm_tokens, err, cached, cold_tokens = hit_against_cold(llm, cold, 7)
        n2_err = n2_against_two_requests(llm)
        # a decode snapshot passed mid-step: the restored row reads the entry after the boundary
        chat_cached, chat_err, chat_same = against_cold(chat, llm, cold, 600)
        stats = llm.engine.stats()
    print(f"qwen3_5 with ngram speculation: hit vs cold {err:.2e}, n = 2 {n2_err:.2e}, "
          f"drafts {stats.spec_decode_num_draft_tokens} (accepted {stats.spec_decode_num_accepted_tokens})")
    assert cached == PREFIX and stats.state_snapshots_restored >= 1, "B hits X's 3 blocks"
    assert stats.spec_decode_num_draft_tokens > 0, "nothing was verified: the entries were never read"
    assert warm_tokens == cold_tokens, "greedy tokens differ between a speculating hit and cold"
    assert err < TOL and n2_err < TOL
    print(f"qwen3_5 with ngram speculation: chat turn 2 cached {chat_cached}, vs cold {chat_err:.2e}")
    assert chat_cached == 20 and chat_same and chat_err < TOL
    assert stats.recompiles_after_warmup == 0 and stats.state_slots_held == 0
