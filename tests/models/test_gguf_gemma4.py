"""Gemma 4 from a GGUF file as llama.cpp's converter writes it (`gemma4`;
tests/support/gguf_from_hf.py:write_gemma4_gguf), against the same checkpoint read from its
safetensors (which tests/models/test_family_gemma4.py checks against HF transformers).

The checkpoint is test_family_gemma4's: five layers covering every layer kind (sliding and full,
keys serving as values on the full layers, two shared-KV layers with double-wide MLPs, per-layer
inputs, the MoE block, partial "proportional" RoPE on the full layers, soft-capped logits) and
random per-layer scalars, so every key and tensor the GGUF carries moves the logits.

- the config read from the GGUF keys is the safetensors config, field for field;
- prefill and greedy decode logits within 1e-4 of the safetensors form, greedy tokens identical
  (both are f32; only the f32 rounding of rms_norm_eps in the file differs);
- negative controls: the same file with every RoPE frequency turning (rope_freqs all ones) or
  without its soft-capping key misses by far more than the tolerance;
- what the converter cannot carry, or a file it would not write, is refused at load by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.config import UnsupportedModelError  # noqa: E402
from tests.support import family_checks as fc  # noqa: E402
from tests.support.gguf_from_hf import write_gemma4_gguf  # noqa: E402

ATOL = 1e-4  # f32 both ways, the same math: only summation order and the eps rounding differ
WRONG = 20 * ATOL  # a negative control must miss by at least this
PROMPT_TOKENS = 24  # past the window of 12: the sliding layers' masks matter
DECODE_STEPS = 8


def _checkpoint(folder: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    from tests.models.test_family_gemma4 import gemma4_config

    path = fc.make_checkpoint(folder, gemma4_config())
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(1)
    for name in tensors:  # layer_scalar is ones in a fresh checkpoint: make reading it matter
        if name.endswith("layer_scalar"):
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(tensors[name].shape)).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-gguf")
    path = _checkpoint(root / "tiny-gemma4")
    return path, write_gemma4_gguf(path, root / "tiny-gemma4.gguf"), root


def _run(path: Path, prompt: list[int], steps: int, quantization: str = "none"
         ) -> tuple[np.ndarray, list[int], object]:
    """Prefill then greedy decode; (logits [prompt + steps, V], greedy tokens, config)."""
    from ferrox_jax.runner import ModelRunner
    from models.loader import load_checkpoint
    from tests.support.engine_helpers import shuffled_blocks

    ckpt = load_checkpoint(str(path), quantization=quantization)
    runner = ModelRunner(ckpt.model, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_rows=8,
                         max_chunk_tokens=64, max_context=fc.MAX_CONTEXT, max_chunks=1)
    blocks = shuffled_blocks(12, fc.NUM_BLOCKS, seed=3)
    logits = [runner.run_logits([fc._row(prompt, 0, blocks)])[0]]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.run_logits([fc._row(tokens[-1:], len(tokens) - 1, blocks)])[0])
    return np.concatenate(logits), tokens[len(prompt):], ckpt.config


@pytest.fixture(scope="module")
def reference(files):
    path, _, _ = files
    prompt = np.random.RandomState(0).randint(0, 384, PROMPT_TOKENS).tolist()
    return prompt, _run(path, prompt, DECODE_STEPS)


def test_config_is_the_safetensors_config(files, reference):
    _, gguf_path, _ = files
    from models.loaders.gguf import config_from_gguf, open_gguf

    ours = config_from_gguf(open_gguf(gguf_path))
    want = reference[1][2]
    assert ours.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored as f32
    assert dataclasses.replace(ours, rms_norm_eps=want.rms_norm_eps) == want
    assert (ours.num_kv_shared_layers, ours.ple_dim, ours.rope_global_partial, ours.k_eq_v, ours.num_experts,
            ours.double_wide_mlp, ours.final_logit_softcap) == (2, 8, 0.25, True, 4, True, 30.0)


def test_logits_and_greedy_match_the_safetensors_form(files, reference):
    _, gguf_path, _ = files
    prompt, (want, want_tokens, _) = reference
    got, tokens, _ = _run(gguf_path, prompt, DECODE_STEPS)
    err = float(np.abs(got - want).max())
    print(f"gemma4 GGUF vs safetensors: max |Δlogit| {err:.2e} over {len(prompt)} + {DECODE_STEPS} positions")
    assert err < ATOL, f"GGUF logits differ from the safetensors form by {err:.3g}"
    assert tokens == want_tokens, "greedy tokens differ from the safetensors form"


def test_a_q8_0_file_on_the_block_kernel_is_the_file_dequantized(files):
    """Q8_0 projections (what a quantized Hub file holds), served as their blocks (`--quantization
    gguf`, the CPU default for a GGUF) and dequantized to f32: the same weights, so within 1e-4 and
    the same greedy tokens (measured 7.3e-6: only the kernel's summation order differs)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    path, _, root = files
    q8 = GGMLQuantizationType.Q8_0
    quantized = write_gemma4_gguf(path, root / "tiny-gemma4-q8_0.gguf", quant=lambda name, arr: (
        (quantize(arr, q8), q8) if arr.ndim == 2 and arr.shape[-1] % 32 == 0 and "per_layer_token" not in name
        else None))
    prompt = np.random.RandomState(4).randint(0, 384, PROMPT_TOKENS).tolist()
    dequantized, want_tokens, _ = _run(quantized, prompt, 2)
    blocks, tokens, _ = _run(quantized, prompt, 2, quantization="gguf")
    err = float(np.abs(blocks - dequantized).max())
    print(f"gemma4 Q8_0 GGUF, block kernel vs dequantized: max |Δlogit| {err:.2e}")
    assert err < ATOL, f"the Q8_0 blocks differ from the same file dequantized by {err:.3g}"
    assert tokens == want_tokens


def test_the_tokenizer_is_rebuilt(files):
    from models.loaders.gguf import open_gguf_checkpoint
    from models.tokenizer import Tokenizer

    path, gguf_path, _ = files
    text = "Hello world! The quick brown fox."
    assert open_gguf_checkpoint(gguf_path)[2].encode(text) == Tokenizer.from_hf_dir(path).encode(text)


def _drop(key: str):
    def tweak(writer):
        del writer.kv_data[0][key]
    return tweak


@pytest.mark.parametrize("what, kwargs", [
    ("every RoPE frequency turning", {"rope_freqs": np.ones(16, np.float32)}),
    ("no soft-capping key", {"tweak": _drop("gemma4.final_logit_softcapping")}),
])
def test_negative_controls_miss_by_far(files, reference, what, kwargs):
    path, _, root = files
    prompt, (want, _, _) = reference
    wrong = write_gemma4_gguf(path, root / f"wrong-{len(what)}.gguf", **kwargs)
    got = _run(wrong, prompt, 0)[0]
    err = float(np.abs(got - want[:len(prompt)]).max())
    assert err > WRONG, f"{what}: the check would not catch it (max |Δlogit| {err:.3g})"


def _set(method: str, *args):
    return lambda writer: getattr(writer, method)(*args)


@pytest.mark.parametrize("kwargs, words", [
    ({"tweak": _set("add_rope_scaling_type", __import__("gguf").RopeScalingType.LINEAR)}, "rope.scaling.type"),
    ({"tweak": _set("add_rope_dimension_count_swa", 8)}, "rope.dimension_count_swa 8"),
    ({"tweak": _set("add_feed_forward_length", [64, 64, 96, 128, 128])}, "feed_forward_length"),
    ({"tweak": _set("add_value_length_swa", 8)}, "value_length_swa"),
    ({"rope_freqs": np.asarray([1.0, 0.5] + [1e30] * 14, np.float32)}, "rope_freqs.weight"),
])
def test_what_the_file_cannot_carry_is_refused_by_name(files, kwargs, words):
    from models.loaders.gguf import config_from_gguf, open_gguf

    path, _, root = files
    bad = write_gemma4_gguf(path, root / f"bad-{len(list(root.iterdir()))}.gguf", **kwargs)
    with pytest.raises(UnsupportedModelError, match=words.replace(".", r"\.")):
        config_from_gguf(open_gguf(bad))


def test_a_dense_file_without_per_layer_inputs_loads_as_its_safetensors(tmp_path):
    """The E2B/E4B shape of file (no experts) and the plainer one (no per-layer inputs, values of
    their own, no double-wide MLP, no soft-capping): the config is the safetensors config and every
    tensor finds its parameter."""
    import json

    from models.loader import load_checkpoint
    from models.loaders.gguf import config_from_gguf, open_gguf
    from models.registry import config_from_hf
    from tests.models.test_family_gemma4 import gemma4_config

    plain = gemma4_config(enable_moe_block=False, num_experts=None, hidden_size_per_layer_input=0,
                          attention_k_eq_v=False, use_double_wide_mlp=False, final_logit_softcapping=None)
    path = fc.make_checkpoint(tmp_path / "plain", plain)
    gguf_path = write_gemma4_gguf(path, tmp_path / "plain.gguf")
    want = config_from_hf(json.loads((path / "config.json").read_text()))
    ours = config_from_gguf(open_gguf(gguf_path))
    assert dataclasses.replace(ours, rms_norm_eps=want.rms_norm_eps) == want
    assert (ours.num_experts, ours.ple_dim, ours.k_eq_v, ours.double_wide_mlp, ours.final_logit_softcap) == \
        (0, 0, False, False, None)
    assert load_checkpoint(str(gguf_path)).config == ours  # every tensor placed
