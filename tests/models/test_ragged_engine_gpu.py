"""The ragged GPU kernel end to end through the engine (Pallas interpret mode on the CPU) on
the default model (SmolLM2-135M: 30 layers, head_dim 64, 9 heads over 3 KV heads): greedy
continuations equal to the pure-JAX engine's, three prompts at once in steps that mix
decode rows with prompt chunks (tests/models/test_ragged_engine.py's engine and prompts;
the TPU kernel's tiny families are there). Interpret mode compiles the kernel in seconds a
layer, so this is a file of its own: the two halves run on both workers.
"""

from __future__ import annotations

import pytest

from tests.models.test_ragged_engine import assert_same_greedy

pytestmark = pytest.mark.slow


def test_default_model_through_the_gpu_kernel_matches_pure_jax():
    assert_same_greedy("default", "ragged-gpu-interpret")
