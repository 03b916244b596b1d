"""The suite's XLA flags (tests/support/xla_flags.py): pytest compiles with LLVM's
optimizations and XLA CPU's fusion emitters off on CPU, the processes the tests start with a
device count of their own compile the same way, a flag given explicitly is kept, and an
accelerator is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import xla_flags
from tests.support.xla_flags import SUITE_EMITTERS, SUITE_FLAGS, SUITE_LEVEL, suite_flags, with_devices

REPO = Path(__file__).resolve().parents[2]
ON_CPU = not xla_flags._on_accelerator()


@pytest.mark.skipif(not ON_CPU, reason="an accelerator keeps XLA's default level")
def test_this_process_compiles_with_the_suite_flags():
    for flag in SUITE_FLAGS:
        assert flag in os.environ.get("XLA_FLAGS", "").split(), os.environ.get("XLA_FLAGS")


def test_the_flags_are_added_once_and_explicit_ones_are_kept(monkeypatch):
    monkeypatch.setattr(xla_flags, "_on_accelerator", lambda: False)
    both = f"{SUITE_LEVEL} {SUITE_EMITTERS}"
    assert suite_flags("") == both
    assert suite_flags("--xla_force_host_platform_device_count=2") == (
        f"--xla_force_host_platform_device_count=2 {both}")
    assert suite_flags(suite_flags("")) == both, "conftest runs in every xdist worker too"
    assert suite_flags("--xla_backend_optimization_level=3") == (
        f"--xla_backend_optimization_level=3 {SUITE_EMITTERS}")
    assert suite_flags("--xla_cpu_use_fusion_emitters=true") == (
        f"--xla_cpu_use_fusion_emitters=true {SUITE_LEVEL}")


def test_an_accelerator_keeps_xlas_default(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert xla_flags._on_accelerator()
    assert suite_flags("") == "", "on an accelerator the level would leave its kernels unoptimized"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(xla_flags.Path, "exists", lambda self: False)
    assert not xla_flags._on_accelerator()


def test_with_devices_carries_this_processs_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/nowhere {SUITE_LEVEL} {SUITE_EMITTERS}")
    assert with_devices(4) == f"{SUITE_LEVEL} {SUITE_EMITTERS} --xla_force_host_platform_device_count=4"
    monkeypatch.setenv("XLA_FLAGS", "")
    assert with_devices(1) == "--xla_force_host_platform_device_count=1", "XLA's default stays the default"


def test_a_started_process_sees_its_devices_and_the_level():
    """What the probes' callers pass (test_sharding.py, test_expert_parallel.py, the multihost
    cluster...): the subprocess has the device count and compiles at this process's level."""
    code = "import json, os, jax; print(json.dumps([len(jax.devices()), os.environ['XLA_FLAGS']]))"
    env = {**os.environ, "XLA_FLAGS": with_devices(2), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    devices, flags = json.loads(proc.stdout.strip().splitlines()[-1])
    assert devices == 2
    for flag in SUITE_FLAGS:
        assert (flag in flags.split()) == (flag in os.environ.get("XLA_FLAGS", "").split()), flags
