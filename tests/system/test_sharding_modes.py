"""Tensor parallelism served, across processes and quantized (the rules, the tiny model on
8 devices and the default model are tests/system/test_sharding.py; this file is its other
half, so the two run on both workers).

Each case runs `tests/support/sharding_probe.py` in a subprocess (the pytest process stays
single-device): the OpenAI routes served at tensor_parallel=2 answer as on one device; a
2-process local CPU cluster (jax.distributed, gloo collectives) runs the sharded steps;
int8 and w8a8 weights shard like the weights they replace, on 4 CPU devices.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tests.system.test_sharding import ATOL, PROBE, ROOT, _probe
from tests.support.xla_flags import with_devices


def test_sharded_server_answers_openai_routes_like_one_device():
    got = _probe("server")["answers"]
    one, two = got["1"], got["2"]
    assert (two["completion_status"], two["chat_status"]) == (200, 200)
    assert two["devices"] == {"data": 1, "model": 2}
    assert two["completion"] == one["completion"], "greedy completion changed under tensor_parallel=2"
    assert two["chat"] == one["chat"], "greedy chat answer changed under tensor_parallel=2"
    # kv_blocks=128 usable blocks + the null block; 2 KV heads split over 2 devices
    assert two["kv_shard_shapes"] == [[1, 129, 16, 16]], "2 KV heads split over 2 devices"
    assert two["recompiles"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_cpu_cluster_runs_the_sharded_steps():
    """jax.distributed over 2 local processes x 2 CPU devices (gloo): a 4-device mesh."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "XLA_FLAGS": with_devices(2)}
    procs = [subprocess.Popen([sys.executable, str(PROBE), "multihost", coordinator, "2", str(i)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"process failed:\n{stderr[-4000:]}"
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for i, out in enumerate(outs):
        assert (out["process_index"], out["process_count"]) == (i, 2)
        assert (out["num_global_devices"], out["num_local_devices"]) == (4, 2)
        assert out["sum"] == out["expected_sum"], "cross-process reduction"
        assert out["kv_local_shard_shapes"] == [[8 // 4, 64, 8, 8]], "each process holds 2 of 4 KV shards"
        assert out["prefill_err"] < ATOL and out["decode_err"] < ATOL, out


def test_quantized_modes_shard_like_the_weights_they_replace():
    """int8 and w8a8 on 2 and 4 of 4 CPU devices against the same mode on one device."""
    got = _probe("quant", device_count=4)
    assert got["num_devices"] == 4
    for mode, by_tp in got["parity"].items():
        for tp, errs in by_tp.items():
            # w8a8's row-parallel products all-reduce exact int32 partial sums and every
            # rescale sees the same numbers, so only float summation order differs: ATOL.
            assert errs["prefill_err"] < ATOL and errs["decode_err"] < ATOL, f"{mode} tp={tp}: {errs}"
            assert errs["same_greedy"], f"{mode} tp={tp}: greedy tokens changed"
    place = got["placement_tp4"]
    # tiny model, tp=4: q_proj [64, 64] column-split -> values [64, 16], scales [16];
    # o_proj row-split -> values [16, 64], scales replicated [64]; embed [256, 64] rows split.
    assert place["q_proj"]["values"]["shard_shapes"] == [[64, 16]] and place["q_proj"]["scales"]["shard_shapes"] == [[16]]
    assert place["o_proj"]["values"]["shard_shapes"] == [[16, 64]] and place["o_proj"]["scales"]["shard_shapes"] == [[64]]
    assert place["embed"]["values"]["shard_shapes"] == [[64, 64]] and place["embed"]["scales"]["shard_shapes"] == [[64]]
    assert got["kv_dtype"] == "bfloat16" and place["kv_k0"]["shard_shapes"] == [[2, 64, 8, 8]]
    assert got["kv_storage_dtype"] == "uint16", "a CPU bfloat16 cache holds its words as uint16 (scattered in place)"
    assert got["recompiles_after_warmup_tp4"] == 0
