"""FERROX_CPU_ISA: the most of the CPU's instruction set ferrox may use, for all of its code.

    FERROX_CPU_ISA=avx2 ferrox serve ...     # as an AVX2-only host would run (no AVX-512, VNNI, AMX)
    FERROX_CPU_ISA=avx512 ferrox serve ...   # AVX-512 and VNNI, no AMX tiles
    FERROX_CPU_ISA=native (or unset)         # whatever cpuid offers (the default)

Two things read it, both before they pick an instruction: our kernels' library when it loads
(`models/kernels/cpu_common.h:IsaCap`; each kernel runs the lesser of this and the CPU's
build), and XLA's own code generation, through `--xla_cpu_max_isa` in XLA_FLAGS, which
`cap_xla` adds for `ferrox serve` / `generate` / `run-batch` (through the engine facade) before
the backend starts (other entry points set XLA_FLAGS themselves). What it is for: taking an AVX2-only host's figures on a
host that has more (docs/benchmarks.md, issue 48's AVX2 tables), pinning a fleet of mixed hosts
to one code path, or working around a CPU feature that misbehaves (llama.cpp's AMX buffers
crash on some Xeons; oneDNN's ONEDNN_MAX_CPU_ISA is the same idea). It never adds an
instruction the CPU lacks. The executable store keys its programs by the value
(`ferrox_jax/executable_store.py`).

No jax here. The variable is not a row of api/settings.py's table: the kernels' C library reads it
itself as it loads (before any engine or setting exists), and `requested` / `cap_xla` read the same
value (tests/tools/test_layering.py's ENV_READERS).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ENV = "FERROX_CPU_ISA"
# value -> XLA's --xla_cpu_max_isa (None: no cap)
CAPS = {"native": None, "avx512": "AVX512", "avx2": "AVX2"}
XLA_FLAG = "--xla_cpu_max_isa"


def requested(environ: MutableMapping[str, str] | None = None) -> str:
    """FERROX_CPU_ISA as the kernels' library reads it ("" when unset), unchecked."""
    return (os.environ if environ is None else environ).get(ENV, "")


def isa_cap(environ: MutableMapping[str, str] | None = None) -> str:
    """The cap in force ("native" when unset or empty). Raises ValueError, naming the accepted
    values, for anything else."""
    value = requested(environ) or "native"  # exactly as the kernels' library reads it
    if value not in CAPS:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(CAPS)}; unset it to use "
                         "everything this CPU offers")
    return value


def cap_xla(environ: MutableMapping[str, str] | None = None) -> str:
    """Adds XLA's own cap to XLA_FLAGS (unless XLA_FLAGS already sets one); returns the cap.
    Only takes effect before the CPU backend starts (XLA parses its flags then, not when jax is
    imported). Raises ValueError as `isa_cap` does."""
    environ = os.environ if environ is None else environ
    cap = isa_cap(environ)
    flags = environ.get("XLA_FLAGS", "")
    if CAPS[cap] is not None and XLA_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} {XLA_FLAG}={CAPS[cap]}".strip()
    return cap
