"""A tiny DeepSeek-V3 checkpoint written as llama.cpp's `deepseek2` GGUF
(tests/support/gguf_from_hf.py: MLA as MQA with the real widths in the `*_mla` keys, the
routing keys, YaRN's log multiplier, experts stacked, kv_b_proj split into attn_k_b /
attn_v_b as newer converters write it, or whole as older ones did) loads equal to the
safetensors form: the same config, kv_b_proj bit for bit, prompt logits within 1e-4 and
the same greedy tokens. Negative control: kv_b_proj joined with its heads in the wrong
order (what a mistaken reshape of the split tensors gives) moves the logits far past that."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers

from tests.support import family_checks as fc

# mscale == mscale_all_dim, as in every released config: a GGUF carries only mscale_all_dim
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
             n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             max_position_embeddings=256, tie_word_embeddings=False, rope_parameters=YARN)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    path = fc.make_checkpoint(tmp_path_factory.mktemp("ds2") / "tiny-deepseek-v3",
                              transformers.DeepseekV3Config(**SHAPE))
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.RandomState(5)  # a routing bias the random init leaves at zero: make it matter
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = (0.3 * rng.randn(*tensors[name].shape)).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _runner(path):
    from tests.support.engine_helpers import make_runner

    return make_runner(path, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_context=fc.MAX_CONTEXT)


def _logits(runner, prompt):
    from tests.support.engine_helpers import shuffled_blocks

    return runner.run_logits([fc._row(prompt, 0, shuffled_blocks(20, fc.NUM_BLOCKS, seed=2))])[0]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return _runner(checkpoint)


def test_older_whole_kv_b_loads_the_same_weights(checkpoint, tmp_path, reference):
    """Older converters wrote kv_b_proj whole (`attn_kv_b`): the same placed weights."""
    from models.loader import load_checkpoint
    from tests.support.gguf_from_hf import write_deepseek2_gguf

    whole = load_checkpoint(str(write_deepseek2_gguf(checkpoint, tmp_path / "whole.gguf", split_kv_b=False)))
    split = load_checkpoint(str(write_deepseek2_gguf(checkpoint, tmp_path / "split.gguf")))
    for i in range(SHAPE["num_hidden_layers"]):
        want = np.asarray(reference[1].model.layers[i].kv_b_proj[...])
        np.testing.assert_array_equal(np.asarray(whole.model.layers[i].kv_b_proj[...]), want)
        np.testing.assert_array_equal(np.asarray(split.model.layers[i].kv_b_proj[...]), want)
    assert whole.config == split.config


def test_deepseek2_gguf_equals_safetensors(checkpoint, tmp_path, reference):
    from models.loaders.common import build_model
    from models.loaders.gguf import gguf_tensors, open_gguf
    from ferrox_jax.runner import ModelRunner
    from tests.support.engine_helpers import generate_alone, shuffled_blocks
    from tests.support.gguf_from_hf import write_deepseek2_gguf

    gguf_path = write_deepseek2_gguf(checkpoint, tmp_path / "tiny.gguf")
    (ours, ckpt), (ref, ref_ckpt) = _runner(gguf_path), reference
    cfg, want = ckpt.config, ref_ckpt.config  # GGUF floats are float32: eps and mscale round
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    assert cfg.yarn.mscale_all_dim == pytest.approx(want.yarn.mscale_all_dim, rel=1e-6)
    assert dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps, yarn=want.yarn) == want
    prompt = np.random.RandomState(0).randint(0, SHAPE["vocab_size"], fc.PROMPT_TOKENS).tolist()
    err = float(np.abs(_logits(ours, prompt) - _logits(ref, prompt)).max())
    print(f"deepseek2 GGUF: max |Δlogit| vs safetensors {err:.2e}")
    assert err < 1e-4
    blocks = shuffled_blocks(20, fc.NUM_BLOCKS, seed=4)
    assert generate_alone(ours, prompt, 12, blocks) == generate_alone(ref, prompt, 12, blocks)

    # Negative control: the heads of the split k_b / v_b joined in the wrong order.
    tensors = gguf_tensors(open_gguf(gguf_path), cfg)
    good, h = tensors["layers.1.kv_b_proj"], SHAPE["num_attention_heads"]
    tensors["layers.1.kv_b_proj"] = lambda: np.ascontiguousarray(
        good().reshape(SHAPE["kv_lora_rank"], h, -1)[:, ::-1].reshape(SHAPE["kv_lora_rank"], -1))
    bad = ModelRunner(build_model(cfg, tensors, ref_ckpt.model.dtype), num_blocks=fc.NUM_BLOCKS,
                      block_size=fc.BLOCK_SIZE, max_rows=8, max_chunk_tokens=64, max_context=fc.MAX_CONTEXT)
    control = float(np.abs(_logits(bad, prompt) - _logits(ref, prompt)).max())
    print(f"  control (kv_b heads reversed in layer 1): {control:.2e}")
    assert control > 1e-2, control


def test_softmax_routed_deepseek2_is_refused(checkpoint, tmp_path):
    """DeepSeek-V2's softmax routing is not this family's: the load names what is refused."""
    import gguf

    from models.config import UnsupportedModelError
    from models.loaders.gguf import config_from_gguf
    from tests.support.gguf_from_hf import write_deepseek2_gguf

    path = write_deepseek2_gguf(checkpoint, tmp_path / "tiny.gguf", gating_func=1)
    with pytest.raises(UnsupportedModelError, match="softmax routing"):
        config_from_gguf(gguf.GGUFReader(str(path)))
