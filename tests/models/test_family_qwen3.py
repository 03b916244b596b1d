"""Qwen3: per-head RMSNorm on q and k before RoPE, and a head_dim of its own (32 while
hidden / heads = 16), against HF transformers; then served end to end."""

from __future__ import annotations

import pytest
import transformers

from tests.support import family_checks as fc


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=512, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", config)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_config_keeps_head_dim_and_has_q_k_norms(qwen3):
    _, _, report = qwen3
    assert report.config.head_dim == 32 and report.config.num_heads * report.config.head_dim == 128
    assert report.config.architecture == "Qwen3ForCausalLM" and not report.config.attention_bias


def test_matches_transformers(qwen3):
    fc.assert_report(qwen3[2], "qwen3")


def test_served_end_to_end(qwen3):
    path, hf, _ = qwen3
    fc.assert_served(fc.serve(path), hf, "Qwen3ForCausalLM")


def test_gguf_loads_the_same_model(qwen3, tmp_path):
    path, hf, report = qwen3
    got = fc.check_gguf(path, tmp_path / "tiny-qwen3.gguf", "qwen3", hf, report.prompt)
    assert got["err"] < fc.ATOL, f"qwen3 GGUF prompt logits differ from HF by {got['err']:.3g}"
    assert got["same_tokens"]
    assert got["config"].head_dim == 32 and got["config"].architecture == "Qwen3ForCausalLM"
