"""Gemma 4 (text) against HF transformers 5.25: five layers covering every layer kind.

    layer 0  sliding, own K/V                 (head 16, 2 kv heads, RoPE default 10000)
    layer 1  sliding, own K/V: the sliding source of the shared layers
    layer 2  full, keys serve as values (no v_proj), head 32 and 1 kv head, proportional
             RoPE rotating a quarter of the head's frequency pairs: the full source
    layer 3  sliding, reads layer 1's cache (no K/V of its own), double-wide MLP
    layer 4  full, reads layer 2's cache, double-wide MLP
Every layer has per-layer inputs (8 wide), the MoE block beside the dense MLP (top-2 of 4
experts), a random `layer_scalar`; logits are soft-capped at 30. Window 12.

The shared checks (tests/support/family_checks.py): 48-token prefill and 32 greedy steps
within 1e-4 of HF, chunked == one-shot, batched == alone, a real server. Each new
mechanism has a negative control: the same weights with it switched off or wrong miss HF
by far more than the parity tolerance."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models.config import UnsupportedModelError
from models.gemma4 import Gemma4Config
from models.registry import config_from_hf
from tests.support import family_checks as fc
from tests.support.xla_flags import with_devices

WRONG = 20 * fc.ATOL  # a control must miss HF by at least this
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma4_config(**overrides):
    fields = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                  attention_k_eq_v=True, sliding_window=12, layer_types=list(TYPES), num_kv_shared_layers=2,
                  use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=384,
                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                  final_logit_softcapping=30.0, max_position_embeddings=512)
    fields.update(overrides)
    config = transformers.Gemma4TextConfig(**fields)
    config.architectures = ["Gemma4ForCausalLM"]
    return config


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    path = fc.make_checkpoint(tmp_path_factory.mktemp("gemma4") / "tiny-gemma4", gemma4_config())
    hf = fc.hf_model(path)
    # The shared helper re-draws parameters only; layer_scalar is a buffer (ones): re-draw it too.
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.layer_scalar.copy_(1.0 + 0.2 * torch.randn_like(layer.layer_scalar))
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf, fc.check_family(path, hf)


def test_config_reads_every_layer_kind(gemma4):
    cfg = gemma4[2].config
    assert (cfg.layer_head_dims, cfg.layer_kv_heads) == ((16, 16, 32, 16, 32), (2, 2, 1, 2, 1))
    assert [cfg.kv_source(i) for i in range(5)] == [0, 1, 2, 1, 2]
    assert (cfg.rope_global_type, cfg.rope_global_partial, cfg.rope_theta, cfg.rope_local_theta) == \
        ("proportional", 0.25, 1_000_000.0, 10000.0)
    assert (cfg.k_eq_v, cfg.ple_dim, cfg.num_experts, cfg.top_k, cfg.final_logit_softcap) == (True, 8, 4, 2, 30.0)


def test_matches_transformers(gemma4):
    fc.assert_report(gemma4[2], "gemma4")


def test_shared_layers_hold_no_cache(gemma4):
    """Three K/V array pairs for five layers, each of its own layer's shape, and the bytes
    per block count those three only."""
    from ferrox_jax.kv_cache import layout_bytes_per_block
    from tests.support.engine_helpers import make_runner

    runner, ckpt = make_runner(gemma4[0], num_blocks=8, block_size=4, max_context=32)
    shapes = [a.shape for a in runner.kv_cache.k]
    assert shapes == [(2, 8, 4, 16), (2, 8, 4, 16), (1, 8, 4, 32)]
    assert [a.shape for a in runner.kv_cache.v] == shapes
    per_token = 2 * (2 * 16 + 2 * 16 + 32) * 4  # K and V, float32
    assert ckpt.config.kv_bytes_per_token(4) == per_token
    assert layout_bytes_per_block(ckpt.config.kv_layout(), 4, jnp.float32) == 4 * per_token
    assert runner.kv_cache.nbytes == 8 * 4 * per_token


class _FirstOfKind(Gemma4Config):
    """A wrong reading of KV sharing: the first layer of a kind as the source, not the last."""

    def kv_source(self, layer):
        if not self.is_shared(layer):
            return layer
        return self.layer_types.index(self.layer_types[layer])


def _prefill_err(path, hf, prompt, cfg_change=None, layer_change=None, attention=None, decode=0) -> float:
    """Max |ours - HF| over the prompt's logits, our model's config or layers changed,
    attending through `attention` (a kernel; None: pure JAX); the last `decode` tokens go
    in as one-token decode rows after the prefill of the others."""
    from ferrox_jax.runner import ModelRunner
    from models.loaders.common import build_model
    from models.loaders.safetensors import read_config, read_tensors
    from tests.support.engine_helpers import shuffled_blocks

    cfg = read_config(path)
    model = build_model(cfg_change(cfg) if cfg_change else cfg, read_tensors(path, cfg), decode_attention=attention)
    for layer in model.layers if layer_change else ():
        layer_change(layer)
    runner = ModelRunner(model, num_blocks=fc.NUM_BLOCKS, block_size=fc.BLOCK_SIZE, max_rows=1,
                         max_chunk_tokens=len(prompt), max_context=fc.MAX_CONTEXT)
    blocks, n = shuffled_blocks(20, fc.NUM_BLOCKS, seed=3), len(prompt) - decode
    ours = [runner.run_logits([fc._row(prompt[:n], 0, blocks)])[0]]
    ours += [runner.run_logits([fc._row(prompt[i:i + 1], i, blocks)])[0] for i in range(n, len(prompt))]
    return float(np.abs(np.concatenate(ours) - fc.hf_logits(hf, prompt)).max())


def _zero(name):
    def change(layer):
        getattr(layer, name).set_value(jnp.zeros_like(getattr(layer, name)[...]))
    return change


def _ones(name):
    def change(layer):
        getattr(layer, name).set_value(jnp.ones_like(getattr(layer, name)[...]))
    return change


def test_negative_controls_miss_transformers(gemma4):
    """KV shared from the first layer of a kind (not the last), the per-layer inputs off,
    the full layers' RoPE over the whole head (not proportional), the MoE block off, its
    per-expert scale and the layer scalar left out: each misses HF by far more than the
    tolerance, so the parity above depends on every one of them."""
    path, hf, report = gemma4

    def as_first_of_kind(c):
        return _FirstOfKind(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})

    errs = {
        "kv from the first of its kind": _prefill_err(path, hf, report.prompt, cfg_change=as_first_of_kind),
        "per-layer inputs off": _prefill_err(path, hf, report.prompt, layer_change=_zero("ple_gate")),
        "rope over the whole head": _prefill_err(path, hf, report.prompt,
                                                 cfg_change=lambda c: dataclasses.replace(c, rope_global_partial=1.0)),
        "MoE block off": _prefill_err(path, hf, report.prompt, layer_change=_zero("experts_down")),
        "no per-expert scale": _prefill_err(path, hf, report.prompt, layer_change=_ones("expert_scale")),
        "no layer scalar": _prefill_err(path, hf, report.prompt, layer_change=_ones("layer_scalar")),
    }
    print("gemma4 negative controls, max |Δlogit| vs HF:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(err > WRONG for err in errs.values()), errs


def _hf_dict(**overrides):
    d = gemma4_config().to_dict()
    d.update(overrides)
    return d


@pytest.mark.parametrize("overrides, named", [
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(per_layer_config={"2": {"head_dim": 32, "sliding_window": 4}}), "sliding_window"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}), "yarn"),
    (dict(num_kv_shared_layers=5), "num_kv_shared_layers"),
    (dict(hidden_activation="silu"), "hidden_activation"),
])
def test_refuses_what_it_does_not_run(overrides, named):
    with pytest.raises(UnsupportedModelError, match=named):
        config_from_hf(_hf_dict(**overrides))


def test_multimodal_checkpoint_reads_its_text_model():
    """`Gemma4ForConditionalGeneration`: its text_config, the wrapper's ids where the text
    config lacks them; the hub-style top-level global_head_dim derivation."""
    text = {k: v for k, v in _hf_dict().items() if k not in ("per_layer_config", "architectures")}
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    cfg = config_from_hf({"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
                          "vision_config": {"hidden_size": 32}, "audio_config": None, "eos_token_id": [1, 106]})
    assert cfg.architecture == "Gemma4ForConditionalGeneration"
    assert (cfg.layer_head_dims, cfg.layer_kv_heads) == ((16, 16, 32, 16, 32), (2, 2, 1, 2, 1))


def test_served_end_to_end(gemma4):
    path, hf, _ = gemma4
    fc.assert_served(fc.serve(path), hf, "Gemma4ForCausalLM")


def test_tensor_parallelism_checks_every_layers_kv_heads():
    """The full layers' single kv head cannot split over 2 devices (their cache arrays split
    by kv head): refused naming it; replicated attention leaves it whole."""
    from ferrox_jax.sharding import check_divisibility

    cfg = config_from_hf(_hf_dict())
    with pytest.raises(ValueError, match=r"kv heads \[1\]"):
        check_divisibility(cfg, 2, replicate_attention=False)
    check_divisibility(cfg, 2, replicate_attention=True)
    check_divisibility(config_from_hf(_hf_dict(per_layer_config={"2": {"head_dim": 32, "num_key_value_heads": 2},
                                                                 "4": {"head_dim": 32, "num_key_value_heads": 2}})),
                       2, replicate_attention=False)


def test_multimodal_checkpoint_serves_its_text_model(gemma4, tmp_path):
    """A real `Gemma4ForConditionalGeneration` checkpoint (text model under
    `model.language_model.*`, a vision tower and its embedder beside it, which are not
    read): our prompt logits are the wrapper's on text."""
    from models.loader import load_checkpoint

    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = transformers.Gemma4Config(text_config=gemma4_config(vocab_size=384).to_dict(),
                                       vision_config=vision.to_dict(), audio_config=None)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    path = fc.make_checkpoint(tmp_path / "tiny-gemma4-mm", config)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    cfg = load_checkpoint(str(path)).config
    assert (cfg.architecture, cfg.kv_layout()) == ("Gemma4ForConditionalGeneration",
                                                   ((2, 16, 16), (2, 16, 16), (1, 32, 32)))
    err = _prefill_err(path, hf, gemma4[2].prompt)
    print(f"gemma4 ForConditionalGeneration text: max |Δlogit| vs HF {err:.2e}")
    assert err < fc.ATOL


def test_tensor_parallel_2_matches_one_device(tmp_path):
    """tp=2 on two simulated CPU devices (a subprocess, as tests/system/test_sharding.py),
    the full layers with 2 kv heads so their cache splits too: the same logits as one
    device; heads and the MLP split, the per-layer input weights and experts replicated."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = fc.make_checkpoint(tmp_path / "tiny-gemma4-tp", gemma4_config(num_global_key_value_heads=2))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "XLA_FLAGS": with_devices(2)}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / ".jax_cache"))
    proc = subprocess.run([sys.executable, str(root / "tests" / "support" / "sharding_probe.py"), "family_tp", "2",
                           str(path)], cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    parity, place = got["parity"], got["placement"]
    print("gemma4 tp=2 vs one device:", parity)
    assert parity["prefill_err"] < fc.ATOL and parity["decode_err"] < fc.ATOL and parity["same_greedy"], parity
    shards = {name: place[name]["shard_shapes"] for name in place}
    # layer 0 (sliding): 4 heads x 16 and 2 kv heads over 2 devices; F 64 -> 32 per device
    assert shards["q_proj"] == [[64, 32]] and shards["k_proj"] == [[64, 16]] and shards["gate_proj"] == [[64, 32]]
    assert shards["ple_gate"] == [[64, 8]] and shards["experts_gate_up"] == [[4, 64, 64]]


def test_ragged_kernel_serves_every_layer_kind(gemma4):
    """The ragged GPU kernel (Pallas interpret mode on the CPU), as TPUs and CUDA GPUs run:
    the sliding layers (the shared one reading its source's cache) through it, the full
    layers (another head size) in pure JAX; prefill and two decode rows equal HF's."""
    from models.ragged_gpu import GpuRaggedAttention

    path, hf, report = gemma4
    err = _prefill_err(path, hf, report.prompt, attention=GpuRaggedAttention(interpret=True), decode=2)
    print(f"gemma4 ragged kernel: max |Δlogit| vs HF {err:.2e}")
    assert err < fc.ATOL


def test_gguf_gemma4_files_with_and_without_experts_are_this_family():
    """llama.cpp's `gemma4` files are read (tests/models/test_gguf_gemma4.py), with or without
    experts, as the same model with the same tables."""
    from models.gemma4 import FAMILY
    from models.registry import family_for_gguf

    dense, moe = family_for_gguf("gemma4"), family_for_gguf("gemma4", experts=True)
    assert dense is FAMILY and moe.model is FAMILY.model
    assert moe.gguf_layer_weights is FAMILY.gguf_layer_weights and moe.config_from_gguf is FAMILY.config_from_gguf


@pytest.mark.parametrize("full", [{"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                                  {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6,
                                   "factor": 8.0},
                                  {"rope_type": "default", "rope_theta": 1e6}])
def test_full_layer_rope_tables_are_transformers(full):
    """At the released head size (512): the full layers' cos/sin equal transformers'
    (proportional with its partial factor and scaling factor, or default) over the test's
    positions. The frequencies are float32 powers that may differ by one ulp from torch's
    (as every family's), which is why positions stay small here."""
    from models.gemma4 import Gemma4Model

    params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": full}
    hf_cfg = transformers.Gemma4TextConfig(rope_parameters=params, num_hidden_layers=6)
    rotary = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(hf_cfg)
    positions = torch.arange(0, 128)[None]
    want = rotary(torch.zeros(1, dtype=torch.float32), positions, "full_attention")
    cfg = config_from_hf({**hf_cfg.to_dict(), "architectures": ["Gemma4ForCausalLM"]})
    got = Gemma4Model.rope(type("M", (), {"cfg": cfg})(), jnp.asarray(positions.numpy()), None)["global"]
    for ours, theirs in zip(got, want):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-5)
