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

XLA CPU's fusion emitters (the MLIR-based ones that replaced the element-wise IR emitter)
cost more compile time than they give back on tiny shapes, so the suite also passes
`--xla_cpu_use_fusion_emitters=false`. Process CPU seconds with an empty compile cache,
emitters on -> off (load 2-6, alternated, 2026-12-06): tests/engine/test_runner.py 35.7 ->
22.6 and 37.3 -> 27.1, tests/models/test_ragged_engine.py 73.8 -> 46.3, test_sliding_kv_all.py
77.9 -> 49.9, test_gguf_mtp.py 90.4 -> 57.6, test_quant.py 74.5 -> 50.8,
test_family_gemma4.py 80.4 -> 58.8, test_family_llama4.py 53.7 -> 44.8, tests/system/
test_multihost.py 196.9 -> 152.6, test_api_cli.py 67.8 -> 47.0, test_sharding.py 117.3 ->
109.2 (user seconds; 1,038 -> 827 over these twelve files, -20 %); the files that run many
steps of the 30-layer default model pay a little back (test_default_model.py 99.2 -> 104.6,
test_speculative_default_model.py 70.3 -> 82.3). A server's first start is the opposite:
at XLA's default level the 1B's 23 shapes took 58 CPU seconds with the emitters on and over
127 with them off, so production keeps XLA's defaults. Same tests green either way:
the graph passes are XLA's own in both, only the loops' code generation differs.
`XLA_FLAGS` naming either flag keeps its own value.

A test that starts a process with its own device count passes `with_devices(n)` as that
process's XLA_FLAGS, so the process compiles as the suite does (and a group of processes
sharing compiled programs all alike).
"""

from __future__ import annotations

import os
from pathlib import Path

LEVEL_FLAG = "--xla_backend_optimization_level"
SUITE_LEVEL = f"{LEVEL_FLAG}=0"
EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"
SUITE_EMITTERS = f"{EMITTERS_FLAG}=false"
# What the suite adds, each unless XLA_FLAGS names that flag already.
SUITE_FLAGS = (SUITE_LEVEL, SUITE_EMITTERS)


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def _on_accelerator() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and platforms != "cpu":
        return True
    return any(Path(dev).exists() for dev in ("/dev/nvidia0", "/dev/accel0", "/dev/kfd"))


def suite_flags(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) with each of the suite's CPU flags added that it does not
    name already; unchanged where the suite runs on an accelerator."""
    if _on_accelerator():
        return flags
    named = {_name(f) for f in flags.split()}
    return " ".join([*flags.split(), *(f for f in SUITE_FLAGS if _name(f) not in named)])


def level_flags() -> str:
    """The suite's flags as this process has them, as XLA_FLAGS text ("" for XLA's defaults)."""
    names = {_name(f) for f in SUITE_FLAGS}
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if _name(f) in names)


def with_devices(n: int) -> str:
    """XLA_FLAGS for a process the suite starts with `n` simulated CPU devices."""
    return f"{level_flags()} --xla_force_host_platform_device_count={n}".strip()
