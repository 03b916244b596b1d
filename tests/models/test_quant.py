"""Quantized serving: int8 weights (weight-only and w8a8), GGUF blocks read straight to int8,
the KV cache dtype, and what the facade reports.

Tolerances come from the quantization error, derived next to each assertion. The tiny
model is the 2-layer random Llama of `tests/support/tiny_model.py` (hidden 64, weights N(0, 0.08)).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ferrox_jax.config import QUANTIZATION_NAMES, EngineConfig
from ferrox_jax.engine_builder import plan_memory, size_kv
from ferrox_jax.plan import RowPlan
from ferrox_jax.runner import ModelRunner
from models.loader import load_checkpoint, open_checkpoint
from models.quant import (INT8_MAX, QUANTIZATION_MODES, QuantizedWeight, dequantize, quantize, quantize_host,
                          quantized_matmul, requantize_blocks)
from tests.support.engine_helpers import default_model_case, prompt_logits, shuffled_blocks
from tests.support.sharding_probe import mixed_workload
from tests.models.test_gguf_loader import D, F, H, HD, KV, L, V, write_tiny_gguf

MODES = ("int8", "w8a8", "w8a8-block32")


def test_config_and_model_name_the_same_modes():
    assert QUANTIZATION_NAMES == QUANTIZATION_MODES + ("auto",)  # auto resolves to one of them at load


# ---- the quantized weight ----------------------------------------------------------------

def test_quantize_error_is_at_most_half_a_step_per_channel():
    w = np.random.RandomState(0).randn(96, 40).astype(np.float32)
    values, scales = quantize_host(w, channel_axis=1)
    assert values.dtype == np.int8 and scales.shape == (40,)
    assert np.abs(values).max() == INT8_MAX, "each channel's largest weight maps to +-127"
    err = np.abs(values * scales - w)
    # round-to-nearest: at most half a step, the step being max|w| / 127 of the column
    assert (err <= scales / 2 * (1 + 1e-6)).all()
    on_device = quantize(jnp.asarray(w), "w8a8")
    np.testing.assert_array_equal(np.asarray(on_device.values), values)
    np.testing.assert_allclose(np.asarray(dequantize(on_device)), values * scales, rtol=1e-6)


def test_embedding_scales_are_per_row():
    w = np.random.RandomState(1).randn(10, 6).astype(np.float32)
    values, scales = quantize_host(w, channel_axis=0)
    assert scales.shape == (10,)
    np.testing.assert_allclose(scales, np.abs(w).max(axis=1) / INT8_MAX, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("mode", MODES)
def test_quantized_matmul_matches_the_dequantized_product(mode, rows):
    rng = np.random.RandomState(2)
    x = jnp.asarray(rng.randn(rows, 64).astype(np.float32))
    qw = quantize(jnp.asarray(rng.randn(64, 48).astype(np.float32)), mode)
    ref = np.asarray(x @ dequantize(qw))
    got = np.asarray(quantized_matmul(x, qw))
    assert got.shape == (rows, 48)
    if mode == "int8":
        # the same weights, only the order of float operations differs
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    else:
        # Per-row int8 activations: each x_k moves by at most half a step, max|x_row| / 254,
        # so one output moves by at most sum_k |w_kn| * max|x_row| / 254.
        bound = np.abs(np.asarray(dequantize(qw))).sum(0)[None, :] * np.abs(np.asarray(x)).max(1, keepdims=True) / 254
        assert (np.abs(got - ref) <= bound * (1 + 1e-5)).all()
        assert np.abs(got - ref).max() > 0, "w8a8 really quantized the activations"


def test_block32_activations_give_exact_block_dots_and_a_tighter_error():
    """w8a8-block32: the product equals numpy's exact int64 block dots times each block's
    scale (f32 rounding only), and a row with one outlier feature loses far less than under
    one per-row scale (each block's values keep their own step)."""
    rng = np.random.RandomState(7)
    k, nb = 512, 16
    x = rng.randn(3, k).astype(np.float32)
    x[1, 5] = 60.0  # an outlier feature: the per-row scale's step becomes 60 / 127
    qw = quantize(jnp.asarray(rng.randn(k, 40).astype(np.float32) * 0.1), "w8a8-block32")
    xb = x.reshape(3, nb, 32)
    amax = np.abs(xb).max(-1)
    scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
    q = np.clip(np.rint(xb / scale[..., None]), -127, 127).astype(np.int64)
    w = np.asarray(qw.values).astype(np.int64).reshape(nb, 32, 40)
    want = np.einsum("mbk,bkn->mbn", q, w).astype(np.float64)
    want = (want * scale[..., None]).sum(1) * np.asarray(qw.scales)
    got = np.asarray(quantized_matmul(jnp.asarray(x), qw))
    mag = (np.abs(q) * scale[..., None]).reshape(3, k) @ np.abs(np.asarray(dequantize(qw)))
    assert (np.abs(got - want) <= 1e-5 * mag).all()
    # Row 1: one of 16 blocks keeps the outlier's coarse step, instead of all 16 (RMS ~ 1/4).
    exact = x.astype(np.float64) @ np.asarray(dequantize(qw), np.float64)
    per_row = np.asarray(quantized_matmul(jnp.asarray(x), dataclasses.replace(qw, mode="w8a8")))
    rms_block, rms_row = (np.sqrt(np.mean((y - exact)[1] ** 2)) for y in (got, per_row))
    assert 0 < rms_block < rms_row / 2, f"block scales {rms_block:.3g} vs one row scale {rms_row:.3g}"


def test_requantize_blocks_is_exact_when_a_row_shares_one_scale():
    rng = np.random.RandomState(3)
    ints = rng.randint(-127, 128, size=(4, 64)).astype(np.int8)
    ints[:, ::32] = 127  # every block reaches 127, so the row scale is the block scale
    d = np.array([0.5, 0.25, 2.0, 1.0], np.float32)[:, None].repeat(2, axis=1)
    values, scales = requantize_blocks(ints, d)
    np.testing.assert_array_equal(values, ints)
    np.testing.assert_array_equal(scales, d[:, 0])


def test_requantize_blocks_error_is_half_a_row_step():
    rng = np.random.RandomState(4)
    ints = rng.randint(-127, 128, size=(8, 96)).astype(np.int8)
    d = rng.uniform(1e-3, 1e-2, size=(8, 3)).astype(np.float32)
    values, scales = requantize_blocks(ints, d)
    w = (ints.reshape(8, 3, 32) * d[:, :, None]).reshape(8, 96)
    # half a step, plus float32 rounding of q * d / scale (a few ulps: 1e-5 relative)
    assert (np.abs(values * scales[:, None] - w) <= scales[:, None] / 2 * (1 + 1e-5)).all()


# ---- GGUF Q8_0 / Q4_0 straight to int8 ------------------------------------------------------

def _per_channel_weight(rng, rows, cols):
    """f32 [rows, cols] = int8 * a per-row f16 scale, every 32-block reaching |q| = 127:
    Q8_0 stores it exactly and per-channel int8 recovers the same integers and scales."""
    ints = rng.integers(-127, 128, size=(rows, cols)).astype(np.int8)
    ints[:, ::32] = 127
    scales = rng.uniform(1e-3, 1e-2, size=rows).astype(np.float16).astype(np.float32)
    return ints, scales, ints.astype(np.float32) * scales[:, None]


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    rng = np.random.default_rng(0)
    exact = {}
    for name, (rows, cols) in {"blk.0.ffn_gate.weight": (F, D), "blk.1.attn_q.weight": (H * HD, D),
                               "blk.2.attn_k.weight": (KV * HD, D), "token_embd.weight": (V, D)}.items():
        exact[name] = _per_channel_weight(rng, rows, cols)
    all_q8 = {f"blk.{i}.{k}.weight": Q.Q8_0 for i in range(L)
              for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    path = tmp_path_factory.mktemp("q8") / "tiny-q8.gguf"
    write_tiny_gguf(path, override_types=all_q8, values={k: v[2] for k, v in exact.items()})
    return path, exact


def test_q8_0_loads_straight_into_the_same_int8_values_and_scales(q8_gguf):
    path, exact = q8_gguf
    source = open_checkpoint(str(path))
    assert "layers.0.gate_proj" in source.int8_tensors, "Q8_0 tensors have an int8 producer"
    model = source.build(quantization="w8a8")
    for gguf_name, where in (("blk.0.ffn_gate.weight", model.layers[0].gate_proj),
                             ("token_embd.weight", model.embed)):
        ints, scales, _ = exact[gguf_name]
        qw = where.get_value()
        want = ints if gguf_name == "token_embd.weight" else ints.T  # projections are [in, out]
        np.testing.assert_array_equal(np.asarray(qw.values), want, err_msg=gguf_name)
        np.testing.assert_array_equal(np.asarray(qw.scales), scales, err_msg=gguf_name)


def test_q8_0_int8_rows_are_unpermuted_like_the_float_ones(q8_gguf):
    """q/k rows are stored in llama.cpp's interleaved order; the int8 path must undo it as
    the float path does (values and scales together)."""
    path, _ = q8_gguf
    source = open_checkpoint(str(path))
    quantized = source.build(quantization="int8")
    floats = source.build()
    for i, name in ((1, "q_proj"), (2, "k_proj")):
        qw = getattr(quantized.layers[i], name).get_value()
        ref = np.asarray(getattr(floats.layers[i], name).get_value())
        np.testing.assert_allclose(np.asarray(dequantize(qw)), ref, rtol=0, atol=1e-7, err_msg=name)


def test_q4_0_loads_straight_within_half_a_row_step(tmp_path):
    path = tmp_path / "tiny-q4.gguf"
    expected = write_tiny_gguf(path, override_types={"blk.0.ffn_up.weight": Q.Q4_0})
    source = open_checkpoint(str(path))
    assert "layers.0.up_proj" in source.int8_tensors
    qw = source.build(quantization="w8a8").layers[0].up_proj.get_value()
    ref = expected["blk.0.ffn_up.weight"].T  # the exact Q4_0 dequantization, [in, out]
    assert (np.abs(np.asarray(dequantize(qw)) - ref) <= np.asarray(qw.scales) / 2 * (1 + 1e-5)).all()


# ---- the model in each mode against float32 -----------------------------------------------

@pytest.fixture(scope="module")
def tiny_logits(tiny_llama):
    prompt = np.random.RandomState(5).randint(3, 300, 17).tolist()  # 17 = 2 blocks of 8 + 1
    blocks = tuple(shuffled_blocks(3, 48, seed=6))
    out = {"none": prompt_logits(load_checkpoint(str(tiny_llama)).model, prompt, blocks)}
    for mode in MODES:
        out[mode] = prompt_logits(load_checkpoint(str(tiny_llama), quantization=mode).model, prompt, blocks)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_tiny_model_logits_within_the_quantization_error_of_float32(tiny_logits, mode):
    ref, got = tiny_logits["none"], tiny_logits[mode]
    # Error budget. A weight's rounding error is uniform in +-step/2 with step = max|w|/127
    # of its channel; for N(0, s) weights over 64-128 inputs max|w| ~ 2.5-2.8 s, so the
    # error's std is 2.8 / (127 sqrt 12) ~ 0.65 % of s, and each product's relative error
    # is about the same. w8a8 adds the same again for the activations (x2 in variance).
    # The logits go through ~9 products in series (2 layers x 4 + the head); independent
    # errors add in quadrature: ~0.65 % x 3 ~ 2 % (weight-only) or ~2.8 % (w8a8) of the
    # logits' spread. The largest of 17 x 384 errors lies within ~4.5 standard deviations,
    # so bound max |Δ| by 4.5 x 2.8 % ~ 13 % of the reference's standard deviation.
    spread = ref.std()
    max_abs = np.abs(got - ref).max()
    assert max_abs < 0.13 * spread, f"{mode}: max |Δlogit| {max_abs:.3g} vs 13 % of {spread:.3g}"
    assert max_abs > 0, "the mode really quantized something"
    top1 = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert top1 >= 15 / 17, f"{mode}: top-1 agreement {top1:.2f} (ties within the error may flip one or two)"


@pytest.mark.slow
def test_default_model_modes_stay_within_their_error_budget():
    from models.reference import kl_divergence as _kl
    from models.reference import log_softmax

    source, prompt, blocks, ref = default_model_case()
    # Error budget. A per-channel int8 weight errs by step/sqrt(12) rms, step = max|w|/127:
    # relative to the channel's rms that is (max/rms) / (127 sqrt 12) = 3.4 / 440 = 0.77 %
    # (SmolLM2's projections: max/rms per output channel has median 3.4). Through ~121
    # products in series (30 layers x 4 + the head) independent errors add in quadrature,
    # x11; on logits spread ~3 that is a perturbation delta of std ~0.25, and for a small
    # perturbation KL(p||q) ~ Var_p(delta) / 2 ~ 0.03. w8a8 adds per-row activations, whose
    # step is set by the row's largest |x|: max/rms has median 11.9 in SmolLM2's hidden
    # states (outlier channels), so they err by 11.9 / 440 = 2.7 %, and the product by
    # sqrt(0.77^2 + 2.7^2) = 2.8 %: 3.6x the weight-only error, 13x its KL -> 0.4.
    budget = {"int8": 0.03, "w8a8": 0.03 * (2.8 / 0.77) ** 2}
    for mode in budget:  # w8a8-block32 on the default model: docs/benchmarks.md (compare_logits)
        got = prompt_logits(source.build(quantization=mode), prompt, blocks).astype(np.float64)
        kl = _kl(log_softmax(ref), log_softmax(got)).mean()
        assert kl < budget[mode], f"{mode}: mean KL {kl:.3g} over the budget {budget[mode]:.3g}"
        top1 = (got.argmax(-1) == ref.argmax(-1)).mean()
        # a flip needs the top two logits closer than the perturbation: rare for int8
        assert top1 >= {"int8": 0.9, "w8a8": 0.8}[mode], f"{mode}: top-1 agreement {top1:.2f}"


# ---- KV cache dtype -------------------------------------------------------------------------

def test_bfloat16_kv_cache_holds_twice_the_blocks_in_the_same_budget(tiny_llama):
    cfg = open_checkpoint(str(tiny_llama)).config
    config = EngineConfig(model=str(tiny_llama), kv_memory_gib=0.01, block_size=8)
    f32 = size_kv(config, cfg, jnp.float32)
    bf16 = size_kv(config, cfg, jnp.bfloat16)
    # K+V x 2 layers x 2 kv heads x 8 positions x 16 head_dim x 4 bytes = 4096 B per block.
    assert f32.bytes_per_block == 2 * cfg.num_layers * cfg.num_kv_heads * 8 * cfg.head_dim * 4 == 4096
    assert bf16.bytes_per_block == f32.bytes_per_block // 2
    assert f32.num_blocks == int(0.01 * 2**30 // 4096) == 2621
    assert bf16.num_blocks == int(0.01 * 2**30 // 2048) == 5242


def test_bfloat16_kv_cache_logits_stay_close_to_float32(tiny_llama):
    model = load_checkpoint(str(tiny_llama)).model
    prompt = np.random.RandomState(7).randint(3, 300, 17).tolist()
    blocks = tuple(shuffled_blocks(3, 48, seed=8))
    ref = prompt_logits(model, prompt, blocks)
    runner = ModelRunner(model, num_blocks=48, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=128,
                         kv_dtype=jnp.bfloat16)
    # On CPU the bfloat16 words are held as uint16 (ferrox_jax/kv_cache.py: storage_dtype).
    assert runner.kv_cache.k[0].dtype == (jnp.uint16 if jax.default_backend() == "cpu" else jnp.bfloat16)
    got = runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks,
                                     sample=False)])[0]
    # bf16 keeps 8 mantissa bits: each K and V element moves by <= 2^-9 ~ 0.2 % relative,
    # and so, about, do the scores and the attention output. Two layers and the head carry
    # it to the logits, amplified ~3x by the residual stream's growth; the largest of
    # 17 x 384 errors lies within ~4.5 standard deviations: 0.2 % x 3 x 4.5 ~ 3 % of the
    # logits' spread (measured: 1.4 %).
    assert np.abs(got - ref).max() < 0.03 * ref.std()


def test_float16_kv_cache_logits_stay_closer_to_float32_than_bfloat16(tiny_llama):
    model = load_checkpoint(str(tiny_llama)).model
    prompt = np.random.RandomState(7).randint(3, 300, 17).tolist()
    blocks = tuple(shuffled_blocks(3, 48, seed=8))
    ref = prompt_logits(model, prompt, blocks)
    errors = {}
    for dtype, storage in ((jnp.bfloat16, jnp.uint16), (jnp.float16, jnp.int16)):
        runner = ModelRunner(model, num_blocks=48, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=128,
                             kv_dtype=dtype)
        # On CPU the 16-bit words are held as integers, the type naming the float (kv_cache.py)
        assert runner.kv_cache.k[0].dtype == (storage if jax.default_backend() == "cpu" else dtype)
        got = runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks,
                                         sample=False)])[0]
        errors[dtype] = np.abs(got - ref).max()
    # float16 keeps 11 significant bits to bfloat16's 8: each K/V element moves by <= 2^-12
    # relative instead of 2^-9, so the logits' error shrinks about 8x (the values here are
    # far inside float16's range). Read as bfloat16 words, the same bits would be garbage.
    assert errors[jnp.float16] < 0.004 * ref.std()
    assert errors[jnp.float16] < errors[jnp.bfloat16] / 3


# ---- compilation ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,kv_dtype", [("int8", jnp.float32), ("w8a8", jnp.bfloat16)])
def test_mixed_workload_after_warmup_causes_zero_recompiles(tiny_llama, mode, kv_dtype):
    model = load_checkpoint(str(tiny_llama), quantization=mode).model
    runner = ModelRunner(model, num_blocks=64, block_size=8, max_rows=4, max_chunk_tokens=32, max_context=128,
                         kv_dtype=kv_dtype)
    runner.warmup()
    mixed_workload(runner)
    assert runner.recompiles_after_warmup == 0


# ---- what the facade reports ----------------------------------------------------------------

def test_engine_reports_quantization_and_bytes(tiny_llama):
    from ferrox_jax.engine import Engine

    engines = {mode: Engine.load(EngineConfig(model=str(tiny_llama), dtype="float32", quantization=mode,
                                              kv_cache_dtype="bfloat16", kv_blocks=32, max_context=128,
                                              max_seqs=2, prefill_chunk=16))
               for mode in ("none", "w8a8")}
    card = engines["w8a8"].model_card
    assert (card.quantization, card.kv_cache_dtype, card.dtype) == ("w8a8", "bfloat16", "float32")
    cfg = engines["none"].model_config
    # Every matrix: f32 4 B per weight -> int8 1 B plus 4 B per output channel.
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    matrices = layer * cfg.num_layers + [(v, d), (d, v)]  # embed [V, D] and lm_head [D, V]
    vectors = (2 * cfg.num_layers + 1) * d  # norms stay f32
    f32_bytes = 4 * sum(a * b for a, b in matrices) + 4 * vectors
    embed_scales = v  # the embedding's scales are per row
    int8_bytes = (sum(a * b for a, b in matrices) + 4 * sum(b for _, b in matrices[:-2]) + 4 * embed_scales
                  + 4 * v + 4 * vectors)
    assert engines["none"].model_card.weights_bytes == f32_bytes
    assert engines["w8a8"].model_card.weights_bytes == int8_bytes
    # KV: 32 usable blocks + the null block x 2 (K, V) x layers x kv heads x block 16 x head_dim x 2 bytes.
    assert engines["w8a8"].model_card.kv_bytes == 33 * 2 * cfg.num_layers * cfg.num_kv_heads * 16 * cfg.head_dim * 2
    plan = plan_memory(EngineConfig(model=str(tiny_llama), dtype="float32", quantization="w8a8",
                                    kv_cache_dtype="bfloat16", kv_blocks=32, max_context=128))
    assert (plan.weights_bytes, plan.kv_bytes) == (int8_bytes, engines["w8a8"].model_card.kv_bytes)
    info = engines["w8a8"].describe()
    assert (info["quantization"], info["kv_cache_dtype"]) == ("w8a8", "bfloat16")
    assert info["weights_bytes"] == int8_bytes
    for engine in engines.values():
        engine.shutdown()


def test_api_reports_quantization_and_bytes():
    import httpx

    from api.app import create_app
    from api.config import ServerConfig
    from tests.support.server_harness import ServerThread, tiny_engine

    # One row, 16-token chunks: 6 executables to warm up (decode, chunk, mixed, 2 samplers, the
    # copy) where the harness's 32 rows and 64-token chunks make 32; the reports and
    # the 4-token completion below need no more.
    engine = tiny_engine(quantization="w8a8", kv_cache_dtype="bfloat16", max_seqs=1, prefill_chunk=16, kv_blocks=64)
    with ServerThread(create_app(engine, ServerConfig())) as url, httpx.Client(base_url=url, timeout=60) as http:
        info = http.get("/health").json()["model_info"]
        assert (info["quantization"], info["kv_cache_dtype"]) == ("w8a8", "bfloat16")
        card = http.get("/v1/models").json()["data"][0]
        assert (card["quantization"], card["kv_cache_dtype"]) == ("w8a8", "bfloat16")
        info = http.get("/admin/stats").json()["model_info"]
        assert info["weights_bytes"] == engine.model_card.weights_bytes > 0
        assert info["kv_bytes"] == engine.model_card.kv_bytes > 0
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# ---- every family -----------------------------------------------------------------------------

def _family_configs():
    import transformers

    return {
        "gemma2": transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            max_position_embeddings=512, sliding_window=12,
                                            attn_logit_softcapping=30.0, final_logit_softcapping=30.0),
        "phi3": transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        tie_word_embeddings=False),
        "qwen3_moe": transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=16, max_position_embeddings=512, num_experts=8,
                                                 num_experts_per_tok=2, mlp_only_layers=[1],
                                                 tie_word_embeddings=False),
    }


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe"])
def test_every_family_quantizes_its_projections_within_the_error_budget(tmp_path, family):
    """The families compose shared layers, so quantization reaches each through `project`:
    every projection, the MoE expert stacks, the embedding and the LM head become int8 (a
    MoE's router stays float), and the logits stay within the tiny model's budget derived above."""
    from tests.support import family_checks as fc

    path = fc.make_checkpoint(tmp_path / family, _family_configs()[family])
    prompt = np.random.RandomState(7).randint(3, 200, 17).tolist()
    blocks = tuple(shuffled_blocks(3, 48, seed=8))
    ref = prompt_logits(load_checkpoint(str(path)).model, prompt, blocks)
    model = load_checkpoint(str(path), quantization="w8a8").model
    layer = model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer, name).get_value(), QuantizedWeight), name
    assert isinstance(model.embed.get_value(), QuantizedWeight)
    if family == "qwen3_moe":
        stack = layer.experts_up.get_value()
        assert isinstance(stack, QuantizedWeight) and stack.scales.shape == (8, 32)  # [E, out]
        assert not isinstance(layer.router.get_value(), QuantizedWeight)
        assert isinstance(model.layers[1].gate_proj.get_value(), QuantizedWeight)  # the dense layer
    else:
        assert isinstance(layer.down_proj.get_value(), QuantizedWeight)
    got = prompt_logits(model, prompt, blocks)
    max_abs = np.abs(got - ref).max()
    assert 0 < max_abs < 0.13 * ref.std(), f"{family}: max |Δlogit| {max_abs:.3g} vs 13 % of {ref.std():.3g}"
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 15 / 17


def test_expert_stacks_quantize_per_expert_and_output_column():
    """[E, in, out]: each expert's columns get their own scale (over its inputs), a slice of
    the stack is that expert's 2-D weight, and the bytes count E x out scales."""
    from models.quant import quantized_channel_axis, quantized_nbytes, select_expert

    w = np.random.RandomState(3).randn(4, 24, 10).astype(np.float32)
    w[2] *= 50  # one expert much larger: shared scales would crush the others
    assert quantized_channel_axis("layers.0.experts_down", w.shape) == 2
    values, scales = quantize_host(w, channel_axis=2)
    assert scales.shape == (4, 10)
    np.testing.assert_allclose(scales, np.abs(w).max(axis=1) / INT8_MAX, rtol=1e-6)
    stack = quantize(jnp.asarray(w), "w8a8", channel_axis=2)
    np.testing.assert_array_equal(np.asarray(stack.values), values)
    one = select_expert(stack, jnp.int32(1))
    assert one.shape == (24, 10) and one.channel_axis == 1
    np.testing.assert_allclose(np.asarray(dequantize(one)), w[1], atol=float(scales[1].max()) / 2 * (1 + 1e-5))
    assert quantized_nbytes(w.shape, 2) == w.size + 4 * 4 * 10
