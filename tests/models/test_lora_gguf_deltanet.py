"""GGUF LoRA adapters (llama.cpp's convert_lora_to_gguf.py output) on a model with Gated DeltaNet
layers: a tiny random Qwen3.5 (tests/support/family_checks.make_tiny_qwen3_5: 2 k / 4 v DeltaNet
heads, so the converter's value-head tiling moves rows) and a random PEFT adapter (rank 4,
lora_alpha 8, non-zero B) on every projection: the DeltaNet ones (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a, out_proj), the gated attention's and the MLP's.

The adapter is written as the converter writes it (`tests/support/lora_helpers.peft_to_gguf`:
attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_out, with the value heads tiled in B's rows and in
ssm_out's A columns; on this checkpoint its tensors equal the vendored converter's output value
for value) and served beside its PEFT form. Checked: a 20-token prefill and 4 greedy decode steps
give the PEFT form's logits (within 1e-6: the same A and B reach the slots, so only the step's
own rounding could differ) and peft's merged model's (atol 1e-4, the family's tolerance against
HF). Negative controls: the file written without the tiling (what our reader undoes then
scrambles the heads) and with ssm_alpha / ssm_beta under each other's names (same shapes, the
wrong projection) each move the logits far beyond the tolerance.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ferrox_jax.plan import RowPlan
from tests.support import family_checks as fc
from tests.support.engine_helpers import shuffled_blocks
from tests.support.lora_helpers import ALL_TARGETS, lora_runner, make_peft_adapter, peft_models, peft_to_gguf

ATOL = fc.ATOL  # 1e-4: the family's tolerance against HF
PROMPT_TOKENS = 20
DECODE_STEPS = 4
DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
RUNNER = dict(num_blocks=96, block_size=4, max_rows=4, max_chunk_tokens=32, max_context=128)
DELTANET_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gguf-deltanet")
    base = fc.make_tiny_qwen3_5(root / "base")
    adapter = make_peft_adapter(base, root / "all", seed=1, r=4, alpha=8.0, targets=DELTANET + ALL_TARGETS)
    runner, registry, ckpt = lora_runner(base, max_loras=3, **RUNNER)
    hf = json.loads((base / "config.json").read_text())
    hf = hf.get("text_config", hf)
    write = dict(arch="qwen35", num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                 deltanet={k: hf[k] for k in DELTANET_KEYS})
    assert hf["linear_num_value_heads"] > hf["linear_num_key_heads"], "the tiling moves rows on this checkpoint"
    peft_slot = registry.load("peft", adapter).slot
    prompt = np.random.RandomState(0).randint(0, ckpt.config.vocab_size, PROMPT_TOKENS).tolist()
    want, tokens = _greedy(runner, prompt, peft_slot)
    return dict(base=base, adapter=adapter, runner=runner, registry=registry, write=write, root=root,
                prompt=prompt, want=want, tokens=tokens)


def _row(tokens, start, blocks, adapter_slot):
    return RowPlan(row_id=1, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=False,
                   adapter_slot=adapter_slot, state_slot=1)


def _greedy(runner, prompt, adapter_slot, tokens=None):
    """Our logits over prompt + DECODE_STEPS tokens (greedy, or `tokens` teacher-forced), and the
    tokens (state slot 1: a prefill from position 0 starts from zero states)."""
    blocks = shuffled_blocks(8, RUNNER["num_blocks"], seed=3)
    logits, seq = [runner.run_logits([_row(prompt, 0, blocks, adapter_slot)])[0]], list(prompt)
    for i in range(DECODE_STEPS):
        seq.append(int(logits[-1][-1].argmax()) if tokens is None else tokens[PROMPT_TOKENS + i])
        logits.append(runner.run_logits([_row(seq[-1:], len(seq) - 1, blocks, adapter_slot)])[0])
    return np.concatenate(logits), seq


def _served(s, name, **options):
    """Our logits with the adapter written as GGUF (`peft_to_gguf` with `options`), teacher-forced
    on the PEFT form's tokens; the adapter is unloaded after."""
    path = peft_to_gguf(s["adapter"], s["root"] / f"{name}.gguf", **s["write"], **options)
    slot = s["registry"].load(name, path).slot
    try:
        return _greedy(s["runner"], s["prompt"], slot, tokens=s["tokens"])[0]
    finally:
        s["registry"].unload(name)


def test_gguf_adapter_on_deltanet_layers_equals_its_peft_form_and_peft(setup):
    s = setup
    got = _served(s, "converted")
    err = float(np.abs(got - s["want"]).max())
    print(f"qwen35 GGUF LoRA vs its PEFT form: max |Δlogit| {err:.2e}")
    assert err < 1e-6, f"the GGUF adapter's logits differ from its PEFT form by {err:.3g}"
    _, merged = peft_models(s["base"], s["adapter"])
    ref = fc.hf_logits(merged, s["tokens"])
    err = float(np.abs(got - ref).max())
    print(f"qwen35 GGUF LoRA vs peft merged: max |Δlogit| {err:.2e}")
    assert err < ATOL, f"the GGUF adapter's logits differ from peft's by {err:.3g}"
    assert s["tokens"][PROMPT_TOKENS:] == ref[PROMPT_TOKENS - 1:-1].argmax(-1).tolist(), "greedy differs from peft's"


def test_negative_control_value_heads_left_grouped_fail(setup):
    s = setup
    off = float(np.abs(_served(s, "untiled", tile_v_heads=False) - s["want"]).max())
    print(f"qwen35 GGUF LoRA written without the value-head tiling: max |Δlogit| {off:.2e}")
    assert off > 100 * ATOL, f"value heads in the wrong order went unnoticed ({off:.3g})"


def test_negative_control_alpha_and_beta_on_each_others_projection_fail(setup):
    s = setup
    swap = {"ssm_alpha.weight": "ssm_beta.weight", "ssm_beta.weight": "ssm_alpha.weight"}
    off = float(np.abs(_served(s, "swapped", rename=swap) - s["want"]).max())
    print(f"qwen35 GGUF LoRA with ssm_alpha / ssm_beta swapped: max |Δlogit| {off:.2e}")
    assert off > 100 * ATOL, f"an adapter tensor on the wrong projection went unnoticed ({off:.3g})"
