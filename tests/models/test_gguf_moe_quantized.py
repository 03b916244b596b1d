"""`--quantization gguf` on a MoE GGUF: the expert stacks (`ffn_{gate,up,down}_exps`) stay the
file's blocks, u8[E, out, row bytes] (`models/gguf_blocks.py`), and each expert's tile
multiplies its own slice of them, where they used to be dequantized to float32 at load.

A tiny Qwen3-MoE (hidden 256 so K-quant super-blocks fit, 4 experts of width 256, 2
layers) written by our writer with its expert stacks in Q8_0 or Q4_K (the rest float32);
the reference is today's path on the same file (`--quantization none`: the blocks
dequantized at load), so the two agree up to float32 rounding. Negative control: the
block stacks rolled by one expert must miss by far more than the tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from ferrox_jax.runner import ModelRunner
from models import cpu_kernels
from models.gguf_blocks import BlockQuantizedWeight
from models.loader import open_checkpoint
from tests.support import family_checks as fc
from tests.support.engine_helpers import generate_alone, prompt_logits, shuffled_blocks
from tests.support.gguf_from_hf import write_gguf
from tests.support.kquant_blocks import quantize_k

E, D, F = 4, 256, 256
PROMPT = [5, 80, 17, 230, 41, 9, 300, 77, 12, 140, 64]
STACKS = ("experts_gate", "experts_up", "experts_down")

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _quant(fmt: str):
    def quant(name, arr):
        if "_exps" not in name:
            return None
        if fmt == "q8_0":
            return quantize(arr, Q.Q8_0), Q.Q8_0
        rows = quantize_k(arr.reshape(-1, arr.shape[-1]), fmt)  # [E * out, in] -> [E, out, row bytes]
        return rows.reshape(*arr.shape[:-1], -1), Q.Q4_K
    return quant


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("moeq")
    config = transformers.Qwen3MoeConfig(hidden_size=D, intermediate_size=512, moe_intermediate_size=F,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, max_position_embeddings=256, num_experts=E,
                                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    base = fc.make_checkpoint(root / "tiny-qwen3moe", config)
    return {fmt: write_gguf(base, root / f"{fmt}.gguf", "qwen3moe", quant=_quant(fmt)) for fmt in ("q8_0", "q4_k")}


def stack_bytes(model) -> int:
    total = 0
    for layer in model.layers:
        for name in STACKS:
            w = getattr(layer, name).get_value()
            total += w.nbytes if isinstance(w, BlockQuantizedWeight) else np.asarray(w).nbytes
    return total


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_expert_stacks_stay_blocks_and_equal_the_dequantized_path(files, fmt):
    float_model = open_checkpoint(str(files[fmt])).build(quantization="none")
    block_model = open_checkpoint(str(files[fmt])).build(quantization="gguf")
    gate = block_model.layers[0].experts_gate.get_value()
    assert isinstance(gate, BlockQuantizedWeight) and gate.fmt == fmt, "the stack is kept as the file's blocks"
    assert gate.shape == (E, D, F) and gate.blocks.ndim == 3
    # bytes per weight: Q8_0 34 per 32, Q4_K 144 per 256; float32 4
    per_weight = {"q8_0": 34 / 32, "q4_k": 144 / 256}[fmt]
    weights = 2 * 3 * E * D * F  # layers x stacks x E x in x out
    assert stack_bytes(block_model) == weights * per_weight
    assert stack_bytes(float_model) == weights * 4
    blocks = tuple(shuffled_blocks(2, 48, seed=3))
    ref = prompt_logits(float_model, PROMPT, blocks)
    got = prompt_logits(block_model, PROMPT, blocks)
    tol = 1e-4 * max(1.0, float(np.abs(ref).max()))
    assert np.abs(got - ref).max() < tol, f"{fmt}: blocks vs dequantized at load differ by {np.abs(got - ref).max()}"
    # control: every expert computed from its neighbour's blocks
    layer = block_model.layers[0]
    layer.experts_up.set_value(layer.experts_up.get_value().replace(
        blocks=np.roll(np.asarray(layer.experts_up.get_value().blocks), 1, axis=0)))
    wrong = prompt_logits(block_model, PROMPT, blocks)
    assert np.abs(wrong - ref).max() > 10 * tol, "the experts' blocks must be told apart"


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_kernel_runs_the_expert_blocks_with_no_recompiles(files, fmt):
    """On the block kernel with float32 activations (a stack's tiles are padded to 8+ rows, so
    the int8/int16 activation paths' row thresholds are off for stacks): float32 rounding only."""
    float_model = open_checkpoint(str(files[fmt])).build(quantization="none")
    model = open_checkpoint(str(files[fmt])).build(quantization="gguf")
    packed = cpu_kernels.pack_blocks_for_kernel(model, int_rows=5, wide_rows=5, amx_rows=5)
    down = model.layers[0].experts_down.get_value()
    assert down.kernel == cpu_kernels.block_target(fmt)
    assert (down.int_rows, down.wide_rows, down.amx_rows) == (0, 0, 0), "stacks take the float path"
    assert packed == 2 * 3, "the expert stacks are the only block weights of this file"
    runner = ModelRunner(model, num_blocks=16, block_size=8, max_rows=1, max_chunk_tokens=16, max_context=64)
    runner.warmup()
    ref_runner = ModelRunner(float_model, num_blocks=16, block_size=8, max_rows=1, max_chunk_tokens=16,
                             max_context=64)
    blocks = shuffled_blocks(3, 16, seed=1)
    assert generate_alone(runner, PROMPT, 6, blocks) == generate_alone(ref_runner, PROMPT, 6, blocks)
    logits = runner.run_logits([fc._row(PROMPT, 0, shuffled_blocks(2, 16, seed=2))])[0]
    ref = ref_runner.run_logits([fc._row(PROMPT, 0, shuffled_blocks(2, 16, seed=2))])[0]
    assert np.abs(logits - ref).max() < 1e-4 * max(1.0, float(np.abs(ref).max()))
    assert runner.recompiles_after_warmup == 0
