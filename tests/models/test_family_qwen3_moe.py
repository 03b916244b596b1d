"""Qwen3-MoE against HF transformers: Qwen3's q/k norms, top-2 of 8 experts with the top-k
weights NOT renormalised (norm_topk_prob false), and layer 1 kept dense by
mlp_only_layers. 80 tokens route 160 pairs: every expert of the MoE layer gets traffic."""

from __future__ import annotations

import pytest
import transformers

from tests.support import family_checks as fc

NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=512, num_experts=NUM_EXPERTS,
                                         num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                                         rope_theta=1e6, tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3-moe", config)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_every_expert_gets_traffic(qwen3_moe):
    _, hf, report = qwen3_moe
    assert fc.experts_routed(hf, report.tokens) == [set(range(NUM_EXPERTS))]


def test_config_reads_experts_and_the_dense_layer(qwen3_moe):
    cfg = qwen3_moe[2].config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (NUM_EXPERTS, 2, 32)
    assert not cfg.norm_topk_prob and cfg.dense_layers == (1,) and cfg.intermediate_size == 96


def test_matches_transformers(qwen3_moe):
    fc.assert_report(qwen3_moe[2], "qwen3_moe")


def test_served_end_to_end(qwen3_moe):
    path, hf, _ = qwen3_moe
    fc.assert_served(fc.serve(path), hf, "Qwen3MoeForCausalLM")
