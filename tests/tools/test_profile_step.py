"""tools/bench/profile_step.py's parts measure what the step computes.

On a tiny Qwen3 in llama.cpp's Q4_K_M mix (hidden 256: one super-block a row; 2 layers), on
the K-quant kernel: the projection chain it times fused (q/k/v and gate/up one kernel call
each) gives the unfused chain's values bit for bit, so its A/B compares the same math; the
LM head timed in pieces is the whole head's product; the per-kind chains count the bytes
of every layer's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as Q

from models import cpu_kernels
from models.layers import project
from models.loader import open_checkpoint
from tests.support import family_checks as fc
from tests.support.gguf_from_hf import write_gguf
from tests.support.kquant_blocks import quantize_k
from tools.bench import profile_step

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
Q6_NAMES = ("v_proj", "attn_v", "down_proj", "ffn_down", "lm_head", "output")  # Q4_K_M's Q6_K tensors


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    base = fc.make_checkpoint(tmp / "tiny-qwen3", config)

    def quant(name, arr):
        if "embed" in name or "token_embd" in name or arr.ndim != 2:
            return None
        fmt = "q6_k" if name.split(".")[-2] in Q6_NAMES else "q4_k"
        return quantize_k(arr, fmt), {"q4_k": Q.Q4_K, "q6_k": Q.Q6_K}[fmt]

    built = open_checkpoint(str(write_gguf(base, tmp / "tiny.gguf", "qwen3", quant=quant))).build(quantization="gguf")
    cpu_kernels.pack_blocks_for_kernel(built)
    return built


def _x(model, rows: int = 1, seed: int = 0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, model.cfg.hidden_size)), jnp.float32)


@needs_kernels
def test_fused_chain_is_the_unfused_chain_bit_for_bit(model):
    x = _x(model)
    fused, unfused = profile_step.matmul_chain(model), profile_step.matmul_chain(model, fused=False)
    want = np.asarray(unfused(x))
    np.testing.assert_array_equal(np.asarray(fused(x)), want)
    # the A/B really differs in its calls: 2 fused calls a layer where the unfused chain makes 5
    weights = [profile_step._weight(layer, "q_proj") for layer in model.layers]
    assert weights[0].kernel == cpu_kernels.BLOCK_K_TARGET
    hlo = jax.jit(lambda x: profile_step._many(x, [profile_step._weight(model.layers[0], n)
                                                   for n in ("q_proj", "k_proj", "v_proj")], True)).lower(x).as_text()
    assert cpu_kernels.BLOCK_K_MULTI_TARGET in hlo
    # negative control: the same chain over a model with one layer's q and o swapped (both
    # [256, 256]; the chain multiplies q's output by o) gives other values
    layer = model.layers[0]
    q, o = layer.q_proj.get_value(), layer.o_proj.get_value()
    try:
        layer.q_proj.set_value(o)
        layer.o_proj.set_value(q)
        assert not np.array_equal(np.asarray(profile_step.matmul_chain(model)(x)), want)
    finally:
        layer.q_proj.set_value(q)
        layer.o_proj.set_value(o)


@needs_kernels
def test_head_pieces_multiply_as_the_whole_head(model):
    head = model.lm_head.get_value()
    pieces = profile_step._head_pieces(head, rows=64)
    assert len(pieces) == -(-head.out_features // 64) > 1
    x = _x(model, rows=2, seed=1)
    whole = np.asarray(project(x, head))
    parts = [np.asarray(project(x, piece)) for piece in pieces]
    np.testing.assert_array_equal(np.concatenate(parts, axis=-1), whole)
    assert not np.array_equal(np.concatenate(parts[::-1], axis=-1), whole)  # the order is checked
    assert sum(profile_step._nbytes(p) for p in pieces) == profile_step._nbytes(head)


@needs_kernels
def test_kind_chains_count_every_layers_bytes(model):
    for name, names in profile_step.KINDS:
        run, in_features, nbytes, calls = profile_step.kind_chain(model, names)
        want = sum(profile_step._nbytes(profile_step._weight(layer, n)) for layer in model.layers for n in names)
        assert (nbytes, calls) == (want, len(model.layers)), name
        assert np.all(np.isfinite(np.asarray(run(jnp.ones((1, in_features), jnp.float32)))))
        singles = profile_step.single_calls(model, names)
        assert len(singles) == len(model.layers) and sum(b for _, b in singles) == want


def test_row_tables_stay_inside_the_cache_or_exit_naming_the_sizes():
    """Tables past the cache once had the attention kernel read past its buffer (profile_step
    --rows 128 on a 3B whose cache held 1,170 blocks): the tools now stop first."""
    from types import SimpleNamespace

    from tools.bench.bench_engine import row_tables

    runner = SimpleNamespace(block_size=16, num_blocks=1 + 3 * 2 + 1)  # 8 blocks: 1..7 usable
    tables = row_tables(runner, 3, 32)  # 2 blocks a row
    assert tables == [(1, 2), (3, 4), (5, 6)]
    assert row_tables(runner, 3, 32, extra_blocks=1)[-1] == (5, 6)  # block 7 left for the chunk
    with pytest.raises(SystemExit, match=r"3 rows x 2 blocks \+ 2 do not fit in the cache's 8 KV blocks"):
        row_tables(runner, 3, 32, extra_blocks=2)
    with pytest.raises(SystemExit, match="4 rows x 2 blocks do not fit"):
        row_tables(runner, 4, 17)
