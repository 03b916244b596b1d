"""Window-sized KV storage where the sliding group used to be accounting only
(ferrox_jax/kv_groups.py): a tiny Mistral whose every layer slides (window 16, the full
group's block ids logical, no array of their own) and a tiny Gemma 4 whose shared-KV
layers read their source's array through the source's table. Blocks of 8, rows
generating past six windows against HF float32, through the whole engine; the same Mistral
beside a draft model; the Mistral-7B sizing; negative controls at runner level (a window
one block short, a shared layer on the wrong table)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from ferrox_jax import LLM, SamplingParams
from ferrox_jax.kv_cache import model_bytes_per_block
from ferrox_jax.plan import RowPlan
from tests.models.test_family_gemma4 import gemma4_config
from tests.support import family_checks as fc

WINDOW, BS, MAX_SEQS, CHUNK, KV_BLOCKS = 16, 8, 4, 16, 96
CAP = -(-(WINDOW - 1 + CHUNK) // BS) + 1  # slots a row's table holds at most: 5
SLOTS = 2 * MAX_SEQS * CAP  # with prefix caching: as many again for finished rows' windows
# per cache array, whether it holds the pool: Mistral's two layers; Gemma 4's three arrays
# (layers 0 and 1 sliding, 2 full; layers 3 and 4 read arrays 1 and 2)
WINDOWED = {"mistral": [True, True], "gemma4": [True, True, False]}


def _mistral(folder):
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, sliding_window=WINDOW, rope_theta=10000.0)
    config.architectures = ["MistralForCausalLM"]
    return fc.make_checkpoint(folder, config), None


def _gemma4(folder):
    path = fc.make_checkpoint(folder, gemma4_config(sliding_window=WINDOW))
    hf = fc.hf_model(path)
    torch.manual_seed(1)  # layer_scalar is a buffer (ones) the helper does not re-draw
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.layer_scalar.copy_(1.0 + 0.2 * torch.randn_like(layer.layer_scalar))
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


@pytest.fixture(scope="module", params=["mistral", "gemma4"])
def family(request, tmp_path_factory):
    path, hf = {"mistral": _mistral, "gemma4": _gemma4}[request.param](tmp_path_factory.mktemp(request.param) / "tiny")
    hf = hf or fc.hf_model(path)
    with LLM(str(path), dtype="float32", quantization="none", block_size=BS, max_seqs=MAX_SEQS,
             prefill_chunk=CHUNK, kv_blocks=KV_BLOCKS, max_context=160) as llm:
        yield request.param, path, hf, llm


def greedy(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def prompt(seed, n):
    return np.random.RandomState(seed).randint(0, 300, n).tolist()


def test_the_sliding_arrays_hold_the_pool_and_the_sizing_counts_it(family):
    name, _, _, llm = family
    eng = llm._engine
    cfg = eng.model_config
    blocks = [a.shape[1] for a in eng._device.kv_cache.k]
    assert blocks == [SLOTS + 1 if w else KV_BLOCKS + 1 for w in WINDOWED[name]], "arrays sized to their group"
    assert eng._device.kv_cache.nbytes == eng.sizing.kv_bytes == eng.describe()["kv_bytes"], (
        "the sizing's bytes (what /v1/cache/status and the memory plan report) are the arrays' bytes")
    before = (KV_BLOCKS + 1) * model_bytes_per_block(cfg, BS, np.float32)  # every array holding every block
    saved = 1 - eng.sizing.kv_bytes / before
    # every array shrinks from 97 blocks to 41 slots (Mistral); Gemma 4's three arrays take
    # the same bytes a block (2 heads x 16 wide, 1 x 32) and two of them shrink
    assert saved == pytest.approx({"mistral": 56 / 97, "gemma4": 2 / 3 * 56 / 97}[name], rel=1e-12), f"{saved:.4f}"
    stats = eng.stats()
    assert stats.kv_blocks_total == KV_BLOCKS and stats.kv_window_slots_total == SLOTS
    if name == "mistral":
        assert eng.sizing.bytes_per_block == 0, "every layer slides: the block ids hold no bytes"


def test_past_six_windows_matches_hf_float32(family):
    _, _, hf, llm = family
    p = prompt(0, 37)
    (tokens, logprobs), = greedy(llm, [p], 70)  # 107 positions: more than six windows
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p + tokens])).logits[0].float(), -1).numpy()
    want = ref[len(p) - 1:-1]
    assert tokens == want.argmax(-1).tolist(), "greedy tokens differ from HF's"
    err = np.abs(np.asarray(logprobs) - want[np.arange(len(tokens)), tokens]).max()
    assert err < 1e-4, f"chosen-token logprobs differ from HF float32 by {err:.3g}"
    stats = llm._engine.stats()
    assert stats.kv_window_blocks_passed > 0, "no block fell behind the window"
    assert 0 < stats.kv_window_slots_peak <= CAP


def test_batched_equals_alone(family):
    _, _, _, llm = family
    prompts = [prompt(1, 45), prompt(2, 23), prompt(3, 60)]
    batched = greedy(llm, prompts, 40)
    for p, (tokens, logprobs) in zip(prompts, batched):
        (alone_tokens, alone_logprobs), = greedy(llm, [p], 40)
        assert alone_tokens == tokens and np.abs(np.asarray(alone_logprobs) - logprobs).max() < 1e-5


def test_a_prefix_hit_equals_cold(family):
    _, _, _, llm = family
    p = prompt(7, 45)
    (cold_tokens, cold_logprobs), = greedy(llm, [p], 30)
    before = llm._engine.stats().prefix_cache_hits
    (warm_tokens, warm_logprobs), = greedy(llm, [p], 30)
    assert llm._engine.stats().prefix_cache_hits - before == 40, "the 5 full prompt blocks should be a hit"
    assert warm_tokens == cold_tokens and np.abs(np.asarray(warm_logprobs) - cold_logprobs).max() < 1e-5


def test_n2_equals_n1(family):
    """Both rows share the prompt's partly filled last block and its slot; the first to
    write copies both (a missing slot copy would leave that row's window empty)."""
    _, _, _, llm = family
    p = prompt(8, 45)
    (tokens, logprobs), = greedy(llm, [p], 30)
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True, logprobs=5)
    out, = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    for choice in out.outputs:
        got = [lp[t].logprob for lp, t in zip(choice.logprobs, choice.token_ids)]
        assert choice.token_ids == tokens and np.abs(np.asarray(got) - logprobs).max() < 1e-5


def test_nothing_leaks_and_nothing_recompiles(family):
    _, _, _, llm = family
    greedy(llm, [prompt(4, 30), prompt(5, 50)], 50)
    stats = llm._engine.stats()
    assert stats.kv_window_slots_held == 0 and stats.kv_window_slots_free == stats.kv_window_slots_total
    assert stats.kv_blocks_free == stats.kv_blocks_total
    blocks = llm._engine._batcher._scheduler.blocks
    blocks.window.check([])
    blocks.budget.check()
    assert stats.recompiles_after_warmup == 0


def _runner(path, change=None):
    from ferrox_jax.runner import ModelRunner
    from models.loaders.common import build_model
    from models.loaders.safetensors import read_config, read_tensors

    cfg = read_config(path)
    model = build_model(cfg, read_tensors(path, cfg))
    for layer in model.layers if change else ():
        change(layer)
    return ModelRunner(model, num_blocks=64, block_size=BS, max_rows=4, max_chunk_tokens=48, max_context=128,
                       window_blocks=16)


def _row(tokens, start, blocks):
    return RowPlan(row_id=0, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=False)


def test_negative_control_every_layer_sliding_a_window_one_block_short(family):
    """Mistral, every array the pool's: the query at position 40 sees keys 25..40 (block
    indices 3..5). Its slots with indices 0..2 dropped (what the pool does) give the logits
    of the whole mapping; index 3 dropped too (a slot freed one block early) changes them."""
    name, path, _, _ = family
    if name != "mistral":
        pytest.skip("the every-layer-sliding control")
    runner = _runner(path)
    p, blocks = prompt(6, 41), list(range(1, 7))
    slots = {b: b + 8 for b in blocks}  # slots 9..14: a block id read as a slot would read zeros
    runner.run_logits([_row(p[:40], 0, blocks)], slots)

    def decode(mapping):
        return runner.run_logits([_row(p[40:], 40, blocks)], mapping)[0][-1]

    full = decode(slots)
    freed = decode({b: s for b, s in slots.items() if b > 3})
    too_early = decode({b: s for b, s in slots.items() if b > 4})
    assert np.abs(freed - full).max() < 1e-6, "dropping the blocks behind the window must change nothing"
    assert np.abs(too_early - full).max() > 1e-3, "a window one block short must change the logits"


def test_negative_control_a_shared_layer_on_the_wrong_table(family):
    """Gemma 4 at runner level, 40 tokens over blocks 1..5 whose slots are 9..13: within
    1e-4 of HF; the shared sliding layer (3) reading its source's array through the block
    table, or the shared full layer (4) through the window table, misses HF."""
    name, path, hf, _ = family
    if name != "gemma4":
        pytest.skip("the shared-KV control")
    p, blocks = prompt(6, 40), list(range(1, 6))
    slots = {b: b + 8 for b in blocks}
    want = fc.hf_logits(hf, p)

    def err(change=None):
        return float(np.abs(_runner(path, change).run_logits([_row(p, 0, blocks)], slots)[0] - want).max())

    assert err() < 1e-4
    for index in (3, 4):
        model_layers = []

        def change(layer, index=index):
            model_layers.append(layer)
            if len(model_layers) - 1 == index:
                layer.source_slides = not layer.source_slides

        assert err(change) > 20 * fc.ATOL, f"layer {index} on the wrong table must miss HF"


def test_every_layer_sliding_sizes_logical_blocks_and_bounds_the_pool(tmp_path):
    """A Mistral-7B-shaped config (every layer over 4096 keys, blocks of 16, chunks of 128):
    each row a whole 32k context of 0-byte block ids, the cache the pool alone (530 slots a
    row with prefix caching); a budget the pool does not fit (the default 2 GiB) keeps one
    pool of blocks; the
    memory check blames the rows (the pool's size), not the KV budget."""
    import json

    import jax.numpy as jnp

    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine_builder import size_kv
    from ferrox_jax.memory_bounds import Footprint, MemoryBoundError, Room
    from tools.bench.kv_groups_bytes import MISTRAL_7B, model_config

    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    cfg = model_config(tmp_path)

    def sizing(**settings):
        config = EngineConfig(model=str(tmp_path), load_format="dummy", dtype="bfloat16", block_size=16,
                              prefill_chunk=128, max_seqs=4, **settings)
        return config, size_kv(config, cfg, jnp.bfloat16)

    config, s = sizing(kv_memory_gib=8.0)
    slot = 32 * 8 * 16 * 256 * 2  # 32 layers x 8 KV heads x 16 positions x (K 128 + V 128) x bf16
    assert (s.bytes_per_block, s.num_blocks, s.window_blocks) == (0, 4 * 2048 + 1, 4 * 530 + 1)
    assert s.max_context == 32768 and s.kv_bytes == (4 * 530 + 1) * slot  # 4.14 GiB
    _, small = sizing()  # the default 2 GiB budget does not hold the 4 rows' pool: one pool of blocks
    assert small.window is None and small.num_blocks == 2 * (1 << 30) // slot
    footprint = Footprint(cfg, s.bytes_per_block, 2, "cpu", 1, s.window)
    assert footprint.demand(config).kv_bytes == s.kv_bytes
    with pytest.raises(MemoryBoundError) as refused:
        footprint.check(config, Room(free_bytes=2 << 30, where="host memory"))
    assert refused.value.field == "max_seqs" and "ask for at most max_seqs 1" in str(refused.value)


def test_a_draft_model_beside_the_pool(tmp_path):
    """Mistral (every layer sliding) drafting for itself (`--speculative draft`, 3 tokens):
    the target's arrays hold the pool, the draft's runner a block per block id (it mirrors
    the target's batches without their window columns), so the block ids hold the draft's
    bytes (no longer logical) and the sizing counts both caches; the verified greedy tokens
    are HF's over 100 positions, logprobs within 1e-4."""
    from ferrox_jax.config import SpeculativeConfig

    path, _ = _mistral(tmp_path / "mistral")
    hf = fc.hf_model(path)
    spec = SpeculativeConfig(method="draft", draft_model=str(path), num_speculative_tokens=3)
    with LLM(str(path), dtype="float32", quantization="none", block_size=BS, max_seqs=2, prefill_chunk=CHUNK,
             kv_blocks=KV_BLOCKS, max_context=160, speculative=spec) as llm:
        eng = llm._engine
        slots = 2 * 2 * CAP  # two rows, twice with prefix caching
        assert [a.shape[1] for a in eng._device.kv_cache.k] == [slots + 1] * 2, "the target's arrays hold the pool"
        draft_bytes = model_bytes_per_block(eng.model_config, BS, np.float32)  # the draft is the target's twin
        assert eng.sizing.bytes_per_block == draft_bytes and eng.sizing.num_blocks == KV_BLOCKS + 1
        assert eng.sizing.kv_bytes == eng._device.kv_cache.nbytes + (KV_BLOCKS + 1) * draft_bytes
        p = prompt(0, 30)
        (tokens, logprobs), = greedy(llm, [p], 70)
        (again, _), (other, _) = greedy(llm, [p, prompt(1, 41)], 70)  # batched, the first a prefix hit
        stats = eng.stats()
        assert again == tokens and stats.recompiles_after_warmup == 0
        assert stats.spec_decode_num_accepted_tokens > 0, "the draft's tokens were verified and kept"
        assert stats.kv_window_slots_held == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p + tokens])).logits[0].float(), -1).numpy()[len(p) - 1:-1]
    assert tokens == ref.argmax(-1).tolist(), "greedy tokens differ from HF's"
    assert np.abs(np.asarray(logprobs) - ref[np.arange(len(tokens)), tokens]).max() < 1e-4
