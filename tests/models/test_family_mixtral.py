"""Mixtral against HF transformers: top-2 of 4 experts with renormalised softmax weights,
experts computed only for their tokens (models/moe.py). The 80-token sequence routes
160 (token, expert) pairs, so every expert of every layer gets traffic (asserted)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from models.layers import silu
from models.moe import moe_mlp, route, tile_rows
from tests.support import family_checks as fc

NUM_EXPERTS = 4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        num_local_experts=NUM_EXPERTS, num_experts_per_tok=2, rope_theta=1e6,
                                        tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("mixtral") / "tiny-mixtral", config)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_every_expert_gets_traffic(mixtral):
    _, hf, report = mixtral
    assert fc.experts_routed(hf, report.tokens) == [set(range(NUM_EXPERTS))] * 2


def test_config_reads_the_experts(mixtral):
    cfg = mixtral[2].config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (NUM_EXPERTS, 2, 64)
    assert cfg.norm_topk_prob and cfg.dense_layers == ()


def test_matches_transformers(mixtral):
    fc.assert_report(mixtral[2], "mixtral")


def test_served_end_to_end(mixtral):
    path, hf, _ = mixtral
    fc.assert_served(fc.serve(path), hf, "MixtralForCausalLM")


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_moe_block_equals_every_expert_weighted(num_tokens):
    """The tiled, routed-only computation against all experts on all tokens weighted by the
    routing (zero for unrouted experts); 5 tokens x top-2 over 4 experts leaves some
    experts idle, 37 x 2 fills several tiles per expert."""
    rng = np.random.RandomState(num_tokens)
    d, f, e = 16, 24, NUM_EXPERTS
    x = jnp.asarray(rng.randn(num_tokens, d), jnp.float32)
    router, gate, up, down = (jnp.asarray(rng.randn(*s) * 0.3, jnp.float32)
                              for s in ((d, e), (e, d, f), (e, d, f), (e, f, d)))
    got = moe_mlp(x, router, gate, up, down, top_k=2, normalize=True, act=silu)
    weights, experts = route(x, router, 2, True)
    dense = jnp.zeros((num_tokens, e)).at[jnp.arange(num_tokens)[:, None], experts].add(weights)
    every = jnp.einsum("nef,efd->ned", jax.nn.silu(jnp.einsum("nd,edf->nef", x, gate)) *
                       jnp.einsum("nd,edf->nef", x, up), down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.einsum("ned,ne->nd", every, dense)), atol=1e-5)


def test_tile_rows_follow_rows_per_expert():
    assert tile_rows(2, 8) == 8  # decode, 1 row x top-2: the smallest tile
    assert tile_rows(64, 8) == 8  # 32 rows x top-2 over 8 experts: 8 per expert
    assert tile_rows(256, 8) == 32  # a 128-token prefill: 32 per expert
    assert tile_rows(128 * 8, 128) == 8 and tile_rows(10_000, 8) == 64


def test_gguf_loads_the_same_model(mixtral, tmp_path):
    """Written as llama.cpp writes Mixtral (architecture `llama` with expert_count, q/k rows
    permuted, the experts stacked into ffn_*_exps): HF's logits. The experts are square
    (D = F = 64), so a stack read untransposed would load and miss HF by far: parity is the
    control for the per-expert transpose."""
    path, hf, report = mixtral
    got = fc.check_gguf(path, tmp_path / "tiny-mixtral.gguf", "llama", hf, report.prompt)
    assert got["err"] < fc.ATOL, f"mixtral GGUF prompt logits differ from HF by {got['err']:.3g}"
    cfg = got["config"]
    assert cfg.architecture == "MixtralForCausalLM"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (NUM_EXPERTS, 2, 64)
    assert got["same_tokens"]
