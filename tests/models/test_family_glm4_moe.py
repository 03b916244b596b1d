"""GLM-4.5 (Glm4MoeForCausalLM) against HF transformers: GQA with q/k/v biases, per-head
q/k norms and half-rotary RoPE, DeepSeek-style grouped sigmoid routing (a non-zero
e_score_correction_bias, 2 of 4 groups kept, a shared expert) and layer 0 dense."""

from __future__ import annotations

import pytest
import transformers

from tests.support import family_checks as fc

NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    import torch

    config = transformers.Glm4MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=512, n_routed_experts=NUM_EXPERTS,
                                        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                        first_k_dense_replace=1, routed_scaling_factor=1.8, norm_topk_prob=True,
                                        attention_bias=True, use_qk_norm=True, tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("glm4moe") / "tiny-glm4-moe", config)
    hf = fc.hf_model(path)
    torch.manual_seed(4)
    with torch.no_grad():
        # a buffer the random init leaves at zero: make the choice bias matter
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(NUM_EXPERTS))
        for layer in hf.model.layers:  # the init's ~1.0 biases make every token's values alike
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(0.1 * torch.randn_like(proj.bias))
    hf.save_pretrained(path)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_config_reads_attention_and_routing(glm):
    cfg = glm[2].config
    assert cfg.rotary_dim == 8 and cfg.head_dim == 16 and cfg.attention_bias and cfg.qk_norm
    assert (cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (NUM_EXPERTS, 4, 2, 1)
    assert cfg.routed_scaling_factor == 1.8 and cfg.dense_layers == (0,)
    assert cfg.kv_cache_dims() == (2, 16, 16)  # plain GQA heads


def test_every_group_gets_traffic(glm):
    _, hf, report = glm
    (routed,) = fc.experts_routed(hf, report.tokens)
    assert all(routed & {2 * g, 2 * g + 1} for g in range(4)) and len(routed) >= 6, routed


def test_matches_transformers(glm):
    fc.assert_report(glm[2], "glm4_moe")


def test_served_end_to_end(glm):
    path, hf, _ = glm
    fc.assert_served(fc.serve(path), hf, "Glm4MoeForCausalLM")
