"""gpt-oss against HF transformers: attention sinks, a 12-key window on alternating layers,
YaRN RoPE (factor 8 over a 64-token pretraining context, so the ramp and its mscale both
act within the test's 80 positions), biases on q/k/v/o, a biased router with softmax over
the top-2 of 4 experts, the fused interleaved gate_up_proj and the clamped SwiGLU (limit
lowered to 0.5 here so the clamps bite at these tiny activations).

Each new mechanism has a negative control: the same weights with it switched off or
wrong must miss HF by far more than the parity tolerance."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from models.config import UnsupportedModelError
from tests.support import family_checks as fc
from tests.support.xla_flags import with_devices

NUM_EXPERTS = 4
WINDOW = 12
LIMIT = 0.5
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
WRONG = 20 * fc.ATOL  # a control must miss HF by at least this


def gpt_oss_config(**overrides):
    fields = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_local_experts=NUM_EXPERTS,
                  num_experts_per_tok=2, sliding_window=WINDOW, rope_parameters=dict(YARN), swiglu_limit=LIMIT,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.GptOssConfig(**fields)


def make_gpt_oss(folder, **overrides):
    """The tiny checkpoint, its biases re-drawn: the shared helper sets every 1-D parameter to
    1 + 0.1 * randn (a norm's shape), which would give every router the same favourite
    experts and every head the same sink. Biases ~ N(0, 0.1), sinks ~ N(0, 1)."""
    import torch

    path = fc.make_checkpoint(folder, gpt_oss_config(**overrides))
    hf = fc.hf_model(path)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 1 and not name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path, hf = make_gpt_oss(tmp_path_factory.mktemp("gptoss") / "tiny-gpt-oss")
    return path, hf, fc.check_family(path, hf)


def test_config_reads_windows_yarn_and_the_experts(gpt_oss):
    cfg = gpt_oss[2].config
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == WINDOW
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate
    # YaRN's mscale: 0.1 * ln(8) + 1
    assert cfg.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(8.0) + 1)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (NUM_EXPERTS, 2, 32)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (pytest.approx(1.702), LIMIT) and cfg.attention_bias


def test_yarn_frequencies_are_transformers(gpt_oss):
    import torch  # noqa: F401  (transformers' rope functions return torch tensors)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.rope import rope_inv_freq

    cfg = gpt_oss[2].config
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](fc.hf_model(gpt_oss[0]).config)
    got = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert cfg.rope_scaling.attention_factor == pytest.approx(factor)
    default = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, dataclasses.replace(cfg.rope_scaling, rope_type="default"))
    assert np.abs(got - default).max() > 1e-3, "the ramp must change some frequencies in this config"


def test_every_expert_gets_traffic(gpt_oss):
    _, hf, report = gpt_oss
    routers = [layer.mlp.router for layer in hf.model.layers]
    seen = [set() for _ in routers]
    hooks = [r.register_forward_hook(lambda mod, args, out, i=i: seen[i].update(out[2].flatten().tolist()))
             for i, r in enumerate(routers)]
    try:
        fc.hf_logits(hf, report.tokens)
    finally:
        for h in hooks:
            h.remove()
    assert seen == [set(range(NUM_EXPERTS))] * 2


def test_matches_transformers(gpt_oss):
    fc.assert_report(gpt_oss[2], "gpt_oss")


def test_gate_up_is_split_even_odd(gpt_oss):
    """HF's fused gate_up_proj [E, D, 2F] (already [in, out]) interleaves gate and up."""
    from models.loader import load_checkpoint

    path, hf, _ = gpt_oss
    layer = load_checkpoint(str(path)).model.layers[0]
    fused = hf.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
    fused_bias = hf.model.layers[0].mlp.experts.gate_up_proj_bias.detach().numpy()
    np.testing.assert_array_equal(np.asarray(layer.experts_gate[...]), fused[..., ::2])
    np.testing.assert_array_equal(np.asarray(layer.experts_up[...]), fused[..., 1::2])
    np.testing.assert_array_equal(np.asarray(layer.experts_up_bias[...]), fused_bias[..., 1::2])
    assert not np.array_equal(fused[..., ::2], fused[..., :32]), "halves would be a different split"


def _prefill_err(path, hf, prompt, cfg_change=None, layer_change=None, attention=None, decode=0) -> float:
    """Max |ours - HF| over the prompt's logits, our model built from the checkpoint with its
    config changed (`cfg_change(cfg)`) or each layer changed in place (`layer_change(layer)`),
    attending through `attention` (a kernel; None: pure JAX); the last `decode` tokens go
    in as one-token decode rows after the prefill of the others."""
    from models.loaders.common import build_model
    from models.loaders.safetensors import read_config, read_tensors
    from tests.support.engine_helpers import shuffled_blocks

    cfg = read_config(path)
    model = build_model(cfg_change(cfg) if cfg_change else cfg, read_tensors(path, cfg), decode_attention=attention)
    for layer in model.layers if layer_change else ():
        layer_change(layer)
    from ferrox_jax.runner import ModelRunner

    runner = ModelRunner(model, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_rows=1,
                         max_chunk_tokens=len(prompt), max_context=fc.MAX_CONTEXT)
    blocks, n = shuffled_blocks(20, fc.NUM_BLOCKS, seed=3), len(prompt) - decode
    ours = [runner.run_logits([fc._row(prompt[:n], 0, blocks)])[0]]
    ours += [runner.run_logits([fc._row(prompt[i:i + 1], i, blocks)])[0] for i in range(n, len(prompt))]
    return float(np.abs(np.concatenate(ours) - fc.hf_logits(hf, prompt)).max())


def test_negative_controls_miss_transformers(gpt_oss):
    """Sinks off (a -1e9 logit takes no share of the softmax), YaRN without its mscale,
    the SwiGLU unclamped: each misses HF's logits by far more than the parity tolerance."""
    path, hf, report = gpt_oss

    def no_sinks(layer):
        layer.sinks.set_value(jnp.full_like(layer.sinks[...], -1e9))

    errs = {
        "sinks off": _prefill_err(path, hf, report.prompt, layer_change=no_sinks),
        "mscale 1": _prefill_err(path, hf, report.prompt, cfg_change=lambda c: dataclasses.replace(
            c, rope_scaling=dataclasses.replace(c.rope_scaling, attention_factor=1.0))),
        "unclamped": _prefill_err(path, hf, report.prompt,
                                  cfg_change=lambda c: dataclasses.replace(c, swiglu_limit=1e9)),
    }
    print("gpt_oss negative controls, max |Δlogit| vs HF:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(err > WRONG for err in errs.values()), errs


def test_ragged_kernel_serves_sinks(gpt_oss):
    """The ragged GPU kernel (Pallas interpret mode on the CPU) attends every layer of the
    prompt in one call, sinks and window included: HF's logits; without the sinks it misses."""
    from models.ragged_gpu import GpuRaggedAttention

    path, hf, report = gpt_oss
    kernel = GpuRaggedAttention(interpret=True)
    err = _prefill_err(path, hf, report.prompt, attention=kernel, decode=2)
    off = _prefill_err(path, hf, report.prompt, attention=kernel, decode=2,
                       layer_change=lambda layer: layer.sinks.set_value(jnp.full_like(layer.sinks[...], -1e9)))
    print(f"gpt_oss ragged kernel: max |Δlogit| vs HF {err:.2e}; sinks off {off:.2e}")
    assert err < fc.ATOL and off > WRONG, (err, off)


def test_cpu_decode_kernel_leaves_sink_layers_to_pure_jax(gpt_oss):
    """With the CPU decode kernel chosen (as `auto` does on a CPU), every gpt-oss layer has
    sinks, which the kernel does not know: they attend through pure JAX, prefill and
    decode, and match HF (models/layers.py picks the path per layer)."""
    from models import cpu_attention, cpu_kernels

    if cpu_kernels.unavailable_reason():
        pytest.skip(cpu_kernels.unavailable_reason())
    path, hf, report = gpt_oss
    err = _prefill_err(path, hf, report.prompt, attention=cpu_attention.decode_attention(), decode=2)
    assert err < fc.ATOL, f"gpt_oss with the CPU kernel chosen differs from HF by {err:.3g}"


def test_tensor_parallel_2_matches_one_device(gpt_oss):
    """tp=2 on two simulated CPU devices (a subprocess, as tests/system/test_sharding.py):
    the same logits as one device, heads split with their sinks, experts and their gate/up
    biases split over the intermediate axis, the router and down bias replicated."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XLA_FLAGS": with_devices(2)}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / ".jax_cache"))
    proc = subprocess.run([sys.executable, str(root / "tests" / "support" / "sharding_probe.py"), "family_tp", "2",
                           str(gpt_oss[0])], cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    parity, place = got["parity"], got["placement"]
    assert parity["prefill_err"] < fc.ATOL and parity["decode_err"] < fc.ATOL and parity["same_greedy"], parity
    # 4 heads x 16 and 2 KV heads over 2 devices; F 32 -> 16 per device; E 4, D 64.
    shards = {name: place[name]["shard_shapes"] for name in place}
    assert shards["sinks"] == [[2]] and shards["q_proj"] == [[64, 32]] and shards["o_bias"] == [[64]]
    assert shards["experts_gate"] == [[4, 64, 16]] and shards["experts_down"] == [[4, 16, 64]]
    assert shards["experts_gate_bias"] == [[4, 16]] and shards["experts_up_bias"] == [[4, 16]]
    assert shards["experts_down_bias"] == [[4, 64]] and shards["router"] == [[64, 4]]
    assert shards["router_bias"] == [[4]]


def test_other_quantization_methods_are_refused_by_name():
    from models.registry import config_from_hf

    cfg = gpt_oss_config().to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(UnsupportedModelError, match="'awq'"):
        config_from_hf(cfg)


def _mxfp4_encode(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32[..., R, C] -> (u8 blocks [..., R, C/32, 16], u8 scales [..., R, C/32]) as transformers
    packs MXFP4: each group of 32 scaled by a power of two, codes rounded to the nearest FP4
    value, two a byte with the even index in the low nibble."""
    from models.loaders.mxfp4 import FP4_VALUES

    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exp = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exp)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(gpt_oss, tmp_path):
    """The released checkpoints' layout (quantization_config mxfp4, experts as *_blocks +
    *_scales): our experts are transformers' own dequantization of the same blocks
    (`convert_moe_packed_tensors`) exactly, and the logits HF's for a float checkpoint of
    those values; against the unquantized experts they miss (the blocks really are read)."""
    import json
    import shutil

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from models.loader import load_checkpoint

    path, hf, report = gpt_oss
    packed, ref = tmp_path / "mxfp4", tmp_path / "dequantized"
    shutil.copytree(path, packed)
    shutil.copytree(path, ref)
    tensors = load_file(str(path / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, arr in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name] = dequantized[name] = arr
            continue
        blocks, scales = _mxfp4_encode(np.ascontiguousarray(arr.swapaxes(-1, -2)))  # stored per output row
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                       dtype=torch.float32).numpy()
    save_file(quantized, str(packed / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(cfg))

    layer = load_checkpoint(str(packed)).model.layers[1]
    np.testing.assert_array_equal(np.asarray(layer.experts_up[...]),
                                  dequantized["model.layers.1.mlp.experts.gate_up_proj"][..., 1::2])
    np.testing.assert_array_equal(np.asarray(layer.experts_down[...]),
                                  dequantized["model.layers.1.mlp.experts.down_proj"])
    err = _prefill_err(packed, fc.hf_model(ref), report.prompt)
    control = _prefill_err(packed, hf, report.prompt)
    print(f"gpt-oss MXFP4 safetensors: max |Δlogit| vs HF (same MXFP4 values) {err:.2e}; vs float {control:.2e}")
    assert err < fc.ATOL and control > WRONG, (err, control)


def test_served_end_to_end(gpt_oss):
    path, hf, _ = gpt_oss
    fc.assert_served(fc.serve(path), hf, "GptOssForCausalLM")


@pytest.fixture(scope="module")
def gpt_oss_for_gguf(tmp_path_factory):
    """A GGUF does not record the SwiGLU constants (llama.cpp uses gpt-oss's 1.702 and 7.0):
    this checkpoint keeps the default limit, everything else as above."""
    path, hf = make_gpt_oss(tmp_path_factory.mktemp("gptoss-gguf") / "tiny-gpt-oss", swiglu_limit=7.0)
    return path, hf


def test_gguf_loads_the_same_model(gpt_oss_for_gguf, tmp_path):
    """Written as llama.cpp's converter writes gpt-oss (gate/up de-interleaved and every
    expert transposed, sinks, biases, YaRN and the window as metadata): HF's logits."""
    path, hf = gpt_oss_for_gguf
    prompt = np.random.RandomState(0).randint(0, hf.config.vocab_size, fc.PROMPT_TOKENS).tolist()
    got = fc.check_gguf(path, tmp_path / "tiny-gpt-oss.gguf", "gpt-oss", hf, prompt)
    assert got["err"] < fc.ATOL, f"gpt-oss GGUF prompt logits differ from HF by {got['err']:.3g}"
    cfg, ref = got["config"], got["reference_config"]
    assert cfg.architecture == "GptOssForCausalLM" and cfg.layer_types == ref.layer_types
    assert cfg.rope_scaling == ref.rope_scaling and cfg.sliding_window == WINDOW
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.swiglu_limit) == (NUM_EXPERTS, 32, 7.0)
    assert got["same_tokens"]


def test_mxfp4_expert_stacks_load_as_their_blocks(gpt_oss_for_gguf, tmp_path):
    """Expert stacks in MXFP4 (as released gpt-oss GGUFs have them), dequantized at load:
    HF's logits for the checkpoint with its experts put through the same MXFP4 round trip
    (blocks of 32 along each expert's input axis); against the float experts they miss."""
    import shutil

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    from tests.support.gguf_from_hf import write_gguf

    path, hf = gpt_oss_for_gguf
    mx = GGMLQuantizationType.MXFP4

    def roundtrip_rows(arr):  # [E, in, out] -> each output's row of inputs through MXFP4
        rows = np.ascontiguousarray(arr.swapaxes(-1, -2))
        return np.ascontiguousarray(dequantize(quantize(rows, mx), mx).reshape(rows.shape).swapaxes(-1, -2))

    ref_dir = tmp_path / "mxfp4-reference"
    shutil.copytree(path, ref_dir)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: roundtrip_rows(v) if k.endswith(("gate_up_proj", "down_proj")) else v for k, v in tensors.items()},
              str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    gguf_path = write_gguf(path, tmp_path / "mxfp4.gguf", "gpt-oss",
                           quant=lambda name, arr: (quantize(arr, mx), mx) if name.endswith("_exps.weight") else None)
    prompt = np.random.RandomState(0).randint(0, hf.config.vocab_size, fc.PROMPT_TOKENS).tolist()
    from tests.support.engine_helpers import make_runner, shuffled_blocks

    runner, _ = make_runner(gguf_path, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_context=fc.MAX_CONTEXT)
    ours = runner.run_logits([fc._row(prompt, 0, shuffled_blocks(20, fc.NUM_BLOCKS, seed=2))])[0]
    err = float(np.abs(ours - fc.hf_logits(fc.hf_model(ref_dir), prompt)).max())
    control = float(np.abs(ours - fc.hf_logits(hf, prompt)).max())
    print(f"gpt-oss MXFP4 experts GGUF: max |Δlogit| vs HF (same MXFP4 experts) {err:.2e}; vs float {control:.2e}")
    assert err < fc.ATOL and control > WRONG, (err, control)
