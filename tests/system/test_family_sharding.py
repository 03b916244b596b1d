"""Tensor parallelism for the new families on 4 CPU devices (one subprocess, as
tests/system/test_sharding.py runs tests/support/sharding_probe.py): Gemma 2 (dense; sliding window and
soft-capping under sharded heads) and Qwen3-MoE (experts split over their intermediate
axis, q/k norms replicated, one dense layer) match one device, and their weights really
are split. Both have 4 KV heads so attention is split too.

GLM-4.5 (2 KV heads, so tp 2) in the same subprocess: q/k/v biases and per-head q/k norms
under split heads, grouped sigmoid routing, a shared expert and a dense layer, with its 8
experts split by width (tensor parallelism alone) and by expert (`--expert-parallel`, 4
whole experts per device); the control rolls the expert stacks one device along E.

Qwen3.5, Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet layers beside gated attention; 2 k / 4 v
heads, so tp 2) in the same subprocess (tests/support/deltanet_tp_probe.py): two rows prefilled
in two chunks then decoded together match one device, the layer's weights and the state pool
are split by head, a decode step's only collectives are each layer's two row-parallel
all-reduces and the vocab's, 0 recompiles after warm-up; the control pairs each device's key
heads with the next device's value heads. Qwen3.5 speculates there too (prompt lookup at tp 2
against one device without it); its control reads the wrong state entry.
(`--speculative mtp` at tp 2: tests/system/test_family_sharding_mtp.py.)"""

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
    return _probe("families", str(gemma2), str(moe), "--tp2-ep", str(glm4_moe(root / "glm4moe")),
                  "--tp2-state", *map(str, deltanet_checkpoints(root)), timeout_s=600)


DELTANET_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
DELTANET_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       layer_types=DELTANET_LAYERS, max_position_embeddings=512, tie_word_embeddings=False)


DELTANET_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48)


def deltanet_checkpoints(root):
    """The tiny Qwen3.5, Qwen3-Next and Qwen3.5-MoE of tests/models/test_family_qwen3_5.py
    (Qwen3-Next: top-2 of 4 experts, a shared expert of width 48, layer 2 dense; Qwen3.5-MoE:
    Qwen3.5's unfused DeltaNet with those experts on every layer)."""
    qwen3_next = transformers.Qwen3NextConfig(**DELTANET_SHAPES, **DELTANET_EXPERTS, mlp_only_layers=[2])
    qwen3_next.architectures = ["Qwen3NextForCausalLM"]
    qwen3_5_moe = transformers.Qwen3_5MoeTextConfig(**DELTANET_SHAPES, **DELTANET_EXPERTS)
    qwen3_5_moe.architectures = ["Qwen3_5MoeForCausalLM"]
    return (qwen3_5_checkpoint(root), fc.make_checkpoint(root / "qwen3_next", qwen3_next),
            fc.make_checkpoint(root / "qwen3_5_moe", qwen3_5_moe))


def qwen3_5_checkpoint(root):
    qwen3_5 = transformers.Qwen3_5TextConfig(**DELTANET_SHAPES)
    qwen3_5.architectures = ["Qwen3_5ForCausalLM"]
    return fc.make_checkpoint(root / "qwen3_5", qwen3_5)


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


def _deltanet(probed, name):
    return next(v for k, v in probed.items() if k.startswith("state:") and k.endswith(name))


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_deltanet_tp2_matches_one_device(probed, name):
    """Two rows in one step, each prompt in two chunks (the second continues the states from
    the slots), then 4 greedy steps with the rows batched: tp 2 against one device."""
    got = _deltanet(probed, name)["parity"]
    assert got["prefill_err"] < ATOL, f"{name} tp=2: prefill logits differ by {got['prefill_err']}"
    assert got["decode_err"] < ATOL, f"{name} tp=2: decode logits differ by {got['decode_err']}"
    assert got["same_greedy"], f"{name} tp=2: greedy tokens changed"


def test_deltanet_tp2_splits_weights_and_state_pool_by_head(probed):
    place = _deltanet(probed, "qwen3_5")["placement"]
    # 2 k heads / 4 v heads of 16 over 2 devices: C = 2*2*16 + 4*16 = 128 -> 64 channels each
    assert place["in_proj_qkv"]["shard_shapes"] == [[64, 64]]
    assert place["in_proj_z"]["shard_shapes"] == [[64, 32]], "2 value heads x 16"
    assert place["in_proj_b"]["shard_shapes"] == place["in_proj_a"]["shard_shapes"] == [[64, 2]]
    assert place["A_log"]["shard_shapes"] == place["dt_bias"]["shard_shapes"] == [[2]]
    assert place["conv_weight"]["shard_shapes"] == [[64, 1, 4]]
    assert place["out_proj"]["shard_shapes"] == [[32, 64]], "row-parallel"
    assert place["gate_norm"]["shard_shapes"] == [[16]], "the gated norm's weight (per dv) is replicated"
    # the pool: max_rows 4 + the null slot; conv by channel, recurrent by value head
    assert place["conv_pool"]["shard_shapes"] == [[5, 3, 64]]
    assert place["recurrent_pool"]["shard_shapes"] == [[5, 2, 16, 16]]
    fused = _deltanet(probed, "qwen3_next")["placement"]
    # per k head: q 16, k 16, v and z 2 x 16 each -> one whole group of 96 per device; b, a 2 each
    assert fused["in_proj_qkvz"]["shard_shapes"] == [[64, 96]]
    assert fused["in_proj_ba"]["shard_shapes"] == [[64, 4]]
    assert fused["conv_weight"]["shard_shapes"] == [[64, 1, 4]]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_deltanet_tp2_decode_step_reduces_only_after_row_parallel_products(probed, name):
    """Every head's conv, delta rule and gated norm stay on its device: nothing of the
    mixers is gathered, and the [1, D] all-reduces are the row-parallel products'."""
    got = _deltanet(probed, name)
    ops = got["collectives"]
    gathered = [shape for op, shape in ops if op == "all-gather"]
    assert all(shape.endswith(f",{got['vocab_size']}]") for shape in gathered), f"{name}: gathers {gathered}"
    assert not [op for op, _ in ops if op in ("all-to-all", "collective-permute", "reduce-scatter")], ops
    if name == "qwen3_5":  # per layer: the mixer's out_proj / o_proj and the MLP's down_proj
        hidden = [shape for op, shape in ops if op == "all-reduce" and shape == f"f32[1,{got['hidden_size']}]"]
        assert len(hidden) == 2 * got["num_layers"] + 1, f"{len(hidden)} all-reduces of [1, D] (+1: the embedding)"


def test_deltanet_tp2_control_ungrouped_channels_cross_devices(probed):
    """The collectives check catches a split that is not by head: HF's q | k | v order cut in
    two halves makes XLA move q, k and v channels between the devices in every DeltaNet layer."""
    got = _deltanet(probed, "qwen3_5")
    moved = [(op, shape) for op, shape in got["ungrouped_collectives"]
             if op in ("all-to-all", "collective-permute", "all-gather") and not shape.endswith(f",{got['vocab_size']}]")]
    assert moved, got["ungrouped_collectives"]


def test_deltanet_tp2_zero_recompiles_and_the_pool_stays_split(probed):
    got = _deltanet(probed, "qwen3_5")
    assert got["recompiles_after_warmup"] == 0
    assert got["recurrent_pool_after_workload"]["shard_shapes"] == [[5, 2, 16, 16]]


def test_deltanet_tp2_control_value_heads_on_the_wrong_device_differ(probed):
    """The check catches a wrong grouping: each device's key heads beside the next device's value heads."""
    got = _deltanet(probed, "qwen3_5")["misgrouped"]
    assert got["prefill_err"] > 100 * ATOL and got["decode_err"] > 100 * ATOL, got


def test_qwen3_5_moe_tp2_splits_deltanet_by_head_and_experts_by_width(probed):
    """Qwen3.5's unfused DeltaNet split (the conv channels grouped per device) beside Qwen3-Next's
    experts split by width and its shared expert as a dense MLP, in one model."""
    place = _deltanet(probed, "qwen3_5_moe")["placement"]
    assert place["in_proj_qkv"]["shard_shapes"] == [[64, 64]]
    assert place["conv_weight"]["shard_shapes"] == [[64, 1, 4]]
    assert place["out_proj"]["shard_shapes"] == [[32, 64]]
    assert place["experts_gate"]["shard_shapes"] == [[4, 64, 16]], "4 experts of width 32: 16 columns of each"
    assert place["experts_down"]["shard_shapes"] == [[4, 16, 64]]
    assert place["shared_gate"]["shard_shapes"] == [[64, 24]] and place["shared_down"]["shard_shapes"] == [[24, 64]]
    assert place["recurrent_pool"]["shard_shapes"] == [[5, 2, 16, 16]]


def test_deltanet_tp2_speculation_matches_one_device_without(probed):
    """Prompt lookup at tp 2 (two rows of 1 + 3 verified tokens a step) against one device
    without speculation: the same tokens, logprobs within 1e-4, drafts both accepted and
    rejected (so the next step read entries other than 0)."""
    got = _deltanet(probed, "qwen3_5")["speculation"]
    assert got["same_tokens"], "speculation at tp 2 changed the greedy reply"
    assert got["logprob_err"] < ATOL, f"logprobs moved by {got['logprob_err']}"
    assert 0 < got["accepted"] < got["drafted"], f"{got['accepted']} of {got['drafted']} drafts accepted"
    assert got["steps"] < got["steps_off"], "accepted drafts save steps"
    assert got["recompiles_after_warmup"] == 0


def test_deltanet_tp2_speculation_splits_every_entry_and_replicates_positions(probed):
    got = _deltanet(probed, "qwen3_5")["speculation"]
    slots, entries = got["step_rows"] + 1, got["entries"]  # the null slot, one a row; 1 + k entries each
    assert entries == 4
    assert got["conv_pool"]["shard_shapes"] == [[slots * entries, 3, 64]], "entries split by channel"
    assert got["recurrent_pool"]["shard_shapes"] == [[slots * entries, 2, 16, 16]], "entries split by value head"
    assert got["positions"]["shard_shapes"] == [[slots]] and got["positions"]["num_shards"] == 2, "replicated"


def test_deltanet_tp2_verification_step_adds_no_collective(probed):
    """The entry each row reads, its run's conv window and the state after the row before it
    are gathered on each device: a speculating runner's decode step has exactly the
    collectives of a plain one at the same shape."""
    got = _deltanet(probed, "qwen3_5")["speculation"]
    assert got["collectives"] == got["plain_collectives"], (got["collectives"], got["plain_collectives"])


def test_deltanet_tp2_speculation_control_wrong_entry_changes_the_reply(probed):
    """The check catches the wrong entry on the mesh: the states kept after every verified
    token (rejected drafts included) change the tokens or move the logprobs far past 1e-4."""
    bad = _deltanet(probed, "qwen3_5")["speculation"]["no_rollback"]
    assert not bad["same_tokens"] or bad["logprob_err"] > 1e-3, bad


def test_deltanet_heads_not_dividing_the_width_are_refused():
    from ferrox_jax.sharding import check_divisibility
    from models.qwen3_5 import Qwen3_5Config

    cfg = Qwen3_5Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=4, head_dim=16, max_position_embeddings=512, linear_layers=(True, False),
                        linear_num_key_heads=2, linear_num_value_heads=4)
    check_divisibility(cfg, 2, replicate_attention=False)
    with pytest.raises(ValueError, match=r"tensor parallelism 4 .*linear_num_key_heads 2, linear_num_value_heads 4"):
        check_divisibility(cfg, 4, replicate_attention=False)
    check_divisibility(cfg, 4, replicate_attention=True)  # the mixers and the pool replicated
