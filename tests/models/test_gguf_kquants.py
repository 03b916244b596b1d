"""`--quantization gguf` on K-quant files: a tiny Qwen3 in llama.cpp's Q4_K_M mix (Q4_K and
Q6_K) and in Q5_K, against transformers on the float model of the same weights.

K-quant rows hold 256-weight super-blocks, so the model is hidden 256 (the smallest that
fits; intermediate 512, 2 layers, head_dim 64). Every projection and the LM head are
quantized (tests/support/kquant_blocks.py); the embedding and norms stay float32, as in llama.cpp's
files. The reference is HF's model built from the dequantized weights: what the blocks
are, so ours must reproduce its greedy tokens and its logits up to float32 rounding.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file

from ferrox_jax.runner import ModelRunner
from models import cpu_kernels
from models.gguf_blocks import BlockQuantizedWeight, dequantize_host
from models.loader import open_checkpoint
from tests.support import family_checks as fc
from tests.support.engine_helpers import generate_alone, prompt_logits, shuffled_blocks
from tests.support.gguf_from_hf import write_gguf
from tests.support.kquant_blocks import quantize_k

GGML = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
# llama.cpp's Q4_K_M: Q6_K for attn_v, ffn_down and the head, Q4_K for the rest (roughly:
# it alternates some layers' attn_v / ffn_down). By the name's last part (HF or GGUF).
Q6_IN_Q4_K_M = ("v_proj", "attn_v", "down_proj", "ffn_down", "lm_head", "output")
# Two files cover the three formats (each file's warm-up is most of this module's time).
SCHEMES = ("q4_k_m", "q5_k")
PROJECTIONS = 7 * 2 + 1  # per layer q k v o gate up down, and the LM head

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def fmt_for(scheme: str, name: str) -> str | None:
    """The format of tensor `name` (HF or GGUF name) in `scheme`; None: stays float."""
    if "embed" in name or "token_embd" in name:
        return None
    if scheme == "q4_k_m":
        return "q6_k" if name.split(".")[-2] in Q6_IN_Q4_K_M else "q4_k"
    return scheme


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False)
    return fc.make_checkpoint(tmp_path_factory.mktemp("kq") / "tiny-qwen3", config)


@pytest.fixture(scope="module")
def quantized(base, tmp_path_factory):
    """scheme -> (the GGUF, HF's float model of its dequantized weights), each made once."""
    made = {}

    def get(scheme: str):
        if scheme not in made:
            made[scheme] = _quantize(base, tmp_path_factory.mktemp(scheme), scheme)
        return made[scheme]
    return get


def _quantize(base, tmp, scheme: str):
    ref_dir = tmp / f"ref-{scheme}"
    shutil.copytree(base, ref_dir)
    tensors = load_file(str(base / "model.safetensors"))
    for name, arr in tensors.items():
        fmt = fmt_for(scheme, name) if arr.ndim == 2 else None
        if fmt is not None:
            tensors[name] = dequantize_host(quantize_k(arr, fmt), fmt, np.float32)
    save_file(tensors, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})

    def quant(name, arr):
        fmt = fmt_for(scheme, name)
        return None if fmt is None else (quantize_k(arr, fmt), GGML[fmt])

    path = write_gguf(base, tmp / f"tiny-{scheme}.gguf", "qwen3", quant=quant)
    return path, fc.hf_model(ref_dir)


PROMPT = [5, 80, 17, 230, 41, 9, 300, 77, 12, 140, 64]


@needs_kernels
@pytest.mark.parametrize("scheme", SCHEMES)
def test_kernel_greedy_equals_the_dequantized_float_model(quantized, scheme):
    path, hf = quantized(scheme)
    model = open_checkpoint(str(path)).build(quantization="gguf")
    layer = model.layers[1]
    for proj, name in ((layer.v_proj, "v_proj"), (layer.down_proj, "down_proj"), (layer.q_proj, "q_proj")):
        w = proj.get_value()
        want = fmt_for(scheme, f"{name}.weight")
        assert isinstance(w, BlockQuantizedWeight) and w.fmt == want, f"{name} kept as {want} blocks"
    assert model.lm_head.get_value().fmt == fmt_for(scheme, "lm_head.weight")
    assert cpu_kernels.pack_blocks_for_kernel(model) == PROJECTIONS
    assert cpu_kernels.k_quant_count(model) == PROJECTIONS, "what the start-up log counts"
    assert model.lm_head.get_value().kernel == cpu_kernels.BLOCK_K_TARGET
    runner = ModelRunner(model, num_blocks=16, block_size=8, max_rows=1, max_chunk_tokens=16, max_context=64)
    runner.warmup()
    got = generate_alone(runner, PROMPT, 8, shuffled_blocks(3, 16, seed=1))
    assert got == fc.hf_greedy(hf, PROMPT, 8), f"{scheme}: greedy tokens differ from HF's on the dequantized weights"
    logits = runner.run_logits([fc._row(PROMPT, 0, shuffled_blocks(2, 16, seed=2))])[0]
    ref = fc.hf_logits(hf, PROMPT)
    # the 11-row prompt: float32 activations (float32 rounding only, 1e-4), or where the K-quant
    # kernel takes 16-bit integer activations at 2 to 15 rows (AVX-512 VNNI, wide_rows 1) their
    # rounding, each activation off by up to amax / 65534 of its 256-wide super-block (3.4e-4
    # of max |logit| on the Q5_K model; a wrong product is O(1))
    tol = 1e-3 if cpu_kernels.block_k_wide_rows() == 1 else 1e-4
    assert np.abs(logits - ref).max() < tol * max(1.0, np.abs(ref).max()), "the kernel path's rounding only"
    assert runner.recompiles_after_warmup == 0


def test_xla_path_equals_the_dequantized_float_model(quantized):
    # no kernel (as on a non-x86 host): XLA dequantizes the super-blocks and runs a float dot
    path, hf = quantized("q4_k_m")
    model = open_checkpoint(str(path)).build(quantization="gguf")
    assert model.layers[0].down_proj.get_value().kernel is None
    got = prompt_logits(model, PROMPT, tuple(shuffled_blocks(2, 48, seed=3)))
    ref = fc.hf_logits(hf, PROMPT)
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())
