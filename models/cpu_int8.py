"""The w8a8 projection on x86 CPUs: our AVX2 kernel (`models/kernels/int8_matmul.cc`)
behind an XLA FFI custom call, and the pass that lays the weights out for it.

Why: XLA CPU's int8 x int8 -> int32 dot has no kernel of its own for AVX2 machines
without VNNI. Side by side on a 2-core AMD EPYC (median of 50, one product, the
default model's shapes; tools/bench_int8_kernel.py prints the table):

    rows  [K, N]        XLA int8 dot   this kernel
    1     576 x 1536      ~230 us        ~53 us   (17 GB/s of weights: memory speed)
    1     576 x 49152    ~2800 us      ~1350 us   (the LM head)
    32    576 x 1536      ~550 us       ~300 us
    512   576 x 1536     ~5900 us      ~4500 us   (a prefill chunk)

The kernel wants each output channel's weights contiguous, `int8[out, in]`, which is the
transpose of the `[in, out]` layout every loader and sharding rule uses. So the engine
builds the model as usual and then, on one CPU device with `--quantization w8a8`, runs
`pack_for_kernel`: each projection whose input size is a multiple of 32 becomes
`QuantizedWeight(values.T, scales, "w8a8", channel_axis=0, kernel=TARGET)` (the same
bytes, transposed once at load), and `quantized_matmul` calls the custom call it names. A weight with
another input size, a sharded model (tensor parallelism: the custom call has no
partitioning rule) and any other backend keep XLA's dot.

The kernel quantizes the activations per row as `quantize_rows` does and multiplies the
int32 sums back in the same order, so the two paths agree to float rounding (an
activation exactly halfway between two int8 steps may round the other way: one step of
that row, tests/test_cpu_int8.py bounds it).

Build: `make` does it (`python -m models.cpu_int8`: one `c++` command against the FFI
headers jaxlib ships). Without a compiler, or on a CPU without AVX2, w8a8 runs on XLA's
dot and the start-up log says why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
from flax import nnx

from models.quant import QuantizedWeight

SOURCE = Path(__file__).parent / "kernels" / "int8_matmul.cc"
LIBRARY = SOURCE.with_name("_int8_matmul.so")
TARGET = "ferrox_int8_matmul"
LANE = 32  # the kernel's input sizes are multiples of one AVX2 register of int8
BUILD_HINT = f"{sys.executable} -m models.cpu_int8"


def build(cxx: str | None = None) -> Path:
    """Compile the kernel into LIBRARY (raises CalledProcessError with the compiler's output)."""
    cxx = cxx or os.environ.get("CXX", "c++")
    tmp = LIBRARY.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type",
           f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    tmp.replace(LIBRARY)
    return LIBRARY


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is registered with XLA (first call); else why it cannot be."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is for x86-64 CPUs; this is {platform.machine()}"
    if not LIBRARY.exists():
        return f"the kernel is not built (run `{BUILD_HINT}`, which `make` does)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
    except OSError as e:
        return f"the kernel did not load ({e}); rebuild it with `{BUILD_HINT}`"
    if not lib.ferrox_int8_matmul_supported():
        return "this CPU has no AVX2"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.FerroxInt8Matmul), platform="cpu")
    return None


def packable(qw: object) -> bool:
    """A w8a8 projection [in, out] the kernel can take (in a multiple of LANE)."""
    return (isinstance(qw, QuantizedWeight) and qw.mode == "w8a8" and qw.channel_axis == 1
            and len(qw.shape) == 2 and qw.shape[0] % LANE == 0)


def pack(qw: QuantizedWeight) -> QuantizedWeight:
    """[in, out] -> the kernel's [out, in] (same values and scales, transposed). Raises
    RuntimeError where the kernel cannot run (`unavailable_reason`)."""
    if (reason := unavailable_reason()) is not None:
        raise RuntimeError(f"the int8 CPU kernel is unavailable: {reason}")
    return QuantizedWeight(qw.values.T, qw.scales, qw.mode, channel_axis=0, kernel=TARGET)


def pack_for_kernel(model: nnx.Module) -> int:
    """Lays every packable projection of `model` out for the kernel, in place; returns how
    many. Raises RuntimeError where the kernel cannot run (`unavailable_reason`)."""
    state = nnx.state(model)
    packed = 0

    def one(leaf):
        nonlocal packed
        if packable(leaf):
            packed += 1
            return pack(leaf)
        return leaf

    nnx.update(model, jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, QuantizedWeight)))
    return packed


def main() -> None:
    try:
        path = build()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        print(f"models.cpu_int8: the int8 CPU kernel did not build; w8a8 will use XLA's dot.\n{detail}",
              file=sys.stderr)
        raise SystemExit(1) from None
    print(f"built {path}")


if __name__ == "__main__":
    main()
