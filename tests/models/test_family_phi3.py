"""Phi-3 against HF transformers: fused qkv_proj and gate_up_proj split at load, longrope
(original context 32 < the 48-token prompt, so the long factors and the attention factor
apply from the first step, as in HF's one-shot reference), partial rotary (half of each
head) and a 16-key sliding window on every layer; and the same weights through the GGUF
loader (fused attn_qkv / ffn_up, longrope factors as tensors).

longrope picks its table from the longest position of each call, in transformers and
here alike, so a prompt prefilled in chunks across the original context rotates its
early chunks with the short table: chunked prefill is compared with HF prefilling the
same chunks into its cache, not with one-shot."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers

from models.config import RopeScaling
from models.rope import rope_inv_freq
from tests.support import family_checks as fc

HEAD_DIM, ROTARY = 16, 8
SHORT = [1.0, 1.3, 1.9, 2.6]  # rotary/2 per-frequency divisors
LONG = [1.2, 2.1, 4.5, 9.0]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    config = transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, original_max_position_embeddings=32, sliding_window=16,
        rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                      "partial_rotary_factor": ROTARY / HEAD_DIM},
        partial_rotary_factor=ROTARY / HEAD_DIM, rope_theta=10000.0, tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("phi3") / "tiny-phi3", config)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf, chunked_vs_hf=True)


def test_config_reads_longrope_partial_rotary_and_window(phi3):
    cfg = phi3[2].config
    scaling = cfg.rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("longrope", 32)
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(128 / 32) / math.log(32)))
    assert cfg.rotary_dim == ROTARY and cfg.window(0) == cfg.window(1) == 16


def test_matches_transformers(phi3):
    fc.assert_report(phi3[2], "phi3")


@pytest.mark.parametrize("long", [False, True])
def test_longrope_tables_match_transformers(phi3, long):
    """Both tables against transformers' own longrope init (short within the original context)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, hf, report = phi3
    cfg = report.config
    want, attention = ROPE_INIT_FUNCTIONS["longrope"](hf.config, torch.device("cpu"), seq_len=33 if long else 10)
    got = rope_inv_freq(ROTARY, cfg.rope_theta, cfg.rope_scaling, long=long)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert cfg.rope_scaling.attention_factor == pytest.approx(attention)


def test_split_weights_are_the_fused_rows(phi3):
    """q/k/v are consecutive row blocks of qkv_proj ([(4 + 2 + 2) * 16, 64]), gate then up of gate_up_proj."""
    from models.loader import load_checkpoint

    path, hf, _ = phi3
    model = load_checkpoint(str(path)).model
    layer, ref = model.layers[1], hf.model.layers[1]
    qkv = ref.self_attn.qkv_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(layer.k_proj[...]), qkv[64:96].T)
    gate_up = ref.mlp.gate_up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(layer.up_proj[...]), gate_up[128:].T)


def test_gguf_loads_the_same_model(phi3, tmp_path):
    path, hf, report = phi3
    got = fc.check_gguf(path, tmp_path / "tiny-phi3.gguf", "phi3", hf, report.prompt)
    assert got["err"] < fc.ATOL, f"phi3 GGUF prompt logits differ from HF by {got['err']:.3g}"
    cfg, ref = got["config"], got["reference_config"]
    assert cfg.rope_scaling.long_factor == pytest.approx(ref.rope_scaling.long_factor)
    assert cfg.rope_scaling.attention_factor == pytest.approx(ref.rope_scaling.attention_factor)
    assert (cfg.rotary_dim, cfg.sliding_window) == (ref.rotary_dim, ref.sliding_window)


def test_served_end_to_end(phi3):
    path, hf, _ = phi3
    fc.assert_served(fc.serve(path), hf, "Phi3ForCausalLM")


def test_short_factors_within_the_original_context():
    """RopeScaling picks short below the original context, long past it (one row each)."""
    import jax.numpy as jnp

    from models.rope import rope_cos_sin

    scaling = RopeScaling("longrope", factor=4.0, original_max_position_embeddings=32, short_factor=tuple(SHORT),
                          long_factor=tuple(LONG), attention_factor=1.0)
    positions = jnp.asarray([[5, 31], [5, 32]])  # row 0 ends at length 32, row 1 at 33
    cos, _ = rope_cos_sin(positions, jnp.ones((2, 2), bool), ROTARY, 10000.0, scaling)
    short = np.cos(5 * rope_inv_freq(ROTARY, 10000.0, scaling))
    long = np.cos(5 * rope_inv_freq(ROTARY, 10000.0, scaling, long=True))
    np.testing.assert_allclose(np.asarray(cos[0, 0, :ROTARY // 2]), short, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cos[1, 0, :ROTARY // 2]), long, rtol=1e-6)
