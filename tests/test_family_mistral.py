"""Mistral with a sliding window, no longer refused: every layer attends to its last 12
keys, against HF transformers (the 48-token prompt and 32 decode steps run far past the
window, and the block walk starts past the first chunk once positions pass 43)."""

from __future__ import annotations

import pytest
import transformers

from tests import family_checks as fc


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        sliding_window=12, rope_theta=10000.0, tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("mistral") / "tiny-mistral", config)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_every_layer_slides(mistral):
    cfg = mistral[2].config
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [12, 12]


def test_matches_transformers(mistral):
    fc.assert_report(mistral[2], "mistral")


def test_served_end_to_end(mistral):
    path, hf, _ = mistral
    fc.assert_served(fc.serve(path), hf, "MistralForCausalLM")
