"""A tiny GLM-4.5 checkpoint written as llama.cpp's `glm4moe` GGUF (tests/support/gguf_from_hf.py:
the multi-token-prediction layer counted in block_count and its `nextn.*` tensors written, partial
RoPE as `rope.dimension_count`, the routing as `expert_*` keys, no keys for the q/k/v biases or the
q/k norms, `post_attention_norm`, `exp_probs_b.bias`, the experts stacked) loads equal to the
safetensors form: the same config field for field, prompt and decode logits within 1e-4 and the
same greedy tokens. Negative controls: q/k rows left in llama.cpp's interleaved order (what reading
the file as a permuted `llama` would give) move the logits far past that; a file that does not say
its last block is a prediction layer fails to load. Softmax routing and M-RoPE sections are refused
by key; a Q8_0 file on the block kernel equals the same file dequantized."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import transformers

from tests.support import family_checks as fc

ATOL = 1e-4
NUM_EXPERTS = 8
PROMPT_TOKENS = 12
DECODE_STEPS = 4


def _checkpoint(folder: Path) -> Path:
    """The family test's tiny GLM-4.5 (biases, q/k norms, 4 groups, a shared expert, layer 0
    dense) with a non-zero routing bias and, as the Hub's checkpoints have, one
    multi-token-prediction layer after the main ones (the safetensors loader skips it)."""
    from safetensors.numpy import load_file, save_file

    config = transformers.Glm4MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=512, n_routed_experts=NUM_EXPERTS,
                                        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                        first_k_dense_replace=1, routed_scaling_factor=1.8, norm_topk_prob=True,
                                        attention_bias=True, use_qk_norm=True, tie_word_embeddings=False,
                                        num_nextn_predict_layers=1)
    path = fc.make_checkpoint(folder, config)
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.RandomState(4)
    for name in list(tensors):
        if name.endswith("e_score_correction_bias"):
            tensors[name] = (0.05 * rng.randn(*tensors[name].shape)).astype(np.float32)
        elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            tensors[name] = (0.1 * rng.randn(*tensors[name].shape)).astype(np.float32)
    d = config.hidden_size
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:  # the MTP layer: an expert layer...
        tensors[name.replace("model.layers.1.", "model.layers.2.")] = tensors[name].copy()
    tensors.update({  # ...plus its own projection, norms and head
        "model.layers.2.eh_proj.weight": (0.02 * rng.randn(d, 2 * d)).astype(np.float32),
        "model.layers.2.enorm.weight": np.ones(d, np.float32), "model.layers.2.hnorm.weight": np.ones(d, np.float32),
        "model.layers.2.shared_head.norm.weight": np.ones(d, np.float32),
    })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.support.gguf_from_hf import write_glm4moe_gguf

    root = tmp_path_factory.mktemp("glm4moe-gguf")
    path = _checkpoint(root / "tiny-glm4-moe")
    return path, write_glm4moe_gguf(path, root / "tiny-glm4-moe.gguf"), root


def _runner(model):
    from ferrox_jax.runner import ModelRunner

    return ModelRunner(model, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_rows=8,
                       max_chunk_tokens=64, max_context=fc.MAX_CONTEXT, max_chunks=1)


def _run(runner, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """Prefill then greedy decode; (logits [prompt + steps, V], greedy tokens)."""
    from tests.support.engine_helpers import shuffled_blocks

    blocks = shuffled_blocks(12, fc.NUM_BLOCKS, seed=3)
    logits = [runner.run_logits([fc._row(prompt, 0, blocks)])[0]]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.run_logits([fc._row(tokens[-1:], len(tokens) - 1, blocks)])[0])
    return np.concatenate(logits), tokens[len(prompt):]


def _load(path: Path, quantization: str = "none"):
    from models.loader import load_checkpoint

    return load_checkpoint(str(path), quantization=quantization)


@pytest.fixture(scope="module")
def reference(files):
    ckpt = _load(files[0])
    prompt = np.random.RandomState(0).randint(0, ckpt.config.vocab_size, PROMPT_TOKENS).tolist()
    return prompt, ckpt, _run(_runner(ckpt.model), prompt, DECODE_STEPS)


def test_config_is_the_safetensors_config(files, reference):
    from models.loaders.gguf import config_from_gguf, open_gguf

    ours, want = config_from_gguf(open_gguf(files[1])), reference[1].config
    # GGUF floats are float32: eps and the scaling factor round
    assert ours.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    assert ours.routed_scaling_factor == pytest.approx(want.routed_scaling_factor, rel=1e-6)
    assert dataclasses.replace(ours, rms_norm_eps=want.rms_norm_eps,
                               routed_scaling_factor=want.routed_scaling_factor) == want
    assert (ours.num_layers, ours.rotary_dim, ours.attention_bias, ours.qk_norm, ours.n_group,
            ours.dense_layers) == (2, 8, True, True, 4, (0,))


def test_logits_and_greedy_match_the_safetensors_form(files, reference):
    from models.loaders.common import build_model
    from models.loaders.gguf import gguf_tensors, open_gguf, unpermute_rope_rows

    prompt, ref, (want, want_tokens) = reference
    ckpt = _load(files[1])
    got, tokens = _run(_runner(ckpt.model), prompt, DECODE_STEPS)
    err = float(np.abs(got - want).max())
    print(f"glm4moe GGUF vs safetensors: max |Δlogit| {err:.2e} over {len(prompt)} + {DECODE_STEPS} positions")
    assert err < ATOL, f"GGUF logits differ from the safetensors form by {err:.3g}"
    assert tokens == want_tokens, "greedy tokens differ from the safetensors form"

    # Negative control: the file read as a permuted `llama` one (q/k rows "un"-permuted).
    cfg = ckpt.config
    tensors = gguf_tensors(open_gguf(files[1]), cfg)
    for i in range(cfg.num_layers):
        for name, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            good = tensors[f"layers.{i}.{name}"]
            tensors[f"layers.{i}.{name}"] = lambda good=good, heads=heads: np.ascontiguousarray(
                unpermute_rope_rows(good().T, heads).T)
    bad, _ = _run(_runner(build_model(cfg, tensors, ref.model.dtype)), prompt, 0)
    control = float(np.abs(bad - want[:len(prompt)]).max())
    print(f"  control (q/k rows read as llama's interleaved order): {control:.2e}")
    assert control > 1e-2, control


def test_the_prediction_layer_is_what_nextn_predict_layers_names(files, tmp_path):
    """The file has blk.2 (the MTP layer); a file whose `nextn_predict_layers` does not count it
    would make it a third main layer: refused, naming the key."""
    import gguf

    from models.config import UnsupportedModelError
    from tests.support.gguf_from_hf import write_glm4moe_gguf

    reader = gguf.GGUFReader(str(files[1]))
    assert any(t.name == "blk.2.nextn.eh_proj.weight" for t in reader.tensors)
    path = write_glm4moe_gguf(files[0], tmp_path / "no-nextn.gguf",
                              tweak=lambda w: w.add_uint32("glm4moe.nextn_predict_layers", 0))
    with pytest.raises(UnsupportedModelError, match="block 2 is a multi-token-prediction layer.*nextn_predict_layers"):
        _load(path)


@pytest.mark.parametrize("key,value,match", [("glm4moe.expert_gating_func", 1, "expert_gating_func"),
                                             ("glm4moe.rope.dimension_sections", [4, 4, 0, 0], "dimension_sections")])
def test_what_the_family_does_not_run_is_refused_by_key(files, tmp_path, key, value, match):
    import gguf

    from models.config import UnsupportedModelError
    from models.loaders.gguf import config_from_gguf
    from tests.support.gguf_from_hf import write_glm4moe_gguf

    def tweak(w):
        w.add_uint32(key, value) if isinstance(value, int) else w.add_array(key, value)

    path = write_glm4moe_gguf(files[0], tmp_path / "refused.gguf", tweak=tweak)
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_gguf(gguf.GGUFReader(str(path)))


def test_a_q8_0_file_on_the_block_kernel_is_the_file_dequantized(files):
    """Q8_0 projections and expert stacks (what a quantized Hub file holds), served as their blocks
    (`--quantization gguf`) and dequantized to f32: the same weights, so within 1e-4 and the same
    greedy tokens."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from tests.support.gguf_from_hf import write_glm4moe_gguf

    path, _, root = files
    q8 = GGMLQuantizationType.Q8_0
    quantized = write_glm4moe_gguf(path, root / "tiny-glm4-moe-q8_0.gguf", quant=lambda name, arr: (
        (quantize(arr, q8), q8) if arr.shape[-1] % 32 == 0 and name != "token_embd.weight" else None))
    prompt = np.random.RandomState(4).randint(0, 384, PROMPT_TOKENS).tolist()
    dequantized, want_tokens = _run(_runner(_load(quantized).model), prompt, 2)
    blocks, tokens = _run(_runner(_load(quantized, "gguf").model), prompt, 2)
    err = float(np.abs(blocks - dequantized).max())
    print(f"glm4moe Q8_0 GGUF, block kernel vs dequantized: max |Δlogit| {err:.2e}")
    assert err < ATOL, f"the Q8_0 blocks differ from the same file dequantized by {err:.3g}"
    assert tokens == want_tokens
