"""The forward's RoPE cos/sin are evaluated once per forward, not once per layer and head.

Left to itself XLA CPU fuses the cos/sin into every layer's q and k rotation, so a decode
step of 8 rows on the 1B paid 32 heads x 64 dims of transcendentals per layer (~7 ms of a
~110 ms step). `ForwardContext.build` computes the tables inside a conditional (models/layers.py:
computed_once), which no fusion crosses. These tests read the compiled HLO of a small forward
on the CPU and check the values are the same as the bare computation's, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import RopeScaling
from models.layers import ForwardContext
from models.rope import apply_rope, rope_cos_sin

LAYERS, ROWS, HEADS, HEAD_DIM = 4, 8, 4, 64


def _rope(positions, valid):
    return {"global": rope_cos_sin(positions, valid, HEAD_DIM, 10000.0, RopeScaling())}


def _layers(q, cos, sin):
    """Each layer rotates a q made from the layer before's output by a product (as the
    decoder's projections make it), so no two layers' rotations can share a fusion."""
    w = jnp.eye(HEADS * HEAD_DIM, dtype=jnp.float32)[::-1]
    for _ in range(LAYERS):
        q = (apply_rope(q, cos, sin).reshape(ROWS, -1) @ w).reshape(q.shape)
    return q


def _forward(q, positions, valid, tables):
    fwd = ForwardContext.build(positions, valid, [tables], [1], 16, _rope, None)
    return _layers(q, *fwd.rope["global"])


def _bare(q, positions, valid, tables):
    """The same rotation with the tables computed in place (what the forward did before)."""
    cos, sin = _rope(positions.reshape(ROWS, 1), valid.reshape(ROWS, 1))["global"]
    return _layers(q, cos.reshape(ROWS, -1), sin.reshape(ROWS, -1))


def _args():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((ROWS, HEADS, HEAD_DIM)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 4000, ROWS), jnp.int32)
    valid = jnp.ones(ROWS, bool)
    tables = jnp.arange(ROWS * 4, dtype=jnp.int32).reshape(ROWS, 4)
    return q, positions, valid, tables


def _cosines(fn) -> int:
    return jax.jit(fn).lower(*_args()).compile().as_text().count(" cosine(")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the tables take the conditional only on the CPU")
def test_cos_sin_are_not_fused_into_each_layer():
    bare = _cosines(_bare)
    assert bare >= LAYERS  # the negative control: left bare, every layer's rotation computes its own
    assert _cosines(_forward) <= 2  # once, in each branch of the one conditional


def test_tables_computed_once_give_the_same_values():
    args = _args()
    np.testing.assert_array_equal(np.asarray(jax.jit(_forward)(*args)), np.asarray(jax.jit(_bare)(*args)))

