"""Qwen3-MoE against HF transformers: Qwen3's q/k norms, top-2 of 8 experts with the top-k
weights NOT renormalised (norm_topk_prob false), and layer 1 kept dense by
mlp_only_layers. 80 tokens route 160 pairs: every expert of the MoE layer gets traffic."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from tests.support import family_checks as fc

NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=512, num_experts=NUM_EXPERTS,
                                         num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                                         rope_theta=1e6, tie_word_embeddings=False)
    path = fc.make_checkpoint(tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3-moe", config)
    hf = fc.hf_model(path)
    return path, hf, fc.check_family(path, hf)


def test_every_expert_gets_traffic(qwen3_moe):
    _, hf, report = qwen3_moe
    assert fc.experts_routed(hf, report.tokens) == [set(range(NUM_EXPERTS))]


def test_config_reads_experts_and_the_dense_layer(qwen3_moe):
    cfg = qwen3_moe[2].config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (NUM_EXPERTS, 2, 32)
    assert not cfg.norm_topk_prob and cfg.dense_layers == (1,) and cfg.intermediate_size == 96


def test_matches_transformers(qwen3_moe):
    fc.assert_report(qwen3_moe[2], "qwen3_moe")


def test_served_end_to_end(qwen3_moe):
    path, hf, _ = qwen3_moe
    fc.assert_served(fc.serve(path), hf, "Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def qwen3_moe_gguf_ready(tmp_path_factory):
    """llama.cpp's qwen3moe graph always renormalises the top-k weights (the file does not
    record norm_topk_prob), so its GGUF form equals a checkpoint that does (as the released
    Qwen3-MoE models): this one, with layer 1 dense as above."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=512, num_experts=NUM_EXPERTS,
                                         num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                         rope_theta=1e6, tie_word_embeddings=False)
    return fc.make_checkpoint(tmp_path_factory.mktemp("qwen3moe-gguf") / "tiny-qwen3-moe", config)


def test_gguf_loads_the_same_model(qwen3_moe_gguf_ready, tmp_path):
    path = qwen3_moe_gguf_ready
    hf = fc.hf_model(path)
    prompt = np.random.RandomState(0).randint(0, hf.config.vocab_size, fc.PROMPT_TOKENS).tolist()
    got = fc.check_gguf(path, tmp_path / "tiny-qwen3-moe.gguf", "qwen3moe", hf, prompt)
    assert got["err"] < fc.ATOL, f"qwen3moe GGUF prompt logits differ from HF by {got['err']:.3g}"
    cfg, ref = got["config"], got["reference_config"]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (NUM_EXPERTS, 2, 32)
    assert cfg.dense_layers == ref.dense_layers == (1,) and cfg.norm_topk_prob and cfg.intermediate_size == 96
    assert got["same_tokens"]


def test_q8_0_expert_stacks_load_as_their_blocks(qwen3_moe_gguf_ready, tmp_path):
    """Expert stacks written Q8_0 (every other tensor float): the loaded stacks are the
    blocks' values exactly (dequantized at load: the block kernels multiply 2-D weights),
    and the logits are HF's for the checkpoint with its experts put through the same
    Q8_0 round trip (the control: against the unquantized checkpoint they miss)."""
    import shutil

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    from models.loader import load_checkpoint
    from tests.support.gguf_from_hf import write_gguf

    path = qwen3_moe_gguf_ready
    q8 = GGMLQuantizationType.Q8_0

    def roundtrip(arr):
        return dequantize(quantize(arr, q8), q8).reshape(arr.shape)

    ref_dir = tmp_path / "q8-reference"
    shutil.copytree(path, ref_dir)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: roundtrip(v) if ".experts." in k else v for k, v in tensors.items()},
              str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    gguf_path = write_gguf(path, tmp_path / "q8.gguf", "qwen3moe",
                           quant=lambda name, arr: (quantize(arr, q8), q8) if "_exps" in name else None)
    model = load_checkpoint(str(gguf_path)).model
    want = np.stack([roundtrip(tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]).T
                     for e in range(NUM_EXPERTS)])
    np.testing.assert_array_equal(np.asarray(model.layers[0].experts_gate[...]), want)

    from tests.support.engine_helpers import make_runner, shuffled_blocks

    runner, _ = make_runner(gguf_path, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_context=fc.MAX_CONTEXT)
    prompt = np.random.RandomState(0).randint(0, model.cfg.vocab_size, fc.PROMPT_TOKENS).tolist()
    ours = runner.run_logits([fc._row(prompt, 0, shuffled_blocks(20, fc.NUM_BLOCKS, seed=2))])[0]
    err = float(np.abs(ours - fc.hf_logits(fc.hf_model(ref_dir), prompt)).max())
    control = float(np.abs(ours - fc.hf_logits(fc.hf_model(path), prompt)).max())
    print(f"qwen3moe Q8_0 experts GGUF: max |Δlogit| vs HF (same Q8_0 experts) {err:.2e}; vs float {control:.2e}")
    assert err < fc.ATOL and control > 10 * fc.ATOL, (err, control)
