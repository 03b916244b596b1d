"""A tiny Qwen3.5 checkpoint (DeltaNet and gated full attention, 2 k heads for 4 v heads) written as
llama.cpp's `qwen35` GGUF (tests/support/gguf_from_hf.py: the `ssm.*` keys, the layer kinds as
`attention.recurrent_layers`, norms as 1 + w, A_log as -exp(A_log), conv1d squeezed, the value heads
reordered from grouped to tiled) loads equal to the safetensors form: the same config field for
field, prompt and decode logits within 1e-4 and the same greedy tokens. Negative control: the value
heads left in the file's tiled order move the logits far past that. Layer kinds from
`full_attention_interval` alone (older files) give the same config; a mask that is not one boolean
per block is refused by key. A Qwen3.5-MoE checkpoint written as `qwen35moe` (experts stacked, the
shared expert and its gate, no dense feed_forward_length) loads equal to its safetensors form too;
its experts read in reverse order do not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import transformers

from ferrox_jax.plan import RowPlan
from tests.support import family_checks as fc

ATOL = 1e-4
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
PROMPT_TOKENS = 12
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    from tests.support.gguf_from_hf import write_qwen35_gguf

    root = tmp_path_factory.mktemp("qwen35-gguf")
    config = transformers.Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForCausalLM"]
    path = fc.make_checkpoint(root / "tiny-qwen3_5", config)
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.RandomState(7)
    for name in list(tensors):  # per-head values the init leaves equal: make every head's order matter
        if name.endswith(("A_log", "dt_bias")) or (name.endswith("norm.weight") and "layers" in name):
            tensors[name] = (tensors[name] + 0.3 * rng.randn(*tensors[name].shape)).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, write_qwen35_gguf(path, root / "tiny-qwen3_5.gguf"), root


def _runner(model):
    from ferrox_jax.runner import ModelRunner

    return ModelRunner(model, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_rows=8,
                       max_chunk_tokens=64, max_context=fc.MAX_CONTEXT, max_chunks=1)


def _row(tokens, start, blocks):
    return RowPlan(row_id=1, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=False,
                   state_slot=1)


def _run(runner, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """Prefill then greedy decode in state slot 1; (logits [prompt + steps, V], greedy tokens)."""
    from tests.support.engine_helpers import shuffled_blocks

    blocks = shuffled_blocks(12, fc.NUM_BLOCKS, seed=3)
    logits = [runner.run_logits([_row(prompt, 0, blocks)])[0]]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.run_logits([_row(tokens[-1:], len(tokens) - 1, blocks)])[0])
    return np.concatenate(logits), tokens[len(prompt):]


def _load(path: Path):
    from models.loader import load_checkpoint

    return load_checkpoint(str(path))


@pytest.fixture(scope="module")
def reference(files):
    ckpt = _load(files[0])
    prompt = np.random.RandomState(0).randint(0, ckpt.config.vocab_size, PROMPT_TOKENS).tolist()
    return prompt, ckpt, _run(_runner(ckpt.model), prompt, DECODE_STEPS)


def _config(path: Path):
    from models.loaders.gguf import config_from_gguf, open_gguf

    return config_from_gguf(open_gguf(path))


def test_config_is_the_safetensors_config(files, reference):
    ours, want = _config(files[1]), reference[1].config
    assert ours.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored as f32
    assert dataclasses.replace(ours, rms_norm_eps=want.rms_norm_eps) == want
    assert (ours.linear_layers, ours.rotary_dim, ours.linear_num_key_heads, ours.linear_num_value_heads) == (
        (True, False, True, False), 8, 2, 4)


def test_logits_and_greedy_match_the_safetensors_form(files, reference):
    from models.loaders.common import build_model
    from models.loaders.gguf import gguf_tensors, open_gguf
    from tests.support.gguf_from_hf import _tiled_heads

    prompt, ref, (want, want_tokens) = reference
    ckpt = _load(files[1])
    got, tokens = _run(_runner(ckpt.model), prompt, DECODE_STEPS)
    err = float(np.abs(got - want).max())
    print(f"qwen35 GGUF vs safetensors: max |Δlogit| {err:.2e} over {len(prompt)} + {DECODE_STEPS} positions")
    assert err < ATOL, f"GGUF logits differ from the safetensors form by {err:.3g}"
    assert tokens == want_tokens, "greedy tokens differ from the safetensors form"

    # Negative control: the z gate's and out_proj's value heads left in the file's tiled order.
    cfg = ckpt.config
    tensors = gguf_tensors(open_gguf(files[1]), cfg)
    for i in (0, 2):
        z, out = tensors[f"layers.{i}.in_proj_z"], tensors[f"layers.{i}.out_proj"]
        tensors[f"layers.{i}.in_proj_z"] = lambda z=z: _tiled_heads(z(), 1, 2, 2, 16)
        tensors[f"layers.{i}.out_proj"] = lambda out=out: _tiled_heads(out(), 0, 2, 2, 16)
    bad, _ = _run(_runner(build_model(cfg, tensors, ref.model.dtype)), prompt, 0)
    control = float(np.abs(bad - want[:len(prompt)]).max())
    print(f"  control (value heads left tiled in in_proj_z / out_proj): {control:.2e}")
    assert control > 1e-2, control


def test_layer_kinds_from_the_interval_alone(files, tmp_path):
    """Files without `attention.recurrent_layers` (every 4th layer full by llama.cpp's default)
    read the kinds from `full_attention_interval`; here 2 gives the checkpoint's mix."""
    from tests.support.gguf_from_hf import write_qwen35_gguf

    path = write_qwen35_gguf(files[0], tmp_path / "interval.gguf",
                             tweak=lambda w: (w.kv_data[0].pop("qwen35.attention.recurrent_layers"),
                                              w.add_full_attention_interval(2)))
    assert _config(path) == _config(files[1])


def test_a_layer_kind_mask_of_the_wrong_length_is_refused(files, tmp_path):
    from models.config import UnsupportedModelError
    from tests.support.gguf_from_hf import write_qwen35_gguf

    path = write_qwen35_gguf(files[0], tmp_path / "mask.gguf",
                             tweak=lambda w: w.add_array("qwen35.attention.recurrent_layers", [True, False]))
    with pytest.raises(UnsupportedModelError, match="recurrent_layers must hold one boolean per block"):
        _config(path)


def test_a_q8_0_file_on_the_block_kernel_is_the_file_dequantized(files):
    """Q8_0 matrices (what a quantized Hub file holds): the attention and MLP ones served as their
    blocks (`--quantization gguf`), the DeltaNet ones dequantized (they are regrouped first), against
    the same file dequantized: within 1e-4 and the same greedy tokens."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from models.loader import load_checkpoint
    from tests.support.gguf_from_hf import write_qwen35_gguf

    path, _, root = files
    q8 = GGMLQuantizationType.Q8_0
    quantized = write_qwen35_gguf(path, root / "tiny-qwen3_5-q8_0.gguf", quant=lambda name, arr: (
        (quantize(arr, q8), q8) if arr.ndim == 2 and arr.shape[-1] % 32 == 0 and name != "token_embd.weight"
        else None))
    prompt = np.random.RandomState(4).randint(0, 384, PROMPT_TOKENS).tolist()
    dequantized, want_tokens = _run(_runner(load_checkpoint(str(quantized)).model), prompt, 2)
    blocks, tokens = _run(_runner(load_checkpoint(str(quantized), quantization="gguf").model), prompt, 2)
    err = float(np.abs(blocks - dequantized).max())
    print(f"qwen35 Q8_0 GGUF, block kernel vs dequantized: max |Δlogit| {err:.2e}")
    assert err < ATOL, f"the Q8_0 blocks differ from the same file dequantized by {err:.3g}"
    assert tokens == want_tokens


# -- Qwen3.5-MoE (`qwen35moe`): the same layers with experts and a shared expert on every layer ----------

MOE_SHAPES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  layer_types=LAYER_TYPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, max_position_embeddings=512, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    from tests.support.gguf_from_hf import write_qwen35_gguf

    root = tmp_path_factory.mktemp("qwen35moe-gguf")
    config = transformers.Qwen3_5MoeTextConfig(**MOE_SHAPES)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    path = fc.make_checkpoint(root / "tiny-qwen3_5-moe", config)
    return path, write_qwen35_gguf(path, root / "tiny-qwen3_5-moe.gguf", arch="qwen35moe")


def test_qwen35moe_gguf_equals_safetensors(moe_files):
    """No feed_forward_length in the file (the converter has no dense width to write): the
    experts' width stands in for it as config_from_hf reads it; config field for field, logits
    within 1e-4, greedy identical. Negative control: each layer's experts read in reverse order."""
    from models.loaders.common import build_model
    from models.loaders.gguf import gguf_tensors, open_gguf

    path, gguf_path = moe_files
    ref = _load(path)
    assert "qwen35moe.feed_forward_length" not in open_gguf(gguf_path).fields
    ours, want = _config(gguf_path), ref.config
    assert dataclasses.replace(ours, rms_norm_eps=want.rms_norm_eps) == want
    assert (ours.num_experts, ours.shared_expert_intermediate_size, ours.dense_layers) == (4, 48, ())
    prompt = np.random.RandomState(1).randint(0, want.vocab_size, PROMPT_TOKENS).tolist()
    want_logits, want_tokens = _run(_runner(ref.model), prompt, DECODE_STEPS)
    ckpt = _load(gguf_path)
    got, tokens = _run(_runner(ckpt.model), prompt, DECODE_STEPS)
    err = float(np.abs(got - want_logits).max())
    print(f"qwen35moe GGUF vs safetensors: max |Δlogit| {err:.2e} over {len(prompt)} + {DECODE_STEPS} positions")
    assert err < ATOL, f"GGUF logits differ from the safetensors form by {err:.3g}"
    assert tokens == want_tokens, "greedy tokens differ from the safetensors form"

    tensors = gguf_tensors(open_gguf(gguf_path), ckpt.config)
    for i in range(4):
        for name in ("experts_gate", "experts_up", "experts_down"):
            good = tensors[f"layers.{i}.{name}"]
            tensors[f"layers.{i}.{name}"] = lambda good=good: np.ascontiguousarray(good()[::-1])
    bad, _ = _run(_runner(build_model(ckpt.config, tensors, ref.model.dtype)), prompt, 0)
    control = float(np.abs(bad - want_logits[:len(prompt)]).max())
    print(f"  control (experts in reverse order): {control:.2e}")
    assert control > 1e-3, control


def test_qwen3next_gguf_equals_safetensors(tmp_path_factory):
    """Qwen3-Next (`qwen3next`): the converter splits the fused in_proj_qkvz into attn_qkv / attn_gate
    and does not reorder the value heads (llama.cpp's qwen3next has no dense-MLP tensors, so no
    mlp_only_layers here). Config field for field, logits within 1e-4, greedy identical. Negative control: the
    joined in_proj_qkvz with its k-head groups in reverse order."""
    from models.loaders.common import build_model
    from models.loaders.gguf import gguf_tensors, open_gguf
    from tests.support.gguf_from_hf import write_qwen35_gguf

    root = tmp_path_factory.mktemp("qwen3next-gguf")
    config = transformers.Qwen3NextConfig(**MOE_SHAPES, intermediate_size=128)
    config.architectures = ["Qwen3NextForCausalLM"]
    path = fc.make_checkpoint(root / "tiny-qwen3-next", config)
    gguf_path = write_qwen35_gguf(path, root / "tiny-qwen3-next.gguf", arch="qwen3next")
    ref = _load(path)
    ours, want = _config(gguf_path), ref.config
    assert dataclasses.replace(ours, rms_norm_eps=want.rms_norm_eps) == want
    assert (ours.fused_deltanet, ours.dense_layers, ours.intermediate_size) == (True, (), 128)
    prompt = np.random.RandomState(2).randint(0, want.vocab_size, PROMPT_TOKENS).tolist()
    want_logits, want_tokens = _run(_runner(ref.model), prompt, DECODE_STEPS)
    ckpt = _load(gguf_path)
    got, tokens = _run(_runner(ckpt.model), prompt, DECODE_STEPS)
    err = float(np.abs(got - want_logits).max())
    print(f"qwen3next GGUF vs safetensors: max |Δlogit| {err:.2e} over {len(prompt)} + {DECODE_STEPS} positions")
    assert err < ATOL, f"GGUF logits differ from the safetensors form by {err:.3g}"
    assert tokens == want_tokens, "greedy tokens differ from the safetensors form"

    tensors = gguf_tensors(open_gguf(gguf_path), ckpt.config)
    for i in (0, 2):
        good = tensors[f"layers.{i}.in_proj_qkvz"]
        tensors[f"layers.{i}.in_proj_qkvz"] = lambda good=good: np.ascontiguousarray(
            good().reshape(64, 2, -1)[:, ::-1].reshape(64, -1))
    bad, _ = _run(_runner(build_model(ckpt.config, tensors, ref.model.dtype)), prompt, 0)
    control = float(np.abs(bad - want_logits[:len(prompt)]).max())
    print(f"  control (in_proj_qkvz's k-head groups reversed): {control:.2e}")
    assert control > 1e-3, control


def test_the_prediction_layer_is_dropped(files, reference, tmp_path):
    """A folder with the Hub's `mtp.*` block (a full-attention layer, fc and its norms): the file
    counts it in block_count and says so in `nextn_predict_layers`; it loads as the same model (the
    safetensors form without the block), logits within 1e-4. Negative control: the same file saying
    0 prediction layers fails to load, naming the nextn tensors it cannot place."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from models.loaders.common import CheckpointError
    from tests.support.gguf_from_hf import write_qwen35_gguf

    folder = tmp_path / "with-mtp"
    shutil.copytree(files[0], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    d = 64
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:  # layer 1 is a full-attention one
        tensors[name.replace("model.layers.1.", "mtp.layers.0.")] = tensors[name].copy()
    tensors.update({"mtp.fc.weight": np.full((d, 2 * d), 0.01, np.float32),
                    **{f"mtp.{k}.weight": np.ones(d, np.float32)
                       for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    path = write_qwen35_gguf(folder, tmp_path / "mtp.gguf")
    assert _config(path) == _config(files[1])
    prompt, _, (want, _) = reference
    got, _ = _run(_runner(_load(path).model), prompt, 0)
    assert float(np.abs(got - want[:len(prompt)]).max()) < ATOL

    bad = write_qwen35_gguf(folder, tmp_path / "no-nextn.gguf",
                            tweak=lambda w: w.add_uint32("qwen35.nextn_predict_layers", 0))
    with pytest.raises(CheckpointError, match="nextn"):
        _load(bad)
