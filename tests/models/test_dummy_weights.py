"""Synthetic weights (`--load-format dummy`, models/loaders/dummy.py): determinism, scale,
the fallback tokenizer, sharded generation, and memory sizing without allocation.

No api/ import here: the device check runs this file on the accelerator. The served
end to end test (a real `ferrox serve` on a config-only folder) is tests/system/test_dummy_server.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferrox_jax.config import LOAD_FORMAT_NAMES, EngineConfig
from ferrox_jax.engine import Engine
from ferrox_jax.engine_builder import plan_memory
from ferrox_jax.plan import RowPlan
from ferrox_jax.runner import ModelRunner
from models.loader import LOAD_FORMATS, open_checkpoint
from models.loaders.dummy import byte_fallback_tokenizer, init_std
from models.known_shapes import SHAPES, write_config_folder
from tests.support.xla_flags import with_devices

REPO = Path(__file__).resolve().parents[2]


def config_folder(tmp_path: Path, **overrides) -> Path:
    """A config-only HF folder: the tiny shape of models/known_shapes.py with `overrides`."""
    folder = tmp_path / "cfg-only"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**SHAPES["tiny"], **overrides}))
    return folder


def flat_arrays(model) -> dict[str, np.ndarray]:
    from flax import nnx

    return {".".join(map(str, path)): np.asarray(v.get_value().astype(jnp.float32))
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_same_seed_same_weights_another_seed_other_weights(tmp_path):
    folder = str(config_folder(tmp_path))
    a, b = (flat_arrays(open_checkpoint(folder, load_format="dummy", seed=3).build(jnp.float32)) for _ in range(2))
    c = flat_arrays(open_checkpoint(folder, load_format="dummy", seed=4).build(jnp.float32))
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a), "two loads with one seed must give identical weights"
    cfg = _cfg(folder)
    random = [k for k in a if init_std(k, a[k].shape, cfg) is not None]  # norms and biases aside
    assert random and all(not np.array_equal(a[k], c[k]) for k in random), "another seed, other weights"


def _cfg(folder: str):
    return open_checkpoint(folder, load_format="dummy").config


def test_weights_are_made_on_the_device_in_the_target_dtype(tmp_path):
    source = open_checkpoint(str(config_folder(tmp_path)), load_format="dummy")
    assert source.is_synthetic and not source.tensors, "nothing is read from disk"
    model = source.build(jnp.bfloat16)
    arrays = jax.tree.leaves(model)
    params = [a for a in arrays if a.ndim == 2]
    assert params and all(a.dtype == jnp.bfloat16 for a in params)
    assert all(a.devices() == {jax.devices()[0]} for a in arrays), "made on the default device"


def test_init_scale_follows_fan_in_and_the_residual_depth():
    from models.registry import config_from_hf

    cfg = config_from_hf(SHAPES["llama-3.1-8b"])  # D 4096, H*hd 4096, KV 1024, F 14336, V 128256, L 32
    assert init_std("layers.0.q_proj", (4096, 4096), cfg) == 4096**-0.5
    assert init_std("embed", (128256, 4096), cfg) == init_std("lm_head", (4096, 128256), cfg) == 4096**-0.5
    # residual branches: fan-in^-1/2 / sqrt(2 * 32 layers) = / 8
    assert init_std("layers.5.o_proj", (4096, 4096), cfg) == pytest.approx(4096**-0.5 / 8)
    assert init_std("layers.5.down_proj", (14336, 4096), cfg) == pytest.approx(14336**-0.5 / 8)
    assert init_std("layers.5.input_norm", (4096,), cfg) is None and init_std("final_norm", (4096,), cfg) is None


def test_deep_narrow_bf16_model_keeps_finite_unit_scale_logits(tmp_path):
    """32 layers at hidden 64 in bf16 (one prefill: a decode step runs the same layers).
    With the residual branches scaled by 1/sqrt(2L) the stream's variance stays O(1) at any
    depth; the final norm makes the hidden unit-RMS and the LM head's std D^-1/2 makes each
    logit a sum of D terms of variance 1/D: unit variance. So the logits' std must be O(1)
    (asserted within [0.3, 3]) and finite."""
    folder = str(config_folder(tmp_path, num_hidden_layers=32))
    model = open_checkpoint(folder, load_format="dummy").build(jnp.bfloat16)
    runner = ModelRunner(model, num_blocks=8, block_size=16, max_rows=1, max_chunk_tokens=32, max_context=64)
    prompt = tuple(np.random.RandomState(0).randint(0, 512, 32).tolist())
    logits = runner.run_logits([RowPlan(0, prompt, 0, (3, 1), False)])[0]
    assert np.isfinite(logits).all(), "NaN or inf logits through 32 bf16 layers"
    std = float(logits.std())
    assert 0.3 < std < 3.0, f"logit std {std:.3f}: activations drifted from unit scale through the depth"


def test_byte_fallback_tokenizer_round_trips_bytes_and_names_every_other_id(tmp_path):
    cfg = _cfg(str(config_folder(tmp_path)))  # vocab 512, eos 300
    tok = byte_fallback_tokenizer(cfg)
    text = "Hello, café 東京 😀"
    ids = tok.encode(text)
    assert ids == list(text.encode()), "one id per byte, the byte's value"
    assert tok.decode(ids) == text
    assert tok.decode([72, 400, 105]) == "H<|tok_400|>i", "ids past 255 decode as their names"
    assert tok.stop_token_ids == frozenset({300}) and tok.decode([72, 300]) == "H", "eos stops and is special"
    assert tok.vocab_size == 512


def test_byte_fallback_needs_an_id_per_byte(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 200 < 256"):
        byte_fallback_tokenizer(_cfg(str(config_folder(tmp_path, vocab_size=200))))


def test_a_tokenizer_json_beside_the_config_is_used(tmp_path):
    from tests.support.tiny_model import make_tokenizer_files

    folder = config_folder(tmp_path)
    vocab = make_tokenizer_files(folder, vocab_size=384)
    source = open_checkpoint(str(folder), load_format="dummy")
    assert source.tokenizer.vocab_size == vocab and source.tokenizer.token_to_id("<|im_end|>") is not None


def test_load_format_names_agree_and_unknown_ones_are_refused(tmp_path):
    assert LOAD_FORMAT_NAMES == LOAD_FORMATS
    with pytest.raises(ValueError, match="EngineConfig.load_format must be one of auto, dummy; got 'random'"):
        EngineConfig(load_format="random")
    with pytest.raises(ValueError, match="load_format must be one of"):
        open_checkpoint(str(config_folder(tmp_path)), load_format="random")


@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_plan_memory_equals_what_the_loaded_engine_holds(tmp_path, quantization):
    config = EngineConfig(model=str(config_folder(tmp_path)), load_format="dummy", dtype="bfloat16",
                          quantization=quantization, block_size=16, kv_blocks=40, max_context=128, max_seqs=2,
                          prefill_chunk=16)
    plan = plan_memory(config)
    engine = Engine.load(config)
    info = engine.describe()
    assert info["synthetic_weights"] and engine.model_card.synthetic_weights
    assert plan.weights_bytes == engine.weights_bytes == info["weights_bytes"]
    # 40 usable blocks + the null block x 16 positions x (2 x 2 layers x 2 kv heads x 16 head_dim x 2 bytes)
    assert plan.kv_bytes == info["kv_bytes"] == 41 * 16 * 2 * 2 * 2 * 16 * 2


def test_plan_memory_of_llama_3_1_8b_matches_the_parameter_arithmetic(tmp_path):
    """The figures docs/deploy-tpu.md sizes with, from abstract shapes (nothing allocated)."""
    folder = write_config_folder("llama-3.1-8b", tmp_path / "llama8b")
    plan = plan_memory(EngineConfig(model=str(folder), load_format="dummy", dtype="bfloat16", kv_memory_gib=1.0))
    d, f, v, layers, q, kv = 4096, 14336, 128256, 32, 32 * 128, 8 * 128
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d  # q, k, v, o, gate/up/down, 2 norms
    params = 2 * v * d + layers * per_layer + d  # embed, lm_head, layers, final norm
    assert params == 8_030_261_248
    assert plan.weights_bytes == 2 * params, "bf16 parameters (the rope table is a constant of the step, not an array)"
    # 1 GiB / (16 positions x 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 2 MiB per block) = 512 blocks
    assert plan.sizing.num_blocks == 512 and plan.kv_bytes == 2**30
    # int8: every matrix 1 B per weight plus an f32 scale per output channel (the
    # embedding's per row), the norms still bf16.
    int8 = plan_memory(EngineConfig(model=str(folder), load_format="dummy", dtype="bfloat16", quantization="int8",
                                    kv_memory_gib=1.0))
    matrices = 2 * v * d + layers * (d * q + 2 * d * kv + q * d + 3 * d * f)
    scales = 2 * v + layers * (q + 2 * kv + d + 2 * f + d)
    norms = layers * 2 * d + d
    assert int8.weights_bytes == matrices + 4 * scales + 2 * norms == 8_037_058_560


_SHARDED_PROBE = """
import json, sys
import numpy as np, jax
from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
def load(tp):
    e = Engine.load(EngineConfig(model=sys.argv[1], load_format="dummy", dtype="float32", tensor_parallel=tp,
                                 kv_blocks=8, max_context=64, max_seqs=1, prefill_chunk=16))
    return e.runner.state
one, four = load(1), load(4)
q1, q4 = one["layers"][0]["q_proj"].get_value(), four["layers"][0]["q_proj"].get_value()
print(json.dumps({"equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                               zip(jax.tree.leaves(one), jax.tree.leaves(four))),
                  "shards": sorted({tuple(s.data.shape) for s in q4.addressable_shards}),
                  "devices": len(q4.addressable_shards), "whole": list(q1.shape)}))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="host devices: CI covers it; an accelerator adds nothing")
def test_sharded_dummy_weights_are_made_per_shard_and_equal_the_unsharded_ones(tmp_path):
    """On 4 (host) devices each device makes its own quarter of q_proj, and the values do
    not depend on the sharding (threefry is partitionable)."""
    env = {**os.environ, "XLA_FLAGS": with_devices(4), "JAX_PLATFORMS": "cpu"}
    folder = config_folder(tmp_path, num_key_value_heads=4)  # 4 heads, 4 KV heads: tp 4 splits whole heads
    out = subprocess.run([sys.executable, "-c", _SHARDED_PROBE, str(folder)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["equal"], "tensor-parallel dummy weights differ from the single-device ones"
    assert got["whole"] == [64, 64] and got["devices"] == 4 and got["shards"] == [[64, 16]], got
