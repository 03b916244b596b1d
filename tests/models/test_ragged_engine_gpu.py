"""The ragged GPU kernel end to end through the engine (Pallas interpret mode on the CPU): a
two-layer Llama with the default model's attention geometry (SmolLM2-135M's hidden 576,
head_dim 64, 9 heads over 3 KV heads, RoPE theta 100,000), greedy continuations equal to
the pure-JAX engine's, three prompts at once in steps that mix decode rows with prompt
chunks (tests/models/test_ragged_engine.py's engine and prompts; the TPU kernel's tiny
families are there). Interpret mode compiles the kernel in seconds a layer, so the default
model's 30 layers cost about 100 s on CI's two cores for the same kernel shapes two layers
reach: what the kernel sees per layer (heads, head_dim, the grouping, the block tables and
mixed steps) is the default model's. The default model itself runs through the engine on
the pure-JAX attention in tests/models/test_default_model.py.
"""

from __future__ import annotations

import pytest
import transformers

from tests.models.test_ragged_engine import assert_same_greedy
from tests.support import family_checks as fc

pytestmark = pytest.mark.slow


def test_default_model_geometry_through_the_gpu_kernel_matches_pure_jax(tmp_path):
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                      rope_theta=100000.0, max_position_embeddings=512)
    path = fc.make_checkpoint(tmp_path / "tiny-smollm2-geometry", config)
    assert_same_greedy(str(path), "ragged-gpu-interpret")
