"""FERROX_CPU_ISA (models/cpu_isa.py, models/kernels/cpu_common.h:IsaCap): the cap reaches the
kernels' builds, XLA's flags, the executable store's key and the CLI's refusal of a bad value.

The kernels' library reads the variable once as it loads, so the capped checks run in a fresh
interpreter each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from api import cli
from models import cpu_kernels
from models.cpu_isa import cap_xla, isa_cap

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")

# In a fresh interpreter under the cap: the build each kernel reports, whether K-quant products
# on the default target give the forced AVX2 build's bits (float tile: wide_rows 0; integer rows:
# 1), and whether a fused q/k/v call (Q4_K, Q6_K, Q5_K of one x) gives each weight its own call's
# bits at 1 and 3 rows (on AVX2: the rows quantized once for the three).
PROBE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from models import cpu_kernels
from models.gguf_blocks import block_matmul, block_matmul_many, make_weight, with_kernel
from tests.support.kquant_blocks import random_k_blocks
from tests.models.test_block_matmul import activations
assert cpu_kernels.unavailable_reason() is None
k = 512
x = jnp.asarray(activations(1, k, seed=5))
w = make_weight(random_k_blocks("q4_k", 24, k, seed=4), "q4_k", k)
same = []
for wide in (0, 1):
    auto = np.asarray(jax.jit(block_matmul)(x, with_kernel(w, cpu_kernels.BLOCK_K_TARGET, 0, 0, wide)))
    forced = np.asarray(jax.jit(block_matmul)(x, with_kernel(w, cpu_kernels.BLOCK_K_AVX2_TARGET, 0, 0, wide)))
    same.append(bool((auto == forced).all()))
fused = []
ws = [with_kernel(make_weight(random_k_blocks(f, n, 2048, seed=6 + n), f, 2048), cpu_kernels.BLOCK_K_TARGET, 0, 0, 1)
      for f, n in (("q4_k", 44), ("q6_k", 37), ("q5_k", 9))]
for rows in (1, 3):
    xr = jnp.asarray(activations(rows, 2048, seed=7))
    fused += [bool((np.asarray(got) == np.asarray(block_matmul(xr, wi))).all())
              for got, wi in zip(jax.jit(block_matmul_many)(xr, ws), ws)]
json.dump({"reason": cpu_kernels.unavailable_reason(), "block": cpu_kernels.block_isa(),
           "block_k": cpu_kernels.block_k_isa(), "mxfp4": cpu_kernels.block_mxfp4_isa(),
           "amx": cpu_kernels.block_amx(), "attention": cpu_kernels.attention_isa(), "auto_is_avx2_build": same, "fused_equals_own_calls": fused}, sys.stdout)
"""


def probe(cap: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FERROX_CPU_ISA"}
    if cap is not None:
        env["FERROX_CPU_ISA"] = cap
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_kernels
def test_avx2_cap_runs_every_kernel_on_its_avx2_build():
    got = probe("avx2")
    assert got["reason"] is None
    assert (got["block"], got["block_k"], got["mxfp4"], got["amx"], got["attention"]) == ("AVX2", "AVX2", "AVX2",
                                                                                         False, "AVX2")
    assert got["auto_is_avx2_build"] == [True, True]  # the default target's bits are the AVX2 build's
    assert got["fused_equals_own_calls"] == [True] * 6


@needs_kernels
def test_avx512_cap_keeps_avx512_but_never_the_tiles():
    native, capped = probe(None), probe("avx512")
    assert (capped["block"], capped["block_k"], capped["mxfp4"], capped["attention"]) == (
        native["block"], native["block_k"], native["mxfp4"], native["attention"])
    assert capped["amx"] is False


def test_cap_reaches_xla_flags_once_and_never_overrides_one_given():
    env = {"FERROX_CPU_ISA": "avx2", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert cap_xla(env) == "avx2"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2"
    cap_xla(env)  # a second call (a second engine in one process) adds nothing
    assert env["XLA_FLAGS"].count("xla_cpu_max_isa") == 1
    given = {"FERROX_CPU_ISA": "avx512", "XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2"}
    cap_xla(given)
    assert given["XLA_FLAGS"] == "--xla_cpu_max_isa=SSE4_2"
    for native in ({}, {"FERROX_CPU_ISA": ""}, {"FERROX_CPU_ISA": "native"}):
        assert cap_xla(native) == "native" and "XLA_FLAGS" not in native


@pytest.mark.parametrize("value", ["AVX2", "avx-512", "sse", " avx2"])
def test_a_value_the_kernels_would_not_read_is_refused_by_name(value):
    with pytest.raises(ValueError, match="is not one of native, avx512, avx2"):
        isa_cap({"FERROX_CPU_ISA": value})


def test_cli_refuses_a_bad_cap_before_loading_anything(monkeypatch):
    monkeypatch.setenv("FERROX_CPU_ISA", "avx3")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", "/nonexistent/model.gguf", "--max-tokens", "1", "hi"])
    assert "FERROX_CPU_ISA='avx3' is not one of native, avx512, avx2" in str(exit_info.value)
    assert "Error" not in str(exit_info.value)


def test_the_cap_is_part_of_the_store_key(monkeypatch):
    from ferrox_jax.engine import EngineConfig
    from ferrox_jax.executable_store import program_fingerprint

    config = EngineConfig()
    monkeypatch.delenv("FERROX_CPU_ISA", raising=False)
    native = program_fingerprint(config, None)
    monkeypatch.setenv("FERROX_CPU_ISA", "avx2")
    assert program_fingerprint(config, None) != native
    monkeypatch.delenv("FERROX_CPU_ISA")
    assert program_fingerprint(config, None) == native


@needs_kernels
@pytest.mark.skipif(cpu_kernels.block_isa() == "AVX2", reason="this CPU runs the AVX2 builds already: the files ran as they are")
def test_block_kernel_files_pass_on_the_avx2_builds():
    # the block kernel has no forced AVX2 target: its files run again under the cap, so that an
    # AVX-512 host (CI's) checks the AVX2 float tile, panel and one-row integer path too
    env = {**os.environ, "FERROX_CPU_ISA": "avx2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/models/test_block_matmul.py", "tests/models/test_block_matmul_rowint.py"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "the one-row integer path needs" not in out.stdout  # the AVX2 one-row tests ran
    passed = int(out.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 60, out.stdout[-1500:]
