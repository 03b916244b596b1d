"""`models/loaders/common.py:abstract_model` traces the model with a shape-only `rngs`
(`ShapeOnlyRngs`) instead of `nnx.Rngs`: the same graph and the same abstract parameters
(every path, shape and dtype), for the families a plain `ModelConfig` builds, and for a
GGUF's tensor tables and build. The control: a model drawing from another stream than
`params` (which no model here does) fails loudly instead of being traced wrongly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models.config import ModelConfig
from models.layers import param
from models.loaders.common import ShapeOnlyRngs, _traced
from models.registry import family_for

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8, num_kv_heads=4,
            head_dim=8, max_position_embeddings=512)


def flat(state) -> dict:
    return {path: (tuple(v.shape), v.dtype) for path, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_shape_only_trace_is_the_rngs_trace(architecture, dtype):
    cfg = ModelConfig(architecture=architecture, **TINY)
    model_class = family_for(architecture).model
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_class(cfg, dtype, rngs=nnx.Rngs(0))))
    shape_graphdef, shape_state = _traced.__wrapped__(cfg, jnp.dtype(dtype))
    assert shape_graphdef == graphdef
    assert flat(shape_state) == flat(state) and len(flat(state)) > 10


def test_a_draw_from_another_stream_fails_loudly():
    class Dropping(nnx.Module):
        def __init__(self, rngs):
            self.w = param(rngs, (4, 4), jnp.float32)
            self.noise = jax.random.normal(rngs.dropout(), (4,))

    with pytest.raises(AttributeError, match="dropout"):
        nnx.eval_shape(lambda: Dropping(ShapeOnlyRngs()))
    assert nnx.eval_shape(lambda: Dropping(nnx.Rngs(0))).w.shape == (4, 4)
