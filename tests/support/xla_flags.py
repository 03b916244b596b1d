"""The XLA flags the suite compiles under, in pytest and in every process it starts.

The suite's time on CPU is mostly XLA compiling small programs, and most of a compile is
LLVM optimizing the fused loops of the generated code. The programs run a few steps on
tiny shapes, so `--xla_backend_optimization_level=0` (LLVM without its optimization
passes) pays. Process CPU time with an empty compile cache, level 3 -> 0 (a host at
load 15-27): the expert-parallel probe 138 -> 100 s, the families tensor-parallel probe 226 -> 152 s,
tests/engine/test_runner.py 59 -> 42 s, test_engine_batching.py 62 -> 45 s; the default
model's first compile 11.5 -> 8.1 s while its 40 decode steps ran a third longer
(1.5 -> 2.0 s), the same tokens. XLA's own graph passes (fusion, layout, SPMD
partitioning) are unchanged, so the programs compute the same thing (logits within
~1e-6; no fast-math either way). Production keeps XLA's default level.

Only where XLA compiles for the CPU: on an accelerator the level would also leave its
kernels unoptimized. `XLA_FLAGS` naming a level of its own keeps it
(`XLA_FLAGS=--xla_backend_optimization_level=3 make test` runs the suite at XLA's default).

A test that starts a process with its own device count passes `with_devices(n)` as that
process's XLA_FLAGS, so the process compiles as the suite does (and a group of processes
sharing compiled programs all alike).
"""

from __future__ import annotations

import os
from pathlib import Path

LEVEL_FLAG = "--xla_backend_optimization_level"
SUITE_LEVEL = f"{LEVEL_FLAG}=0"


def _on_accelerator() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and platforms != "cpu":
        return True
    return any(Path(dev).exists() for dev in ("/dev/nvidia0", "/dev/accel0", "/dev/kfd"))


def suite_flags(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) with the suite's optimization level added, unless it
    names a level already or the suite runs on an accelerator."""
    if LEVEL_FLAG in flags or _on_accelerator():
        return flags
    return f"{flags} {SUITE_LEVEL}".strip()


def level_flags() -> str:
    """The optimization level this process compiles at, as XLA_FLAGS text ("" for XLA's default)."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(LEVEL_FLAG))


def with_devices(n: int) -> str:
    """XLA_FLAGS for a process the suite starts with `n` simulated CPU devices."""
    return f"{level_flags()} --xla_force_host_platform_device_count={n}".strip()
