"""The host KV tier under a model with sliding-window layers: a tiny Gemma-3-shaped checkpoint
(five sliding layers of window 8 to one full, blocks of 4) with a small device cache and a host
tier (`--kv-offload-gib`). With the tier on, the sliding layers' arrays hold every block
(`kv_groups.window_plan`: one pool, the sliding group's accounting beside it), so a block saved
to host memory carries every layer's K/V, the sliding ones included, and a host hit restores
the window the first computed position sees: the window group's part of the copy is real, and
a replay served from the host equals the first, cold pass (and HF float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from ferrox_jax import LLM, SamplingParams
from ferrox_jax.kv_offload import HostKVPool
from tests.support import family_checks as fc

WINDOW, BS, SLIDING = 8, 4, 5


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=32, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * SLIDING + ["full_attention"], rope_theta=1_000_000.0)
    config.architectures = ["Gemma3ForCausalLM"]
    path = fc.make_checkpoint(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3-tier", config)
    return path, fc.hf_model(path)


@pytest.fixture(scope="module")
def llm(gemma3):
    with LLM(str(gemma3[0]), dtype="float32", quantization="none", block_size=BS, max_seqs=2, prefill_chunk=16,
             kv_blocks=32, max_context=96, kv_offload_gib=0.0003) as offline:
        yield offline


def greedy(llm, prompt, max_tokens=6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    out, = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    ids = out.outputs[0].token_ids
    return ids, np.asarray([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, ids)]), out.num_cached_tokens


def prompt(seed, n):
    return np.random.RandomState(seed).randint(0, 300, n).tolist()


def replay_from_the_host(llm, seed):
    """A 42-token prompt cold, 4 others of 42 that push its blocks out of the device, then
    the same prompt again: (first pass, replay) as (tokens, logprobs, cached tokens)."""
    p = prompt(seed, 42)
    first = greedy(llm, p)
    for i in range(4):
        greedy(llm, prompt(seed + 1 + i, 42))
    return p, first, greedy(llm, p)


def test_a_replay_from_the_host_tier_equals_the_cold_pass_and_hf(llm, gemma3):
    before = llm.engine.stats()
    p, (ids, lp, cached), (ids2, lp2, cached2) = replay_from_the_host(llm, 10)
    after = llm.engine.stats()
    err = float(np.abs(lp - lp2).max()) if ids == ids2 else np.inf
    print(f"gemma3 sliding layers, replay from the host tier vs cold: cached {cached2}, max |Δlogprob| {err:.2e}")
    assert cached == 0 and cached2 == 40, "the replay takes its 10 full blocks before the last token"
    assert after.prefix_cache_hits_host - before.prefix_cache_hits_host == 40, "every block from host memory"
    assert ids == ids2 and err < 1e-5, f"a replay from the host tier differs from its cold pass by {err:.3g}"
    with torch.no_grad():
        ref = torch.log_softmax(gemma3[1](torch.tensor([p + ids2])).logits[0].float(), -1).numpy()
    want = ref[len(p) - 1:-1]
    assert ids2 == want.argmax(-1).tolist()
    assert np.abs(lp2 - want[np.arange(len(ids2)), ids2]).max() < 1e-4, "the replay differs from HF float32"
    blocks = llm.engine._batcher._scheduler.blocks
    assert blocks.window is not None and blocks.window.num_held == 0, "the window group's accounting is back to 0"
    assert after.kv_blocks_free == after.kv_blocks_total and after.recompiles_after_warmup == 0


def test_negative_control_restoring_only_the_full_layers_fails(llm, monkeypatch):
    # a tier that offloads only the full-attention group: the restored blocks' sliding K/V is
    # zeros, and the first computed positions' windows read it
    get = HostKVPool.get

    def full_group_only(self, slots, width):
        k, v = get(self, slots, width)
        k[:SLIDING], v[:SLIDING] = 0, 0
        return k, v

    monkeypatch.setattr(HostKVPool, "get", full_group_only)
    _, (ids, lp, _), (ids2, lp2, cached2) = replay_from_the_host(llm, 20)
    err = float(np.abs(lp - lp2).max()) if ids == ids2 else np.inf
    print(f"gemma3 replay restoring only the full layers: cached {cached2}, max |Δlogprob| {err:.2e}")
    assert cached2 == 40 and err > 1e-3, f"sliding K/V missing from the restore went unnoticed ({err:.3g})"
