"""The Llama family's windows and refusals (its parity for Llama, Qwen2 and llama3 RoPE is
tests/models/test_parity_hf.py): Mistral with a sliding window, no longer refused, every layer
attending to its last 12 keys, against HF transformers (the 48-token prompt and 32
decode steps run far past the window, and the block walk starts past the first chunk
once positions pass 43); Qwen2's window only with use_sliding_window; what stays refused."""

from __future__ import annotations

import math

import pytest
import transformers

from models.config import UnsupportedModelError
from models.registry import config_from_hf
from tests.support import family_checks as fc

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 32,
         "max_window_layers": 2}


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


@pytest.mark.parametrize("use,windows", [(False, [None] * 4), (True, [None, None, 32, 32])])
def test_qwen2_window_needs_use_sliding_window(use, windows):
    """As transformers: the window is dropped unless use_sliding_window, and then covers
    the layers from max_window_layers on."""
    cfg = config_from_hf({**QWEN2, "use_sliding_window": use})
    assert [cfg.window(i) for i in range(4)] == windows


def test_yarn_rope_scaling_is_read_as_transformers_does():
    """YaRN (served since gpt-oss brought it) in any family's config: the context extension
    from the dict, its attention factor YaRN's mscale 0.1 * ln(4) + 1."""
    cfg = config_from_hf({**QWEN2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768}})
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("yarn", 4.0)
    assert cfg.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1) and cfg.rope_scaling.truncate


@pytest.mark.parametrize("change,named", [({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
                                          ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
                                          ({"hidden_act": "gelu"}, "gelu")])
def test_what_stays_refused_is_named(change, named):
    with pytest.raises(UnsupportedModelError, match=named):
        config_from_hf({**QWEN2, **change})
