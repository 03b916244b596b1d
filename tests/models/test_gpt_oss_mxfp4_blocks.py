"""gpt-oss's MXFP4 experts kept as their blocks (`--quantization gguf`, what `auto` picks on
one CPU device with ferrox's kernels) and multiplied by the MXFP4 kernel
(models/kernels/block_matmul_mxfp4.cc), from both of the checkpoints that carry them:

- HF safetensors with `quantization_config: mxfp4` (experts as `*_blocks` + `*_scales`,
  packed here as transformers packs them): repacked at load into llama.cpp's layout;
- a `gpt-oss` GGUF whose `ffn_*_exps` are MXFP4 (as llama.cpp's converter writes them).

The tiny gpt-oss is the family test's (transformers 5.25 builds it; biases and sinks
re-drawn). The reference is the path every other backend takes, the same checkpoint with
its experts dequantized to float32 at load: every MXFP4 weight is exact in float32, so the
two agree up to float32 summation order (logits within 1e-4, the same greedy tokens).
Negative controls: the kept blocks with their nibbles swapped, or their scales one exponent
up, miss by far more than that. A real server with `--quantization auto` over the MXFP4
folder picks the blocks and the kernel by itself and completes as the float path does.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.numpy import load_file, save_file

from ferrox_jax.runner import ModelRunner
from models import cpu_kernels
from models.gguf_blocks import BlockQuantizedWeight, dequantize_host
from models.loader import open_checkpoint
from tests.models.test_block_matmul_mxfp4 import scale_up, swap_nibbles
from tests.models.test_family_gpt_oss import NUM_EXPERTS, WRONG, _mxfp4_encode, make_gpt_oss
from tests.support import family_checks as fc
from tests.support.engine_helpers import generate_alone, shuffled_blocks
from tests.support.gguf_from_hf import write_gguf

STACKS = ("experts_gate", "experts_up", "experts_down")
D, F = 64, 32  # the family test's hidden and expert widths
PROMPT = [5, 80, 17, 230, 41, 9, 300, 77, 12, 140, 64, 3, 99, 7]

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def hf_mxfp4_folder(path, out):
    """The checkpoint at `path` with its experts in MXFP4 as released gpt-oss checkpoints store
    them (each expert's rows of outputs as blocks of 32 inputs; config quant_method mxfp4)."""
    shutil.copytree(path, out)
    tensors = {}
    for name, arr in load_file(str(path / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4_encode(np.ascontiguousarray(arr.swapaxes(-1, -2)))
        else:
            tensors[name] = arr
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptoss-mxfp4")
    path, _ = make_gpt_oss(root / "tiny-gpt-oss", swiglu_limit=7.0)  # a GGUF records no SwiGLU limit
    mx = Q.MXFP4
    gguf = write_gguf(path, root / "mxfp4.gguf", "gpt-oss",
                      quant=lambda name, arr: (quantize(arr, mx), mx) if name.endswith("_exps.weight") else None)
    return {"hf": hf_mxfp4_folder(path, root / "mxfp4-hf"), "gguf": gguf}


def stack_bytes(model) -> int:
    total = 0
    for layer in model.layers:
        for name in STACKS:
            w = getattr(layer, name).get_value()
            total += w.nbytes if isinstance(w, BlockQuantizedWeight) else np.asarray(w).nbytes
    return total


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_expert_stacks_stay_mxfp4_blocks_of_the_same_values(checkpoints, source):
    """Under gguf every expert stack is MXFP4 blocks, 17 bytes per 32 weights against 4 bytes a
    weight, whose values are the float path's experts exactly (the HF repacking included)."""
    src = open_checkpoint(str(checkpoints[source]))
    assert sorted(src.block_tensors) == sorted(f"layers.{i}.{s}" for i in range(2) for s in STACKS)
    float_model, block_model = src.build(quantization="none"), src.build(quantization="gguf")
    for name in STACKS:
        w = getattr(block_model.layers[1], name).get_value()
        assert isinstance(w, BlockQuantizedWeight) and w.fmt == "mxfp4" and w.blocks.ndim == 3
        want = np.asarray(getattr(float_model.layers[1], name)[...])  # [E, in, out]
        got = np.stack([dequantize_host(np.asarray(w.blocks[e]), "mxfp4", np.float32).T for e in range(NUM_EXPERTS)])
        np.testing.assert_array_equal(got, want)
    weights = 2 * 3 * NUM_EXPERTS * D * F  # layers x stacks x E x in x out
    assert stack_bytes(block_model) == weights * 17 / 32 and stack_bytes(float_model) == weights * 4


def test_auto_picks_the_blocks_on_the_cpu_kernel_only(checkpoints):
    """`auto` serves an HF MXFP4 checkpoint's blocks where the CPU kernel runs; a float
    checkpoint has no blocks, so it stays float (as every checkpoint does on TPU / GPU)."""
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.quant_setup import resolve_quantization

    mode, _ = resolve_quantization(EngineConfig(quantization="auto"), open_checkpoint(str(checkpoints["hf"])), None)
    assert mode == ("gguf" if cpu_kernels.unavailable_reason() is None else "none")
    plain = open_checkpoint(str(checkpoints["hf"].parent / "tiny-gpt-oss"))
    assert not plain.block_tensors
    assert resolve_quantization(EngineConfig(quantization="auto"), plain, None)[0] == "none"


def runner_for(model) -> ModelRunner:
    return ModelRunner(model, num_blocks=16, block_size=8, max_rows=1, max_chunk_tokens=16, max_context=64)


def prompt_logits(runner) -> np.ndarray:
    return runner.run_logits([fc._row(PROMPT, 0, shuffled_blocks(2, 16, seed=2))])[0]


def mutated(model, change) -> None:
    for layer in model.layers:
        for name in STACKS:
            w = getattr(layer, name).get_value()
            getattr(layer, name).set_value(w.replace(blocks=jnp.asarray(change(np.asarray(w.blocks)))))


@needs_kernels
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_kernel_matches_the_dequantized_path(checkpoints, source):
    """On the MXFP4 kernel: prompt logits within 1e-4 of the float experts', the same 8
    greedy tokens, no recompiles after warm-up; nibbles swapped or scales one exponent up miss."""
    src = open_checkpoint(str(checkpoints[source]))
    model = src.build(quantization="gguf")
    assert cpu_kernels.pack_blocks_for_kernel(model) == 2 * 3, "the expert stacks are the only block weights"
    down = model.layers[0].experts_down.get_value()
    assert down.kernel == cpu_kernels.BLOCK_MXFP4_TARGET and (down.int_rows, down.wide_rows) == (0, 0)
    runner, ref_runner = runner_for(model), runner_for(src.build(quantization="none"))
    runner.warmup()
    blocks = shuffled_blocks(3, 16, seed=1)
    assert generate_alone(runner, PROMPT, 8, blocks) == generate_alone(ref_runner, PROMPT, 8, blocks)
    got, ref = prompt_logits(runner), prompt_logits(ref_runner)
    err = float(np.abs(got - ref).max())
    assert err < fc.ATOL, f"{source}: MXFP4 kernel vs dequantized experts {err:.3g}"
    assert runner.recompiles_after_warmup == 0
    misses = {}
    for change in (swap_nibbles, scale_up):
        wrong = src.build(quantization="gguf")
        cpu_kernels.pack_blocks_for_kernel(wrong)
        mutated(wrong, change)
        misses[change.__name__] = float(np.abs(prompt_logits(runner_for(wrong)) - ref).max())
    print(f"gpt-oss MXFP4 {source} on the kernel: max |Δlogit| vs dequantized {err:.2e}; controls {misses}")
    assert all(m > WRONG for m in misses.values()), misses



@needs_kernels
def test_served_with_auto_on_the_kernel(checkpoints):
    """A real server over the MXFP4 safetensors folder with `--quantization auto` (the
    server's default): the start-up line names the MXFP4 kernel, and its greedy completion
    is the dequantized path's (the tokens our float experts give the row alone)."""
    import openai

    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    engine = tiny_engine(checkpoints["hf"], quantization="auto", **fc.SERVE_LIMITS)
    assert engine.config.quantization == "gguf"
    assert "6 MXFP4 (expert stacks), on the" in engine.matmul_note, engine.matmul_note
    with ServerThread(create_app(engine)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        text = client.completions.create(model=client.models.list().data[0].id, prompt="The quick brown fox",
                                         max_tokens=8, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    ref = ModelRunner(open_checkpoint(str(checkpoints["hf"])).build(quantization="none"), num_blocks=16,
                      block_size=8, max_rows=1, max_chunk_tokens=16, max_context=64)
    want = generate_alone(ref, engine.tokenizer.encode("The quick brown fox"), 8, shuffled_blocks(3, 16, seed=1))
    assert text == engine.tokenizer.decode(want), (text, want)
    assert engine.stats().recompiles_after_warmup == 0
