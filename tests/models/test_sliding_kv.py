"""The sliding-window layers' own KV pool (ferrox_jax/kv_groups.py) on a tiny Gemma-3-shaped
checkpoint: five sliding layers (window 16) to one full, blocks of 8, rows generating past
several windows against HF float32, through the whole engine (scheduler, pool, window
tables, the smaller sliding arrays)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from ferrox_jax import LLM, SamplingParams
from ferrox_jax.plan import RowPlan
from tests.support import family_checks as fc

WINDOW, BS, MAX_SEQS, CHUNK = 16, 8, 4, 16
CAP = -(-(WINDOW - 1 + CHUNK) // BS) + 1  # slots a row's table holds at most: 5
SLOTS = 2 * MAX_SEQS * CAP  # with prefix caching: as many again for finished rows' windows


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=32, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], rope_theta=1_000_000.0)
    config.architectures = ["Gemma3ForCausalLM"]
    path = fc.make_checkpoint(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3-5to1", config)
    return path, fc.hf_model(path)


@pytest.fixture(scope="module")
def llm(gemma3):
    with LLM(str(gemma3[0]), dtype="float32", quantization="none", block_size=BS, max_seqs=MAX_SEQS,
             prefill_chunk=CHUNK, kv_blocks=96, max_context=160) as offline:
        yield offline


def engine(llm):
    return llm._engine


def greedy(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def hf_logprobs(hf, tokens):
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def prompt(seed, n):
    return np.random.RandomState(seed).randint(0, 300, n).tolist()


def test_the_sliding_layers_hold_a_pool_of_their_own(llm):
    eng = engine(llm)
    stats = eng.stats()
    assert stats.kv_window_slots_total == SLOTS, "the pool: each row's cap, twice with prefix caching"
    assert eng.sizing.window_blocks == SLOTS + 1
    blocks = [a.shape[1] for a in eng._device.kv_cache.k]
    assert blocks == [SLOTS + 1] * 5 + [97], "sliding arrays sized to the pool, the full one to the blocks"
    assert eng._device.kv_cache.nbytes == eng.sizing.kv_bytes == eng.describe()["kv_bytes"], (
        "the sizing's bytes (what /v1/cache/status and the memory plan report) are the arrays' bytes")


def test_past_several_windows_matches_hf_float32(llm, gemma3):
    hf = gemma3[1]
    p = prompt(0, 37)
    (tokens, logprobs), = greedy(llm, [p], 70)  # 107 positions: more than six windows
    ref = hf_logprobs(hf, p + tokens)
    want = ref[len(p) - 1:-1]
    assert tokens == want.argmax(-1).tolist(), "greedy tokens differ from HF's"
    err = np.abs(np.asarray(logprobs) - want[np.arange(len(tokens)), tokens]).max()
    assert err < 1e-4, f"chosen-token logprobs differ from HF float32 by {err:.3g}"
    stats = engine(llm).stats()
    assert stats.kv_window_blocks_passed > 0, "no block fell behind the window"
    assert 0 < stats.kv_window_slots_peak <= CAP


def test_batched_equals_alone(llm):
    prompts = [prompt(1, 45), prompt(2, 23), prompt(3, 60)]
    batched = greedy(llm, prompts, 40)
    for p, (tokens, logprobs) in zip(prompts, batched):
        (alone_tokens, alone_logprobs), = greedy(llm, [p], 40)
        assert alone_tokens == tokens
        assert np.abs(np.asarray(alone_logprobs) - logprobs).max() < 1e-5


def test_a_prefix_hit_equals_cold(llm):
    p = prompt(7, 45)
    (cold_tokens, cold_logprobs), = greedy(llm, [p], 30)
    before = engine(llm).stats().prefix_cache_hits
    (warm_tokens, warm_logprobs), = greedy(llm, [p], 30)
    assert engine(llm).stats().prefix_cache_hits - before == 40, "the 5 full prompt blocks should be a hit"
    assert warm_tokens == cold_tokens
    assert np.abs(np.asarray(warm_logprobs) - cold_logprobs).max() < 1e-5


def test_n_rows_copy_the_shared_blocks_slots_on_write(llm):
    """n = 2 greedy: both rows share the prompt's partly filled last block and its slot; the
    first to write copies both (a missing slot copy would leave that row's window empty)."""
    p = prompt(8, 45)
    (tokens, logprobs), = greedy(llm, [p], 30)
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True, logprobs=5)
    out, = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    for choice in out.outputs:
        assert choice.token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(choice.logprobs, choice.token_ids)]
        assert np.abs(np.asarray(got) - logprobs).max() < 1e-5


def test_nothing_leaks_and_every_slot_comes_back(llm):
    greedy(llm, [prompt(4, 30), prompt(5, 50)], 50)
    stats = engine(llm).stats()
    assert stats.kv_window_slots_held == 0 and stats.kv_window_slots_free == stats.kv_window_slots_total
    assert stats.kv_blocks_free == stats.kv_blocks_total
    blocks = engine(llm)._batcher._scheduler.blocks
    blocks.window.check([])
    blocks.budget.check()


def test_negative_control_a_window_one_block_short_changes_the_logits(gemma3):
    """Runner level: the query at position 40 sees keys 25..40 (blocks 3..5). Its table with
    block 2 dropped (what the pool does) gives the logits of the full mapping; dropping block
    3 as well (a window off by one block) changes them."""
    from ferrox_jax.runner import ModelRunner
    from models.loader import load_checkpoint

    ckpt = load_checkpoint(str(gemma3[0]))
    runner = ModelRunner(ckpt.model, num_blocks=64, block_size=BS, max_rows=4, max_chunk_tokens=48, max_context=128,
                         window_blocks=16)
    p = prompt(6, 41)
    blocks = list(range(1, 7))
    slots = {b: b + 8 for b in blocks}  # slots 9..14
    runner.run_logits([RowPlan(row_id=0, token_ids=tuple(p[:40]), start_pos=0, block_ids=tuple(blocks), sample=False)],
                      slots)

    def decode(mapping):
        row = RowPlan(row_id=0, token_ids=(p[40],), start_pos=40, block_ids=tuple(blocks), sample=False)
        return runner.run_logits([row], mapping)[0][-1]

    full = decode(slots)
    freed = decode({b: s for b, s in slots.items() if b > 3})  # indices 0..2 (ids 1..3): behind the window
    too_early = decode({b: s for b, s in slots.items() if b > 4})  # index 3 (id 4) dropped too: keys 25..31 lost
    assert np.abs(freed - full).max() < 1e-6, "dropping the blocks behind the window must change nothing"
    assert np.abs(too_early - full).max() > 1e-3, "a window one block short must change the logits"


def test_sleep_forgets_the_parked_windows_and_wake_computes_the_same(llm):
    eng = engine(llm)
    p = prompt(9, 45)
    (tokens, logprobs), = greedy(llm, [p], 30)
    assert eng.stats().kv_window_slots_parked > 0
    assert eng.sleep().result(60) == 1 and eng.wake().result(60) is None
    pool = eng._batcher._scheduler.blocks.window
    assert pool.num_parked == 0 and pool.num_held == 0, "the cache's contents are gone: so are the parked slots"
    before = eng.stats().prefix_cache_hits
    (again, again_logprobs), = greedy(llm, [p], 30)
    assert eng.stats().prefix_cache_hits == before, "after sleep the prompt is computed again"
    assert again == tokens and np.abs(np.asarray(again_logprobs) - logprobs).max() < 1e-5
    assert eng.stats().recompiles_after_warmup == 0
