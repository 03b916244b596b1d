"""LoRA adapters against HF peft, for four families (Llama, Qwen3, Gemma 2, and Phi-3,
whose checkpoint fuses qkv_proj and gate_up_proj).

Each family: a tiny random checkpoint and two tiny random adapters with non-zero B (one
of rank 4 on every projection, lora_alpha 8; one of rank 8 on q/v/down only, rsLoRA;
Phi-3's on its fused modules: all four, and qkv_proj + down_proj), in a runner with
three adapter slots of rank <= 8. Checked per adapter: a 20-token prefill
and 4 greedy decode steps against peft's logits for the whole sequence, unmerged
(base + s B A x at run time) and merged (W + s B A), float32 both sides, atol 1e-4 (only
the summation order differs; merging moves the reference by less than that); the greedy
tokens peft would pick. Then both adapters and the base model as three rows of one batch,
each against itself alone, and the base row against a runner without adapter slots
(within 1e-5: see the test). Last, the rank-4 adapter written as llama.cpp's GGUF LoRA
(`tests/support/lora_helpers.peft_to_gguf`, the converter's rules) gives the PEFT form's logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from ferrox_jax.plan import RowPlan
from tests.support import family_checks as fc
from tests.support.engine_helpers import float32_matmuls, make_runner, shuffled_blocks  # noqa: F401
from tests.support.lora_helpers import (ALL_TARGETS, CONFIGS, FUSED_TARGETS, lora_runner, make_peft_adapter, peft_models,
                                peft_to_gguf)

ATOL = 1e-4  # float32 both sides; differences come only from summation order
PROMPT_TOKENS = 20
DECODE_STEPS = 4

@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = fc.make_checkpoint(root / "base", CONFIGS[request.param]())
    fused = request.param == "phi3"
    adapters = {"wide": make_peft_adapter(base, root / "wide", seed=1, r=4, alpha=8.0,
                                          targets=FUSED_TARGETS if fused else ALL_TARGETS),
                "narrow": make_peft_adapter(base, root / "narrow", seed=2, r=8, alpha=4.0,
                                            targets=("qkv_proj", "down_proj") if fused else
                                            ("q_proj", "v_proj", "down_proj"), use_rslora=True)}
    runner, registry, ckpt = lora_runner(base, max_loras=3)
    slots = {name: registry.load(name, path).slot for name, path in adapters.items()}
    return request.param, base, adapters, runner, (slots, registry), ckpt


def _row(tokens, start, blocks, slot):
    return RowPlan(row_id=0, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=False,
                   adapter_slot=slot)


def _greedy(runner, prompt, blocks, slot):
    """Our logits over prompt + DECODE_STEPS greedy tokens, and the tokens."""
    logits, tokens = [runner.run_logits([_row(prompt, 0, blocks, slot)])[0]], list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.run_logits([_row(tokens[-1:], len(tokens) - 1, blocks, slot)])[0])
    return np.concatenate(logits), tokens


def test_adapters_match_peft_unmerged_and_merged(family):
    name, base, adapters, runner, (slots, _), ckpt = family
    prompt = np.random.RandomState(0).randint(0, ckpt.config.vocab_size, PROMPT_TOKENS).tolist()
    base_logits, _ = _greedy(runner, prompt, shuffled_blocks(8, 96, seed=3), 0)
    for adapter, path in adapters.items():
        ours, tokens = _greedy(runner, prompt, shuffled_blocks(8, 96, seed=slots[adapter]), slots[adapter])
        for kind, ref_model in zip(("unmerged", "merged"), peft_models(base, path)):
            ref = fc.hf_logits(ref_model, tokens)
            err = float(np.abs(ours - ref).max())
            assert err < ATOL, f"{name}/{adapter}: logits differ from peft {kind} by {err:.3g}"
            greedy = ref[PROMPT_TOKENS - 1:-1].argmax(-1).tolist()
            assert tokens[PROMPT_TOKENS:] == greedy, f"{name}/{adapter}: greedy tokens differ from peft {kind}"
        # Negative control: the adapter must move the logits far beyond the tolerance.
        moved = float(np.abs(ours - base_logits).max())
        assert moved > 100 * ATOL, f"{name}/{adapter}: the adapter changes logits by only {moved:.3g}"


def test_two_adapters_and_base_in_one_batch_equal_alone(family):
    name, base, _, runner, (slots, _), ckpt = family
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, ckpt.config.vocab_size, PROMPT_TOKENS).tolist() for _ in range(3)]
    row_slots = [slots["wide"], slots["narrow"], 0]
    ids = shuffled_blocks(18, 96, seed=10)  # 6 blocks per row, none shared
    blocks = [ids[6 * i:6 * i + 6] for i in range(3)]
    rows = [_row(p, 0, b, s) for p, b, s in zip(prompts, blocks, row_slots)]
    together = runner.run_logits(rows)
    for i, row in enumerate(rows):
        alone = runner.run_logits([row])[0]
        err = float(np.abs(together[i] - alone).max())
        assert err < 1e-5, f"{name}: row with slot {row_slots[i]} differs batched vs alone by {err:.3g}"
    plain, _ = make_runner(base, num_blocks=96, block_size=4, max_rows=4, max_chunk_tokens=16, max_context=128)
    # Slot 0 adds exactly 0.0 to every projection (tests/engine/test_lora.py); the program with
    # adapter ops is compiled differently around them, so summation orders elsewhere may
    # differ: measured up to 2.7e-6 on these logits (~1 in size).
    err = float(np.abs(together[2] - plain.run_logits([rows[2]])[0]).max())
    assert err < 1e-5, f"{name}: a row without adapter differs from the model without slots by {err:.3g}"


GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3"}


def test_gguf_lora_adapter_equals_its_peft_form(family, tmp_path):
    """llama.cpp's converter keeps lora_A / lora_B as stored and permutes llama's q/k B rows
    like the base weights (Phi-3's stays fused as attn_qkv / ffn_up); the scale is alpha / r
    (the rank-4 adapter is not rsLoRA, so PEFT's scale is the same 8 / 4). Same A and B
    values reach the slots, so the logits must match to float32 rounding."""
    name, base, adapters, runner, (slots, registry), ckpt = family
    cfg = ckpt.config
    path = peft_to_gguf(adapters["wide"], tmp_path / "wide.gguf", GGUF_ARCH[name], cfg.num_heads, cfg.num_kv_heads)
    gguf_slot = registry.load("wide-gguf", path).slot
    prompt = np.random.RandomState(4).randint(0, cfg.vocab_size, PROMPT_TOKENS).tolist()
    blocks = shuffled_blocks(8, 96, seed=5)
    want = runner.run_logits([_row(prompt, 0, blocks, slots["wide"])])[0]
    got = runner.run_logits([_row(prompt, 0, blocks, gguf_slot)])[0]
    err = float(np.abs(got - want).max())
    assert err < 1e-6, f"{name}: the GGUF adapter's logits differ from its PEFT form by {err:.3g}"
    registry.unload("wide-gguf")
    if name == "llama":  # negative control: without the permutation undone, q/k B rows are wrong
        unpermuted = peft_to_gguf(adapters["wide"], tmp_path / "raw.gguf", "llama", cfg.num_heads, cfg.num_kv_heads,
                                  permute_qk=False)
        raw_slot = registry.load("wide-raw", unpermuted).slot
        off = float(np.abs(runner.run_logits([_row(prompt, 0, blocks, raw_slot)])[0] - want).max())
        registry.unload("wide-raw")
        assert off > 100 * ATOL, f"q/k rows in the wrong order must change the logits (moved {off:.3g})"
