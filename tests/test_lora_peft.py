"""LoRA adapters against HF peft, for three families (Llama, Qwen3, Gemma 2).

Each family: a tiny random checkpoint and two tiny random adapters with non-zero B (one
of rank 4 on every projection, lora_alpha 8; one of rank 8 on q/v/down only, rsLoRA),
in a runner with two adapter slots of rank <= 8. Checked per adapter: a 20-token prefill
and 4 greedy decode steps against peft's logits for the whole sequence, unmerged
(base + s B A x at run time) and merged (W + s B A), float32 both sides, atol 1e-4 (only
the summation order differs; merging moves the reference by less than that); the greedy
tokens peft would pick. Then both adapters and the base model as three rows of one batch,
each against itself alone, and the base row against a runner without adapter slots
(within 1e-5: see the test).
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from ferrox_jax.plan import RowPlan
from tests import family_checks as fc
from tests.engine_helpers import float32_matmuls, make_runner, shuffled_blocks  # noqa: F401
from tests.lora_helpers import lora_runner, make_peft_adapter, peft_models

ATOL = 1e-4  # float32 both sides; differences come only from summation order
PROMPT_TOKENS = 20
DECODE_STEPS = 4

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=512, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                              max_position_embeddings=512, tie_word_embeddings=False),
    "gemma2": lambda: transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                max_position_embeddings=512, query_pre_attn_scalar=24,
                                                sliding_window=12, attn_logit_softcapping=3.0,
                                                final_logit_softcapping=4.0),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = fc.make_checkpoint(root / "base", CONFIGS[request.param]())
    adapters = {"wide": make_peft_adapter(base, root / "wide", seed=1, r=4, alpha=8.0),
                "narrow": make_peft_adapter(base, root / "narrow", seed=2, r=8, alpha=4.0,
                                            targets=("q_proj", "v_proj", "down_proj"), use_rslora=True)}
    runner, registry, ckpt = lora_runner(base)
    slots = {name: registry.load(name, path).slot for name, path in adapters.items()}
    return request.param, base, adapters, runner, slots, ckpt


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
    name, base, adapters, runner, slots, ckpt = family
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
    name, base, _, runner, slots, ckpt = family
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
    # Slot 0 adds exactly 0.0 to every projection (tests/test_lora.py); the program with
    # adapter ops is compiled differently around them, so summation orders elsewhere may
    # differ: measured up to 2.7e-6 on these logits (~1 in size).
    err = float(np.abs(together[2] - plain.run_logits([rows[2]])[0]).max())
    assert err < 1e-5, f"{name}: a row without adapter differs from the model without slots by {err:.3g}"
