"""Tensor parallelism for the new families on 4 CPU devices (one subprocess, as
tests/system/test_sharding.py runs tests/support/sharding_probe.py): Gemma 2 (dense; sliding window and
soft-capping under sharded heads) and Qwen3-MoE (experts split over their intermediate
axis, q/k norms replicated, one dense layer) match one device, and their weights really
are split. Both have 4 KV heads so attention is split too.

GLM-4.5 (2 KV heads, so tp 2) in the same subprocess: q/k/v biases and per-head q/k norms
under split heads, grouped sigmoid routing, a shared expert and a dense layer, with its 8
experts split by width (tensor parallelism alone) and by expert (`--expert-parallel`, 4
whole experts per device); the control rolls the expert stacks one device along E."""

from __future__ import annotations

import pytest
import transformers

from tests.support import family_checks as fc
from tests.system.test_sharding import ATOL, _probe


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                  max_position_embeddings=512)
    gemma2 = fc.make_checkpoint(root / "gemma2", transformers.Gemma2Config(
        intermediate_size=128, sliding_window=12, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
        query_pre_attn_scalar=24, **common))
    moe = fc.make_checkpoint(root / "qwen3moe", transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
        tie_word_embeddings=False, **common))
    return _probe("families", str(gemma2), str(moe), "--tp2-ep", str(glm4_moe(root / "glm4moe")))


def glm4_moe(path):
    """The tiny GLM-4.5 of tests/models/test_family_glm4_moe.py (its shape, the choice bias
    made non-zero, the q/k/v biases at 0.1 * randn)."""
    import torch

    config = transformers.Glm4MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=512, n_routed_experts=8,
                                        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                        first_k_dense_replace=1, routed_scaling_factor=1.8, norm_topk_prob=True,
                                        attention_bias=True, use_qk_norm=True, tie_word_embeddings=False)
    fc.make_checkpoint(path, config)
    hf = fc.hf_model(path)
    torch.manual_seed(4)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(8))
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(0.1 * torch.randn_like(proj.bias))
    hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Qwen3MoeForCausalLM"])
def test_tp4_logits_match_one_device(probed, arch):
    got = probed[arch]["parity"]
    assert got["prefill_err"] < ATOL, f"{arch} tp=4: prefill logits differ by {got['prefill_err']}"
    assert got["decode_err"] < ATOL, f"{arch} tp=4: decode logits differ by {got['decode_err']}"
    assert got["same_greedy"], f"{arch} tp=4: greedy tokens changed"


def test_experts_are_split_over_their_intermediate_axis(probed):
    place = probed["Qwen3MoeForCausalLM"]["placement"]
    # 8 experts, D 64, F 32 -> 32 / 4 = 8 intermediate columns of every expert per device.
    assert place["layers.0.experts_gate"]["shard_shapes"] == [[8, 64, 8]]
    assert place["layers.0.experts_up"]["shard_shapes"] == [[8, 64, 8]]
    assert place["layers.0.experts_down"]["shard_shapes"] == [[8, 8, 64]]
    assert place["layers.0.router"]["shard_shapes"] == [[64, 8]], "the router is replicated"
    assert place["layers.0.q_norm"]["shard_shapes"] == [[16]], "q/k norms are replicated"
    assert place["layers.1.down_proj"]["shard_shapes"] == [[96 // 4, 64]], "the dense layer's MLP is split"
    assert place["kv_k0"]["shard_shapes"] == [[1, 64, 8, 16]], "4 KV heads, one per device"


def test_quantized_expert_stacks_shard_and_match_one_device(probed):
    """w8a8 experts at tp=4 against w8a8 on one device: int8 values split like the float
    stacks, scales [E, out] split with gate/up's intermediate columns, replicated for down
    (its reduced axis is the split one)."""
    got = probed["Qwen3MoeForCausalLM"]["w8a8"]
    assert got["parity"]["prefill_err"] < ATOL and got["parity"]["decode_err"] < ATOL, got["parity"]
    assert got["parity"]["same_greedy"]
    place = got["placement"]
    assert place["experts_gate"]["values"]["shard_shapes"] == [[8, 64, 8]]
    assert place["experts_gate"]["scales"]["shard_shapes"] == [[8, 8]]
    assert place["experts_down"]["values"]["shard_shapes"] == [[8, 8, 64]]
    assert place["experts_down"]["scales"]["shard_shapes"] == [[8, 64]]


def test_gemma2_heads_are_split(probed):
    place = probed["Gemma2ForCausalLM"]["placement"]
    assert place["layers.0.q_proj"]["shard_shapes"] == [[64, 16]], "4 heads x 16 over 4 devices"


@pytest.mark.parametrize("split", ["by_width", "by_expert"])
def test_glm4_moe_tp2_matches_one_device(probed, split):
    got = next(v for k, v in probed.items() if k.startswith("tp2:"))[split]["parity"]
    assert got["prefill_err"] < ATOL, f"GLM-4.5 tp=2 {split}: prefill logits differ by {got['prefill_err']}"
    assert got["decode_err"] < ATOL, f"GLM-4.5 tp=2 {split}: decode logits differ by {got['decode_err']}"
    assert got["same_greedy"], f"GLM-4.5 tp=2 {split}: greedy tokens changed"


def test_glm4_moe_tp2_placement(probed):
    got = next(v for k, v in probed.items() if k.startswith("tp2:"))
    width, expert = got["by_width"]["placement"], got["by_expert"]["placement"]
    # 4 heads x 16 -> 2 heads per device, their biases with them; per-head q/k norms replicated
    assert width["q_proj"]["shard_shapes"] == [[64, 32]] and width["q_bias"]["shard_shapes"] == [[32]]
    assert width["k_bias"]["shard_shapes"] == [[16]], "2 KV heads, one per device"
    assert width["q_norm"]["shard_shapes"] == [[16]]
    assert width["router"]["shard_shapes"] == [[64, 8]], "the router is replicated"
    # 8 experts of width 32: by width 16 columns of every expert, by expert 4 whole experts each
    assert width["experts_gate"]["shard_shapes"] == [[8, 64, 16]]
    assert width["experts_down"]["shard_shapes"] == [[8, 16, 64]]
    assert expert["experts_gate"]["shard_shapes"] == [[4, 64, 32]]
    assert expert["experts_down"]["shard_shapes"] == [[4, 32, 64]]
    assert expert["down_proj"]["shard_shapes"] == [[16, 64]], "the shared expert is split by width either way"


def test_glm4_moe_tp2_control_misplaced_experts_differ(probed):
    """The check catches a wrong split: each device holding its neighbour's experts."""
    got = next(v for k, v in probed.items() if k.startswith("tp2:"))["by_expert_rolled"]["parity"]
    assert got["prefill_err"] > 100 * ATOL and got["decode_err"] > 100 * ATOL, got
