"""LoRA adapters on a model with Gated DeltaNet layers, against HF peft: a tiny random Qwen3.5
(tests/support/family_checks.make_tiny_qwen3_5: DeltaNet, gated attention, DeltaNet, gated
attention) and a random PEFT adapter (rank 4, lora_alpha 8, non-zero B) on the DeltaNet
projections (in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj) and the gated
attention's (q_proj with its gate rows, k_proj, v_proj, o_proj).

Checked: a 20-token prefill and 4 greedy decode steps against peft's logits for the whole
sequence, unmerged and merged, float32 both sides, atol 1e-4 (the family's tolerance against
HF: HF's prefill runs the delta rule in its chunked form, ours token by token; measured in
the print), and the greedy tokens peft picks. Negative controls: the adapter's in_proj_a and
in_proj_b weights swapped (same shapes, the other projection) fail it, and the adapter must
move the logits far beyond the tolerance. Under tensor parallelism in_proj_qkv's columns are
regrouped per device (models/deltanet_groups.py); a model grouped so (for 2 devices, run on
one) gives the ungrouped model's adapted logits, and B written in the checkpoint's column
order (what the grouping would do without `LoraWeight.out_order`) does not. The memory
bounds count exactly the projections that take slots (`Qwen3_5Config.lora_widths`).
"""

from __future__ import annotations

import numpy as np
import pytest

from ferrox_jax.lora_registry import LoraRegistry
from ferrox_jax.plan import RowPlan
from ferrox_jax.runner import ModelRunner
from models.config import ModelConfig
from models.deltanet_groups import channel_order, group_for_devices
from models.loader import load_checkpoint
from models.lora import LoraSlots, attach_lora, write_slot
from models.qwen3_5 import HF_LAYER_WEIGHTS
from tests.support import family_checks as fc
from tests.support.engine_helpers import shuffled_blocks
from tests.support.lora_helpers import lora_runner, make_peft_adapter, peft_models

ATOL = fc.ATOL  # 1e-4: the family's tolerance against HF (module docstring)
PROMPT_TOKENS = 20
DECODE_STEPS = 4
DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
RUNNER = dict(num_blocks=96, block_size=4, max_rows=4, max_chunk_tokens=32, max_context=128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-deltanet")
    base = fc.make_tiny_qwen3_5(root / "base")
    adapter = make_peft_adapter(base, root / "mixers", seed=1, r=4, alpha=8.0, targets=DELTANET + ATTENTION)
    runner, registry, ckpt = lora_runner(base, max_loras=3, **RUNNER)
    slot = registry.load("mixers", adapter).slot
    prompt = np.random.RandomState(0).randint(0, ckpt.config.vocab_size, PROMPT_TOKENS).tolist()
    return base, adapter, runner, registry, ckpt, slot, prompt


def _row(tokens, start, blocks, adapter_slot):
    return RowPlan(row_id=1, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=False,
                   adapter_slot=adapter_slot, state_slot=1)


def _greedy(runner, prompt, adapter_slot, seed=3):
    """Our logits over prompt + DECODE_STEPS greedy tokens, and the tokens (state slot 1: a
    prefill from position 0 starts from zero states)."""
    blocks = shuffled_blocks(8, RUNNER["num_blocks"], seed=seed)
    logits, tokens = [runner.run_logits([_row(prompt, 0, blocks, adapter_slot)])[0]], list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.run_logits([_row(tokens[-1:], len(tokens) - 1, blocks, adapter_slot)])[0])
    return np.concatenate(logits), tokens


def test_deltanet_and_gated_attention_adapter_matches_peft(setup):
    base, adapter, runner, _, _, slot, prompt = setup
    ours, tokens = _greedy(runner, prompt, slot)
    for kind, ref_model in zip(("unmerged", "merged"), peft_models(base, adapter)):
        ref = fc.hf_logits(ref_model, tokens)
        err = float(np.abs(ours - ref).max())
        print(f"qwen3_5 LoRA on DeltaNet + attention vs peft {kind}: max |Δlogit| {err:.2e}")
        assert err < ATOL, f"logits differ from peft {kind} by {err:.3g}"
        assert tokens[PROMPT_TOKENS:] == ref[PROMPT_TOKENS - 1:-1].argmax(-1).tolist(), f"greedy differs ({kind})"
    base_logits, _ = _greedy(runner, prompt, 0)
    moved = float(np.abs(ours - base_logits).max())
    assert moved > 100 * ATOL, f"the adapter changes the logits by only {moved:.3g}"


def test_negative_control_the_adapter_on_the_wrong_projection_fails(setup, monkeypatch):
    # in_proj_a and in_proj_b are both [D, Hv]: an adapter wired to the other one loads
    # without complaint, so only the logits can tell.
    base, adapter, runner, registry, _, _, prompt = setup
    monkeypatch.setitem(HF_LAYER_WEIGHTS, "linear_attn.in_proj_a.weight", "in_proj_b")
    monkeypatch.setitem(HF_LAYER_WEIGHTS, "linear_attn.in_proj_b.weight", "in_proj_a")
    swapped = registry.load("swapped", adapter).slot
    try:
        ours, tokens = _greedy(runner, prompt, swapped)
    finally:
        registry.unload("swapped")
    _, merged = peft_models(base, adapter)
    err = float(np.abs(ours - fc.hf_logits(merged, tokens)).max())
    print(f"qwen3_5 LoRA with in_proj_a / in_proj_b swapped vs peft: max |Δlogit| {err:.2e}")
    assert err > 10 * ATOL, f"an adapter on the wrong projection went unnoticed ({err:.3g})"


def test_in_proj_qkv_grouped_for_tensor_parallelism_takes_adapters_in_its_order(setup):
    base, adapter, runner, _, ckpt, slot, prompt = setup
    want = runner.run_logits([_row(prompt, 0, shuffled_blocks(8, 96, seed=5), slot)])[0]
    grouped_ckpt = load_checkpoint(str(base))
    slots = LoraSlots(3, 8)
    targets = attach_lora(grouped_ckpt.model, slots)
    grouped = ModelRunner(group_for_devices(grouped_ckpt.model, 2), **RUNNER)  # as a 2-device mesh lays it out
    order = channel_order(ckpt.config.deltanet_spec(), 2)
    assert (order != np.arange(order.size)).any(), "the grouping moves in_proj_qkv's columns"
    registry = LoraRegistry(grouped, slots, HF_LAYER_WEIGHTS, targets, grouped_ckpt.config)
    read = registry.read("mixers", adapter)
    grouped_slot = registry.place(read).slot
    got = grouped.run_logits([_row(prompt, 0, shuffled_blocks(8, 96, seed=5), grouped_slot)])[0]
    err = float(np.abs(got - want).max())
    print(f"qwen3_5 LoRA, in_proj_qkv grouped for 2 devices vs HF's order: max |Δlogit| {err:.2e}")
    assert err < 1e-5, f"the grouped model's adapted logits differ by {err:.3g}"
    # Negative control: B as the checkpoint lays it out, in the grouped columns (write_slot
    # takes B[:, order]; handing it B[:, argsort(order)] undoes that).
    raw = {key: (a, b[:, np.argsort(order)] if key[1] == "in_proj_qkv" else b)
           for key, (a, b) in read.adapter.weights.items()}
    spare = 3  # the registry holds slot 1; slot 3 is written here directly
    grouped.swap_state(lambda state: state._replace(weights=write_slot(state.weights, spare, raw, slots.max_rank)))
    off = float(np.abs(grouped.run_logits([_row(prompt, 0, shuffled_blocks(8, 96, seed=5), spare)])[0] - want).max())
    print(f"qwen3_5 LoRA, B left in HF's column order on the grouped model: max |Δlogit| {off:.2e}")
    assert off > 10 * ATOL, f"B in the wrong column order went unnoticed ({off:.3g})"


def test_memory_bounds_count_exactly_the_projections_with_slots(setup):
    *_, registry, ckpt, _, _ = setup
    columns = sum(d_in + d_out for d_in, d_out in registry.targets.values())
    names = {name for _, name in registry.targets}
    assert set(DELTANET + ATTENTION) <= names, f"every DeltaNet and attention projection takes slots: {names}"
    # 2 DeltaNet layers x (64+128 + 64+64 + 2 x (64+4) + 64+64) + 2 attention layers x (64+256 + 64+64 + 64+64
    # + 128+64) + 4 MLPs x 3 x (64+128)
    assert columns == ckpt.config.lora_widths() == 2 * 584 + 2 * 768 + 4 * 576
    assert ModelConfig.lora_widths(ckpt.config) < columns, "the attention-only count would undercount them"
