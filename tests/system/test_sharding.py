"""Tensor parallelism: sharding rules here, multi-device behaviour in a subprocess.

The pytest process stays single-device. The multi-device cases run
`tests/support/sharding_probe.py` with `XLA_FLAGS=--xla_force_host_platform_device_count=8`
(8 CPU devices) and assert on the JSON it prints: the tiny model (logits, placement, the
kernels under shard_map) and the default model with replicated attention. The sharded
server, the 2-process CPU cluster and quantized weights are tests/system/test_sharding_modes.py
(split so the two halves run on both workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ferrox_jax.config import EngineConfig, parse_mesh
from ferrox_jax.sharding import check_divisibility, kv_partition_spec, param_partition_spec, quantized_partition_specs
from models.config import ModelConfig
from models.quant import QuantizedWeight
from tests.support.xla_flags import with_devices

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "support" / "sharding_probe.py"
ATOL = 1e-4  # float32 both sides; sharding only changes the order of the partial sums
# The Pallas kernel casts K/V pages to bfloat16 in VMEM (paged_attention_kernel.py,
# _maybe_dequantize), so against the float32 pure-JAX path it agrees to bf16 precision:
# relative error 2^-8 ~ 4e-3 on attention outputs, seen as ~3e-3 on these logits.
PALLAS_ATOL = 2e-2



def _probe(*args: str, device_count: int = 8, timeout_s: int = 400) -> dict:
    env = {**os.environ, "XLA_FLAGS": with_devices(device_count)}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
    proc = subprocess.run([sys.executable, str(PROBE), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"probe {args} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cfg(heads=8, kv_heads=8, intermediate=128, vocab=256):
    return ModelConfig(vocab_size=vocab, hidden_size=heads * 8, intermediate_size=intermediate, num_layers=2,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=512)


# ---- rules (no devices needed) --------------------------------------------------------

def test_parse_mesh_reads_both_axes_and_defaults_missing_to_one():
    assert parse_mesh("data=1,model=4") == (1, 4)
    assert parse_mesh("model=8") == (8 // 8, 8)
    assert parse_mesh(" data = 2 , model = 2 ") == (2, 2)


@pytest.mark.parametrize("text", ["model=0", "tensor=2", "model=two", "model=2,model=4", "model"])
def test_parse_mesh_rejects_malformed_text(text):
    with pytest.raises(ValueError, match="mesh"):
        parse_mesh(text)


def test_partition_specs_follow_the_megatron_table():
    cfg = _cfg()
    spec = lambda name, shape, rep=False: param_partition_spec(name, shape, cfg, rep)  # noqa: E731
    assert spec("embed", (256, 64)) == P("model", None)
    assert spec("layers.0.q_proj", (64, 64)) == P(None, "model")
    assert spec("layers.0.k_bias", (64,)) == P("model")
    assert spec("layers.0.o_proj", (64, 64)) == P("model", None)
    assert spec("layers.1.gate_proj", (64, 128)) == P(None, "model")
    assert spec("layers.1.down_proj", (128, 64)) == P("model", None)
    assert spec("lm_head", (64, 256)) == P(None, "model")
    assert spec("layers.0.input_norm", (64,)) == P()
    assert spec("inv_freq", (4,)) == P()
    assert kv_partition_spec() == P("model", None, None, None)


def test_quantized_scales_follow_the_channel_axis_of_their_values():
    cfg = _cfg()

    def specs(name, shape, channel_axis=1, rep=False):
        qw = QuantizedWeight(np.zeros(shape, np.int8), np.zeros(shape[channel_axis], np.float32),
                             channel_axis=channel_axis)
        got = quantized_partition_specs(name, qw, cfg, rep)
        return got.values, got.scales

    assert specs("layers.0.gate_proj", (64, 128)) == (P(None, "model"), P("model"))  # column: scales split
    assert specs("layers.0.down_proj", (128, 64)) == (P("model", None), P(None))  # row: scales whole
    assert specs("layers.0.down_proj", (128, 64), rep=True) == (P(None, "model"), P("model"))
    assert specs("layers.0.q_proj", (64, 64), rep=True) == (P(), P(None))
    assert specs("embed", (256, 64), channel_axis=0) == (P("model", None), P("model"))  # per-row scales


def test_replicate_attention_replicates_attention_weights_and_kv_only():
    cfg = _cfg()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert param_partition_spec(f"layers.0.{name}", (64, 64), cfg, True) == P(), name
    assert param_partition_spec("layers.0.up_proj", (64, 128), cfg, True) == P(None, "model")
    assert param_partition_spec("embed", (256, 64), cfg, True) == P("model", None)
    assert kv_partition_spec(True) == P()


def test_heads_not_dividing_the_model_axis_name_both_numbers():
    with pytest.raises(ValueError, match=r"num_heads 9 \(num_heads 9, num_kv_heads 3\).*--replicate-attention"):
        check_divisibility(_cfg(heads=9, kv_heads=3), 2, replicate_attention=False)


def test_kv_heads_not_dividing_raise_even_when_query_heads_do():
    with pytest.raises(ValueError, match="num_kv_heads 2"):
        check_divisibility(_cfg(heads=8, kv_heads=2), 4, replicate_attention=False)


def test_replicate_attention_accepts_smollm2_head_counts():
    # SmolLM2-135M: 9 heads, 3 KV heads, intermediate 1536 = 8 * 192, vocab 49152 = 8 * 6144.
    check_divisibility(_cfg(heads=9, kv_heads=3, intermediate=1536, vocab=49152), 8, replicate_attention=True)


@pytest.mark.parametrize("field,kwargs", [("intermediate_size 100", dict(intermediate=100)),
                                          ("vocab_size 250", dict(vocab=250))])
def test_mlp_and_vocab_must_divide_even_with_replicated_attention(field, kwargs):
    with pytest.raises(ValueError, match=field):
        check_divisibility(_cfg(**kwargs), 8, replicate_attention=True)


def test_data_axis_above_one_is_refused_with_the_replica_advice():
    with pytest.raises(ValueError, match="data=2 is not supported.*run 2 replicas"):
        EngineConfig(mesh="data=2,model=2")


def test_tensor_parallel_contradicting_mesh_is_refused():
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig(tensor_parallel=2, mesh="model=4")


def test_mesh_overrides_tensor_parallel_shape():
    assert EngineConfig(mesh="model=4").mesh_shape == (1, 4)
    assert EngineConfig(tensor_parallel=2).mesh_shape == (1, 2)
    assert EngineConfig().mesh_shape == (1, 1)


# ---- 8 CPU devices (subprocess) ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return _probe("tiny")


def test_probe_sees_eight_devices(tiny):
    assert tiny["num_devices"] == 8


@pytest.mark.parametrize("tp", ["2", "4", "8"])
def test_tiny_llama_sharded_logits_match_one_device(tiny, tp):
    got = tiny["parity"][tp]
    assert got["prefill_err"] < ATOL, f"tp={tp}: prefill logits differ by {got['prefill_err']}"
    assert got["decode_err"] < ATOL, f"tp={tp}: decode logits differ by {got['decode_err']}"
    assert got["same_greedy"], f"tp={tp}: greedy tokens changed"


def test_weights_and_kv_cache_really_are_sharded(tiny):
    place = tiny["placement_tp4"]
    # tp=4: q_proj [64, 8 heads * 8] -> 64 / 4 = 16 columns (2 heads) per device.
    assert place["q_proj"]["shard_shapes"] == [[64, 16]] and place["q_proj"]["num_shards"] == 4
    assert place["o_proj"]["shard_shapes"] == [[16, 64]]
    assert place["down_proj"]["shard_shapes"] == [[128 // 4, 64]]
    assert place["embed"]["shard_shapes"] == [[256 // 4, 64]]
    assert place["input_norm"]["shard_shapes"] == [[64]], "norms are replicated"
    # KV per layer [8 kv heads, 64 blocks, 8, 8] -> 2 heads per device.
    assert place["kv_k0"]["spec"] == "P('model', None, None, None)"
    assert place["kv_k0"]["shard_shapes"] == [[8 // 4, 64, 8, 8]]


def test_nothing_recompiles_after_warmup_when_sharded(tiny):
    assert tiny["recompiles_after_warmup_tp4"] == 0
    assert tiny["kv_after_workload_tp4"] == tiny["placement_tp4"]["kv_k0"], "KV sharding drifted over the workload"


def test_pallas_kernel_under_shard_map_matches_pure_jax(tiny):
    got = tiny["pallas_parity"]["2"]
    assert got["prefill_err"] < ATOL, "prefill does not use the kernel and must match exactly"
    assert got["decode_err"] < PALLAS_ATOL, f"Pallas decode logits differ by {got['decode_err']}"
    assert got["same_greedy"]


@pytest.mark.parametrize("impl", ["ragged-tpu-interpret", "ragged-gpu-interpret"])
def test_ragged_kernel_under_shard_map_matches_one_device(tiny, impl):
    """Prefill and decode through the ragged kernel on 2 devices, each its own KV heads:
    float32 throughout, so the one-device tolerance holds."""
    got = tiny["ragged_parity"][impl]["2"]
    assert got["prefill_err"] < ATOL and got["decode_err"] < ATOL, f"{impl} under shard_map: {got}"
    assert got["same_greedy"]


def test_ragged_kernel_splits_the_sinks_with_their_kv_heads(tiny):
    """Each device's KV heads take their own query heads' sinks (not device 0's)."""
    assert tiny["ragged_sinks_err"] < ATOL, f"sinks under shard_map differ by {tiny['ragged_sinks_err']}"


def test_ragged_kernel_with_replicated_attention_matches_one_device(tiny):
    got = tiny["ragged_replicated_parity"]["2"]
    assert got["prefill_err"] < ATOL and got["decode_err"] < ATOL, f"replicated KV under shard_map: {got}"
    assert got["same_greedy"]


@pytest.mark.slow
def test_default_model_with_replicated_attention_matches_one_device():
    got = _probe("default")
    assert got["config"] == {"num_heads": 9, "num_kv_heads": 3}
    for tp, errs in got["parity"].items():
        assert errs["prefill_err"] < ATOL, f"tp={tp}: prefill logits differ by {errs['prefill_err']}"
        assert errs["decode_err"] < ATOL, f"tp={tp}: decode logits differ by {errs['decode_err']}"
        assert errs["same_greedy"], f"tp={tp}: greedy tokens changed"
    place = got["placement_tp8"]
    assert place["q_proj"]["shard_shapes"] == [[576, 576]], "attention weights are replicated"
    assert place["kv_k0"]["spec"] == "P()"
    assert place["down_proj"]["shard_shapes"] == [[1536, 576 // 8]], "the MLP is split (down_proj by columns)"
    assert place["embed"]["shard_shapes"] == [[49152 // 8, 576]], "the vocab is split"
