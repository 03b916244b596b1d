"""Gemma 3 (text) against HF transformers: Gemma 2's layer plus (1 + w) q/k norms per head,
a local RoPE (base 10000, unscaled) on sliding layers and the global one (base 1e6,
linear scaling 8) on full layers, no soft-capping; and the same weights through the GGUF
loader. Layer 0 slides over 16 keys, layer 1 is full."""

from __future__ import annotations

import pytest
import transformers

from models.registry import config_from_hf
from tests.support import family_checks as fc


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=32, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0})
    config.architectures = ["Gemma3ForCausalLM"]
    path = fc.make_checkpoint(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", config)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_config_has_local_and_global_rope(gemma3):
    cfg = gemma3[2].config
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (1_000_000.0, "linear", 8.0)
    assert (cfg.rope_local_theta, cfg.rope_local_scaling.rope_type) == (10000.0, "default")
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None


def test_matches_transformers(gemma3):
    fc.assert_report(gemma3[2], "gemma3")


def test_gguf_loads_the_same_model(gemma3, tmp_path):
    path, hf, report = gemma3
    got = fc.check_gguf(path, tmp_path / "tiny-gemma3.gguf", "gemma3", hf, report.prompt)
    assert got["err"] < fc.ATOL, f"gemma3 GGUF prompt logits differ from HF by {got['err']:.3g}"
    assert got["same_tokens"]
    cfg, ref = got["config"], got["reference_config"]
    assert (cfg.layer_types, cfg.rope_local_theta, cfg.rope_scaling) == \
        (ref.layer_types, ref.rope_local_theta, ref.rope_scaling)


def test_hub_style_config_uses_the_sliding_window_pattern():
    """Hub configs predate layer_types: sliding_window_pattern 6 makes layers 0-4 slide and 5 full;
    rope_local_base_freq is the local base, rope_scaling applies to full layers only."""
    cfg = config_from_hf({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256})
    assert [cfg.window(i) for i in range(7)] == [512] * 5 + [None] + [512]
    assert (cfg.rope_local_theta, cfg.rope_scaling.factor) == (10000.0, 8.0)
    assert cfg.rope_local_scaling.rope_type == "default"


def test_vision_checkpoint_reads_its_text_model():
    """A `Gemma3ForConditionalGeneration` config is its text_config plus the vision encoder's shape
    (tests/models/test_family_gemma3_vlm.py serves one against HF)."""
    cfg = config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
                          "text_config": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                                          "num_hidden_layers": 2, "num_attention_heads": 4,
                                          "num_key_value_heads": 2, "head_dim": 16},
                          "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                                            "intermediate_size": 64, "image_size": 32, "patch_size": 4},
                          "mm_tokens_per_image": 16})
    assert (cfg.architecture, cfg.hidden_size, cfg.eos_token_ids) == ("Gemma3ForConditionalGeneration", 64, (1, 106))
    assert (cfg.vision.num_patches, cfg.vision.tokens_per_image) == (64, 16)


def test_served_end_to_end(gemma3):
    path, hf, _ = gemma3
    fc.assert_served(fc.serve(path), hf, "Gemma3ForCausalLM")
