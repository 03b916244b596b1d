"""LoRA adapters on Qwen3-Next's fused DeltaNet projections, against HF peft: a tiny random
Qwen3-Next (the Qwen3.5 family tests' shapes: DeltaNet, gated attention, DeltaNet with a dense
MLP, gated attention; experts with a shared expert elsewhere) and a random PEFT adapter (rank 4,
lora_alpha 8, non-zero B) on the fused in_proj_qkvz and in_proj_ba, out_proj, and the gated
attention's q_proj (with its gate rows), k_proj, v_proj and o_proj.

in_proj_qkvz's output columns are grouped per key head (each k head's q, k, then the v and z of
its value heads) and our forward takes them apart after the product (`models/deltanet.py:
_projections`), so an adapter's B columns must stay in the checkpoint's grouped order; in_proj_ba
likewise (each k head's b, then its a).

Checked: a 20-token prefill and 4 greedy decode steps against peft's logits for the whole
sequence, unmerged and merged, float32 both sides, within the family's bound against HF (ATOL
1e-4, or 1.5x HF's own chunked-vs-recurrent spread where that is larger: the Qwen3-Next family
test's bound), and the greedy tokens peft picks. Negative controls: in_proj_qkvz's B columns
regrouped to q | k | v | z of every head (the layout llama.cpp's converter splits it into, and
what a loader concatenating the parts would hand the slot) fail it, and in_proj_ba's b and a
halves swapped per head fail it; the adapter must move the logits far beyond the bound. A model
grouped for 2 tensor-parallel devices (run on one: the fused form keeps its columns and builds
each device's q | k | v in the forward) gives the ungrouped model's adapted logits.

The same adapter as a GGUF file for llama.cpp's `qwen3next` (`tests/support/lora_helpers.
peft_to_gguf`): in_proj_qkvz's B rows split into attn_qkv (q | k | v of every k head) and
attn_gate (z) with one shared lora_a, in_proj_ba as ssm_ba, out_proj as ssm_out. (The vendored
convert_lora_to_gguf.py stops on a fused in_proj_qkvz adapter, a view it cannot take of LoRA
factors; the split is the one it makes of the base weight.) It gives the PEFT form's logits;
half of the split pair, or its halves under two different lora_a, is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from ferrox_jax.lora_registry import LoraRegistry
from ferrox_jax.plan import RowPlan
from ferrox_jax.runner import ModelRunner
from models.deltanet_groups import group_for_devices
from models.loader import load_checkpoint
from models.lora import LoraError, LoraSlots, attach_lora, write_slot
from models.qwen3_next import HF_LAYER_WEIGHTS
from tests.models.test_family_qwen3_5 import SHAPES, moe_bound
from tests.support import family_checks as fc
from tests.support.engine_helpers import shuffled_blocks
from tests.support.lora_helpers import lora_runner, make_peft_adapter, peft_models, peft_to_gguf

PROMPT_TOKENS = 20
DECODE_STEPS = 4
DELTANET = ["in_proj_qkvz", "in_proj_ba", "out_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
RUNNER = dict(num_blocks=96, block_size=4, max_rows=4, max_chunk_tokens=32, max_context=128)
SPARE = 3  # the registry holds slot 1; the negative controls write slot 3 directly


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-qwen3-next")
    config = transformers.Qwen3NextConfig(**SHAPES, intermediate_size=128, mlp_only_layers=[2])
    config.architectures = ["Qwen3NextForCausalLM"]
    base = fc.make_checkpoint(root / "base", config)
    adapter = make_peft_adapter(base, root / "fused", seed=1, r=4, alpha=8.0, targets=DELTANET + ATTENTION)
    runner, registry, ckpt = lora_runner(base, max_loras=3, **RUNNER)
    assert ckpt.config.fused_deltanet, "Qwen3-Next keeps in_proj_qkvz / in_proj_ba fused"
    read = registry.read("fused", adapter)
    slot = registry.place(read).slot
    prompt = np.random.RandomState(0).randint(0, ckpt.config.vocab_size, PROMPT_TOKENS).tolist()
    ours, tokens = _greedy(runner, prompt, slot)
    unmerged, merged = peft_models(base, adapter)
    refs = [fc.hf_logits(model, tokens) for model in (unmerged, merged)]
    bound = moe_bound(merged, tokens, refs[1])  # the merged model is a plain transformers one
    return dict(base=base, adapter=adapter, runner=runner, registry=registry, ckpt=ckpt, read=read, slot=slot,
                prompt=prompt, ours=ours, tokens=tokens, refs=refs, bound=bound, root=root)


def _row(tokens, start, blocks, adapter_slot):
    return RowPlan(row_id=1, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=False,
                   adapter_slot=adapter_slot, state_slot=1)


def _greedy(runner, prompt, adapter_slot, tokens=None, seed=3):
    """Our logits over prompt + DECODE_STEPS tokens (greedy, or `tokens` teacher-forced), and
    the tokens (state slot 1: a prefill from position 0 starts from zero states)."""
    blocks = shuffled_blocks(8, RUNNER["num_blocks"], seed=seed)
    logits, seq = [runner.run_logits([_row(prompt, 0, blocks, adapter_slot)])[0]], list(prompt)
    for i in range(DECODE_STEPS):
        seq.append(int(logits[-1][-1].argmax()) if tokens is None else tokens[PROMPT_TOKENS + i])
        logits.append(runner.run_logits([_row(seq[-1:], len(seq) - 1, blocks, adapter_slot)])[0])
    return np.concatenate(logits), seq


def _written(runner, weights, max_rank=8):
    runner.swap_state(lambda state: state._replace(weights=write_slot(state.weights, SPARE, weights, max_rank)))


def test_fused_deltanet_and_gated_attention_adapter_matches_peft(setup):
    s = setup
    bound = s["bound"]
    for kind, ref in zip(("unmerged", "merged"), s["refs"]):
        err = float(np.abs(s["ours"] - ref).max())
        print(f"qwen3_next LoRA on in_proj_qkvz / in_proj_ba / out_proj + attention vs peft {kind}: "
              f"max |Δlogit| {err:.2e} (bound {bound:.2e})")
        assert err < bound, f"logits differ from peft {kind} by {err:.3g} (bound {bound:.3g})"
        assert s["tokens"][PROMPT_TOKENS:] == ref[PROMPT_TOKENS - 1:-1].argmax(-1).tolist(), f"greedy ({kind})"
    base_logits, _ = _greedy(s["runner"], s["prompt"], 0, tokens=s["tokens"])
    moved = float(np.abs(s["ours"] - base_logits).max())
    assert moved > 100 * bound, f"the adapter changes the logits by only {moved:.3g}"
    assert {name for _, name in s["read"].adapter.weights} == set(DELTANET + ATTENTION)


def _per_head(cfg):
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    group_v = cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim
    return hk, dk, group_v


def test_negative_control_qkvz_columns_in_the_split_order_fail(setup):
    # The fused columns as [q of every head | k | v | z]: the converter's attn_qkv + attn_gate
    # order. Handing the slot B so (joined, not regrouped per head) must not pass.
    s = setup
    hk, dk, group_v = _per_head(s["ckpt"].config)
    grouped = np.arange(hk * (2 * dk + 2 * group_v)).reshape(hk, -1)
    parts = np.split(grouped, [dk, 2 * dk, 2 * dk + group_v], axis=1)  # q, k, v, z columns of each head
    split_order = np.concatenate([p.reshape(-1) for p in parts])
    assert (split_order != np.arange(split_order.size)).any()
    wrong = {key: (a, b[:, split_order] if key[1] == "in_proj_qkvz" else b)
             for key, (a, b) in s["read"].adapter.weights.items()}
    _written(s["runner"], wrong)
    off = float(np.abs(_greedy(s["runner"], s["prompt"], SPARE, tokens=s["tokens"])[0] - s["refs"][1]).max())
    print(f"qwen3_next LoRA, in_proj_qkvz B in q | k | v | z order vs peft: max |Δlogit| {off:.2e}")
    assert off > 10 * s["bound"], f"in_proj_qkvz's B in the wrong order went unnoticed ({off:.3g})"


def test_negative_control_ba_halves_swapped_fail(setup):
    # in_proj_ba holds per k head its value heads' b (beta), then their a (the decay's input):
    # the same shape either way round, so only the logits can tell.
    s = setup
    cfg = s["ckpt"].config
    hk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    swap = np.arange(2 * hk * r).reshape(hk, 2, r)[:, ::-1].reshape(-1)
    wrong = {key: (a, b[:, swap] if key[1] == "in_proj_ba" else b) for key, (a, b) in s["read"].adapter.weights.items()}
    _written(s["runner"], wrong)
    off = float(np.abs(_greedy(s["runner"], s["prompt"], SPARE, tokens=s["tokens"])[0] - s["refs"][1]).max())
    print(f"qwen3_next LoRA, in_proj_ba's b and a swapped vs peft: max |Δlogit| {off:.2e}")
    assert off > 10 * s["bound"], f"in_proj_ba's halves swapped went unnoticed ({off:.3g})"


def test_fused_model_grouped_for_tensor_parallelism_keeps_its_adapted_logits(setup):
    s = setup
    blocks = shuffled_blocks(8, RUNNER["num_blocks"], seed=5)
    want = s["runner"].run_logits([_row(s["prompt"], 0, blocks, s["slot"])])[0]
    ckpt = load_checkpoint(str(s["base"]))
    slots = LoraSlots(3, 8)
    targets = attach_lora(ckpt.model, slots)
    grouped_model = group_for_devices(ckpt.model, 2)  # as a 2-device mesh lays it out
    assert all(layer.delta_spec.shards == 2 for layer in grouped_model.layers
               if getattr(layer, "delta_spec", None) is not None)
    grouped = ModelRunner(grouped_model, **RUNNER)
    registry = LoraRegistry(grouped, slots, HF_LAYER_WEIGHTS, targets, ckpt.config)
    got = grouped.run_logits([_row(s["prompt"], 0, blocks, registry.load("fused", s["adapter"]).slot)])[0]
    err = float(np.abs(got - want).max())
    print(f"qwen3_next LoRA, grouped for 2 devices vs one: max |Δlogit| {err:.2e}")
    # two float32 orders of the same sums: 1.55e-5 with the suite's fusion emitters off and the
    # RoPE tables computed once per forward (models/layers.py), below 1e-5 with either alone
    assert err < 3e-5, f"the grouped fused model's adapted logits differ by {err:.3g}"


def _gguf(s, name, **options):
    cfg = s["ckpt"].config
    deltanet = dict(linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
                    linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim)
    return peft_to_gguf(s["adapter"], s["root"] / f"{name}.gguf", "qwen3next", cfg.num_heads, cfg.num_kv_heads,
                        deltanet=deltanet, **options)


def test_gguf_adapter_with_in_proj_qkvz_split_equals_its_peft_form(setup):
    s = setup
    slot = s["registry"].load("fused-gguf", _gguf(s, "fused")).slot
    try:
        got, _ = _greedy(s["runner"], s["prompt"], slot, tokens=s["tokens"])
    finally:
        s["registry"].unload("fused-gguf")
    err = float(np.abs(got - s["ours"]).max())
    print(f"qwen3next GGUF LoRA vs its PEFT form: max |Δlogit| {err:.2e}")
    assert err < 1e-6, f"the GGUF adapter's logits differ from its PEFT form by {err:.3g}"


def test_gguf_adapter_with_half_of_in_proj_qkvz_is_refused(setup):
    s = setup
    path = _gguf(s, "half", rename={"attn_gate.weight": "attn_gate_lost.weight"})
    with pytest.raises(LoraError, match="needs both attn_qkv and attn_gate") as refused:
        s["registry"].load("half-gguf", path)
    assert refused.value.code == "invalid_adapter"


def test_gguf_adapter_with_two_different_lora_a_for_in_proj_qkvz_is_refused(setup):
    # attn_qkv and attn_gate are one in_proj_qkvz adapter only under one A: x A [B_qkv | B_z]
    from models.qwen3_5_gguf import merge_adapter

    cfg = setup["ckpt"].config
    hk, dk, group_v = _per_head(cfg)
    a = setup["read"].adapter.weights[(0, "in_proj_qkvz")][0].T  # [r, in], as a GGUF lora_a
    rank = a.shape[0]
    pairs = {(0, "attn_qkv.weight"): {"A": a, "B": np.ones((hk * (2 * dk + group_v), rank), np.float32)},
             (0, "attn_gate.weight"): {"A": a + 1e-3, "B": np.ones((hk * group_v, rank), np.float32)}}
    with pytest.raises(LoraError, match="different lora_a") as refused:
        merge_adapter(dict(pairs), cfg)
    assert refused.value.code == "invalid_adapter"
    pairs[(0, "attn_gate.weight")]["A"] = a  # the same A: joined, as wide as in_proj_qkvz
    joined = merge_adapter(dict(pairs), cfg)
    assert list(joined) == [(0, "in_proj_qkvz")] and joined[(0, "in_proj_qkvz")]["B"].shape == (
        hk * (2 * dk + 2 * group_v), rank)
