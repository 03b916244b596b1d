"""ferrox's x86 CPU kernels (AVX2, `models/kernels/`) behind XLA FFI custom calls: the
w8a8 projection and the one-query decode attention, the pass that lays the weights out
for the first, and the attention object the model calls for the second.

Why: on an AVX2 machine without VNNI, XLA CPU's int8 x int8 -> int32 dot has no kernel
of its own and its paged attention gathers and transposes every block it reads. Side by
side on a 2-core AMD EPYC (`python -m tools.bench.bench_cpu_kernels` prints these tables):

    w8a8 product, rows x [K, N]   XLA int8 dot   int8_matmul.cc
    1 x [576, 1536]                  ~230 us        ~53 us   (17 GB/s of weights)
    1 x [576, 49152] (LM head)      ~2800 us      ~1350 us
    32 x [576, 1536]                 ~550 us       ~300 us
    512 x [576, 1536] (prefill)     ~5900 us      ~4500 us

The matmul wants each output channel's weights contiguous, `int8[out, in]`, the transpose
of the `[in, out]` layout every loader and sharding rule uses. So the engine builds the
model as usual and then, on one CPU device with `--quantization w8a8`, runs
`pack_for_kernel`: each projection whose input size is a multiple of 32 becomes
`QuantizedWeight(values.T, scales, "w8a8", channel_axis=0, kernel=MATMUL_TARGET)` (the same
bytes, transposed once at load), and `quantized_matmul` calls the custom call it names.
The kernel quantizes the activations per row exactly as `quantize_rows` does and
multiplies the int32 sums back in the same order: its products equal XLA's bit for bit
(tests/models/test_cpu_kernels.py).

The decode attention (`models/cpu_attention.py:CpuDecodeAttention`, chosen by
`--attention-impl auto|cpu` on a CPU backend) reads each key and value once through the block table, f32 or bfloat16
(u16) caches alike, with an AVX2 exp; it serves one-query steps of layers without a
sliding window, soft-capping or attention sinks, as the Pallas TPU kernel does (the
others fall back to pure JAX: `models/layers.py` chooses per layer).

GGUF blocks kept as shipped (`--quantization gguf`, `models/gguf_blocks.py`) run on three
block kernels, one per family of formats (`block_target`): Q4_0 / Q4_1 / Q8_0
(block_matmul.cc), the K-quants (block_matmul_k.cc) and MXFP4, gpt-oss's experts
(block_matmul_mxfp4.cc); `pack_blocks_for_kernel` points each weight at its own.

A sharded model (the custom calls have no partitioning rule), any other backend, and a
weight or head size the kernels cannot take keep XLA. Build: `make` does it (`python -m
models.cpu_kernels`: one `c++` command against the FFI headers jaxlib ships). Without a
compiler, or on a CPU without AVX2, everything runs on XLA and the start-up log says why.
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
import jax.numpy as jnp
from flax import nnx

from models.cpu_isa import isa_cap
from models.gguf_blocks import K_FORMATS, MULTI_TARGETS, BlockQuantizedWeight, with_kernel
from models.quant import QuantizedWeight

KERNELS = Path(__file__).parent / "kernels"
SOURCES = (KERNELS / "int8_matmul.cc", KERNELS / "decode_attention.cc", KERNELS / "block_matmul.cc",
           KERNELS / "block_matmul_k.cc", KERNELS / "block_matmul_mxfp4.cc", KERNELS / "sample_rows.cc")
LIBRARY = KERNELS / "_ferrox_cpu.so"
MATMUL_TARGET = "ferrox_int8_matmul"
ATTENTION_TARGET = "ferrox_decode_attention"
ATTENTION_AVX2_TARGET = "ferrox_decode_attention_avx2"  # the same, its AVX2 build forced (tests)
BLOCK_TARGET = "ferrox_block_matmul"
BLOCK_K_TARGET = "ferrox_block_matmul_k"  # the K-quants (block_matmul_k.cc)
BLOCK_MULTI_TARGET = MULTI_TARGETS[BLOCK_TARGET]  # 2-3 weights of the same x in one call
BLOCK_K_MULTI_TARGET = MULTI_TARGETS[BLOCK_K_TARGET]  # 2-3 K-quant weights of the same x in one call
BLOCK_K_AVX2_TARGET = "ferrox_block_matmul_k_avx2"  # the same, its AVX2 build forced (tests)
BLOCK_MXFP4_TARGET = "ferrox_block_matmul_mxfp4"  # MXFP4 (block_matmul_mxfp4.cc)
BLOCK_MXFP4_AVX2_TARGET = "ferrox_block_matmul_mxfp4_avx2"  # the same, its AVX2 build forced (tests)
SAMPLE_TARGET = "ferrox_sample_rows"  # the sampler's passes over the vocabulary (sample_rows.cc)
LANE = 32  # the matmul's input sizes are multiples of one AVX2 register of int8
BUILD_HINT = f"{sys.executable} -m models.cpu_kernels"


def build(cxx: str | None = None) -> Path:
    """Compile the kernels into LIBRARY (raises CalledProcessError with the compiler's output)."""
    cxx = cxx or os.environ.get("CXX", "c++")
    tmp = LIBRARY.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type",
           f"-I{jax.ffi.include_dir()}", f"-I{KERNELS}", *map(str, SOURCES), "-o", str(tmp)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    tmp.replace(LIBRARY)
    return LIBRARY


BLOCK_ISAS = {2: "AVX-512 VNNI", 1: "AVX2"}  # ferrox_block_isa()'s answers
BLOCK_K_ISAS = {2: "AVX-512", 1: "AVX2"}  # ferrox_block_k_isa()'s answers
_ISA: dict[str, str] = {}  # "block", "block_k": the build cpuid chose (set on registration)


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernels are registered with XLA (first call); else why they cannot be."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are for x86-64 CPUs; this is {platform.machine()}"
    try:
        isa_cap()  # the library reads it as it loads
    except ValueError as e:
        return str(e)
    if not LIBRARY.exists():
        return f"the kernels are not built (run `{BUILD_HINT}`, which `make` does)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
    except OSError as e:
        return f"the kernels did not load ({e}); rebuild them with `{BUILD_HINT}`"
    if not lib.ferrox_cpu_kernels_supported():
        return "this CPU has no AVX2"
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.FerroxInt8Matmul), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.FerroxDecodeAttention), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_AVX2_TARGET, jax.ffi.pycapsule(lib.FerroxDecodeAttentionAvx2),
                                platform="cpu")
    _ISA["attention"] = BLOCK_K_ISAS.get(lib.ferrox_decode_attention_isa(), "none")
    jax.ffi.register_ffi_target(BLOCK_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmul), platform="cpu")
    jax.ffi.register_ffi_target(BLOCK_MULTI_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmulMulti), platform="cpu")
    _ISA["block"] = BLOCK_ISAS.get(lib.ferrox_block_isa(), "none")
    jax.ffi.register_ffi_target(BLOCK_K_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmulK), platform="cpu")
    jax.ffi.register_ffi_target(BLOCK_K_MULTI_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmulKMulti), platform="cpu")
    jax.ffi.register_ffi_target(BLOCK_K_AVX2_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmulKAvx2), platform="cpu")
    _ISA["block_k"] = BLOCK_K_ISAS.get(lib.ferrox_block_k_isa(), "none")
    _ISA["block_amx"] = "AMX-BF16" if lib.ferrox_block_amx() else "none"
    jax.ffi.register_ffi_target(BLOCK_MXFP4_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmulMxfp4), platform="cpu")
    jax.ffi.register_ffi_target(BLOCK_MXFP4_AVX2_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmulMxfp4Avx2),
                                platform="cpu")
    _ISA["block_mxfp4"] = BLOCK_K_ISAS.get(lib.ferrox_block_mxfp4_isa(), "none")
    jax.ffi.register_ffi_target(SAMPLE_TARGET, jax.ffi.pycapsule(lib.FerroxSampleRows), platform="cpu")
    return None


def runtime_problems(backend: str, mesh=None) -> list[str]:
    """Why the kernels cannot serve a model on `backend` (sharded over `mesh`): [] when
    they can (registering them on the first call)."""
    if backend != "cpu":
        return [f"backend {backend} is not a CPU"]
    if mesh is not None:
        return ["tensor parallelism (the kernels have no partitioning rule)"]
    reason = unavailable_reason()
    return [] if reason is None else [reason]


def require() -> None:
    """Raise RuntimeError (with the reason) where the kernels cannot run."""
    if (reason := unavailable_reason()) is not None:
        raise RuntimeError(f"ferrox's CPU kernels are unavailable: {reason}")


# ---- the w8a8 matmul --------------------------------------------------------------------------

def packable(qw: object) -> bool:
    """A w8a8 projection [in, out] the matmul can take (in a multiple of LANE)."""
    return (isinstance(qw, QuantizedWeight) and qw.mode == "w8a8" and qw.channel_axis == 1
            and len(qw.shape) == 2 and qw.shape[0] % LANE == 0)


def pack(qw: QuantizedWeight) -> QuantizedWeight:
    """[in, out] -> the matmul's [out, in] (same values and scales, transposed). Raises
    RuntimeError where the kernels cannot run (`unavailable_reason`)."""
    require()
    return QuantizedWeight(qw.values.T, qw.scales, qw.mode, channel_axis=0, kernel=MATMUL_TARGET)


def pack_for_kernel(model: nnx.Module) -> int:
    """Lays every packable projection of `model` out for the matmul, in place; returns how
    many. Raises RuntimeError where the kernels cannot run (`unavailable_reason`)."""
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


# ---- the GGUF block matmul ---------------------------------------------------------------------

# Rows from which a block product quantizes its activations (32-wide int8 blocks, integer
# dots) instead of multiplying float32 activations by the dequantized blocks, by the ISA
# the kernel runs; 0: never. Measured with `python -m tools.bench.bench_cpu_kernels --only blocks`
# and `tools/parity/compare_logits.py` (docs/benchmarks.md, "GGUF blocks on the CPU"): on AVX-512
# (Zen 4) the float path, whose Q4 dequantization is one vpermps per 16 weights, is as fast
# as the integer one at every row count from 1 to 512. On AVX2 the integer path is 1.1-1.6x
# faster from 8 rows, but with it the default mode's accuracy fell to llama.cpp's (KL 0.004-
# 0.007 against float32, 20-22 of 30 greedy tokens, worse than the peer on 2 of 4 figures;
# the float path: KL 2e-11, 30 of 30), so the default keeps float32's accuracy there too.
BLOCK_INT_ROWS = {"AVX-512 VNNI": 0, "AVX2": 0}


def block_int_rows() -> int:
    """BLOCK_INT_ROWS for the ISA the block kernel runs here."""
    return BLOCK_INT_ROWS.get(block_isa(), 0)


# Rows from which a block product quantizes its activations to 32-wide int16 blocks and
# multiplies them with vpdpwssd (block_matmul_i16.inc: rows in groups of 8 lanes below 16
# rows, of 16 from there), by the ISA; 0: never (AVX2 has no vpdpwssd). Measured on Zen 4,
# one thread, weights in cache (bench/kernels/wide_path_probe.cc), against the float path:
# Q4_1 [576, 1536] 4 rows 0.74x (8 lanes half empty), 5 rows 1.13x, 8 rows 1.45x, 16-160
# rows 1.5-1.7x; the Q8_0 head 1.14x at 5 rows, 1.2-1.4x from 8. In the engine (default
# model, greedy decode steps at context 256, 3 alternated rounds in one process): 4 rows
# 13.4 ms either way (float), 8 rows 22.9 -> 20.0, 16 rows 38.4 -> 31.1, 32 rows 67.4 ->
# 56.8 (docs/benchmarks.md "16-bit activation blocks"). The rounding is at most 1/65534 of
# a block's largest activation; the default mode's KL against float32 stays ~2,500x below
# llama.cpp's (tools/parity/compare_logits.py).
# Any wide_rows > 0 also puts a one-row product (a c1 decode step's) on integer dot products
# (block_matmul_rowint.inc: each 32-wide activation block split into two int8 parts, x ~= S
# (q1 + q2 / 256), error <= amax / 65024 of the block; vpdpbusd on the weights' own nibbles /
# bytes, d and Q4_1's m applied in float per block); 0 keeps float32 activations at one row
# too. Measured on Zen 4 (bench/kernels/block_rowint_stream.sh, docs/benchmarks.md "One row of
# Q4_0 / Q4_1 / Q8_0 on integer dot products"): one thread from L2, [2048, 512], 1.58 / 1.74 /
# 1.65x the float tile (Q4_0 / Q4_1 / Q8_0); two threads through DRAM on the 1B shapes Q4_0
# 1.13-1.36x, Q4_1 1.19-1.46x, Q8_0 0.90-1.06x (its tile was already at the memory; load 16-20).
# From 5 to 12 rows the kernel takes block_matmul_rows16.inc instead (the same int16
# activation blocks and the same bits; a vector's 8 lanes are 4 rows x 2 columns, so no lane
# is padding at 8 or 12 rows and each weight pair broadcast feeds two row groups). One thread
# from L2, [2048 -> 512], against the float path, alternated in one run: 8 rows Q4_0 1.39x
# where the 8-lane groups ran 1.21x, 12 rows 1.45x where they ran 1.20x; at 2-4 rows this
# design (and R 2: 2 rows x 4 columns) stayed below the float tile (0.5-0.8x), so the
# threshold stays 5 (bench/kernels/block_rows_stream.sh; docs/benchmarks.md "Two to fifteen
# rows of Q4_0 / Q4_1 / Q8_0"). At 5 to 8 rows those int16 activations split into byte
# halves for vpdpbusd on the quants' own bytes (block_matmul_rows16_halves.inc: the same bits,
# no widened weight panel; 1.18-1.29x the R 4 tile one thread from L2, 1.3-1.9x two threads
# through DRAM; docs/benchmarks.md "The 8-row Q4_0 product: what bounds it").
# On AVX2 (no VNNI) any wide_rows > 0 puts one row on block_matmul_rowint256.inc (the same
# split on base 254, error <= amax / 64516 of a block; vpmaddubsw + vpmaddwd, eight blocks' dots
# to one float step) and changes nothing else: 2 rows and more keep float32.
BLOCK_WIDE_ROWS = {"AVX-512 VNNI": 5, "AVX2": 1}
BLOCK_ROWS16_RANGE = "5-12"  # block_matmul_rows16.inc's Rows16PerGroup (the start-up log)


def block_wide_rows() -> int:
    """BLOCK_WIDE_ROWS for the ISA the block kernel runs here."""
    return BLOCK_WIDE_ROWS.get(block_isa(), 0)


# The K-quant kernel's wide_rows, by the ISA the block kernel detects (the K-quant kernel checks
# VNNI itself): 1 puts products of 1 to 15 rows (a decode step's, and one mixed with a few
# prompt tokens) on 16-bit integer activations (one row: block_matmul_k_rowint.inc, error <=
# amax / 64516 of a 256-wide super-block, vpmaddubsw + vpdpwssd; 2 to 15 rows:
# block_matmul_k_rows16.inc, int16 weights times int16 activations, amax / 65534, ~1.9-2.1x the
# float tile at 4 and 8 rows, 2.0-2.6x at 9 to 15 in two passes of rows; 7 and 8 rows, and a
# prompt chunk's last 7-8 rows past whole 16-row groups: block_matmul_k_rows8.inc, the same
# activations with the rows in the lanes, Q4_K on byte products, 1.04-1.36x rows16 through DRAM
# at 8 rows); 0 keeps float32
# activations. Measured on Zen 4: two threads through DRAM,
# Llama-3.2-1B projection shapes, Q4_K 1.48-1.94x the float row path, Q5_K 1.77-2.16x, Q6_K
# 1.67-1.90x, at 66-102 % of the DRAM probe (bench/kernels/kquant_stream.sh). The 1B Q4_K_M
# file's one-row logits against the float row path, 3 prompts x 37-39 positions: KL 1.2-1.4e-7
# mean, 3.0e-7 max, max |diff| 2.6-3.6e-3, the same top-1 everywhere, 32 of 32 greedy tokens
# (bench/kernels/kquant_int_logits.py; docs/benchmarks.md): below the 1e-6 KL under which the
# default may take a faster, less exact path. The same 1 puts products of 16 rows and more
# (prompt chunks) on 32-wide int16 activation blocks (block_matmul_k_i16.inc: error <= amax /
# 65534 of a block, vpdpwssd; 1.3-2.2x the float panel at 16-128 rows on Zen 4, two threads,
# bench/kernels/kquant_prefill.cc; docs/benchmarks.md "K-quant prompt chunks on 16-bit integers").
# On AVX2 (no VNNI) the same 1 puts products of 1 to 8 rows on 16-bit integer activations
# (block_matmul_k_row256.inc: the one-row path's activations and bound, vpmaddubsw + vpmaddwd);
# 9 rows and more keep float32 on a dequantized panel (panel256.inc). The 2-vCPU Xeon under
# FERROX_CPU_ISA=avx2 (2026-12-07, the 1B's Q4_K and Q6_K shapes, best of 7, two runs): 1 row
# 1.7-2.4x the float tile, 8 rows 1.1-1.25x the panel (docs/benchmarks.md "AVX2 instruction set").
BLOCK_K_WIDE_ROWS = {"AVX-512 VNNI": 1, "AVX2": 1}
K_INT_ROWS_AVX2 = 8  # block_matmul_k_row256.inc's kIntRows256 (the start-up log)


def block_k_wide_rows() -> int:
    """BLOCK_K_WIDE_ROWS for the ISA the block kernel runs here."""
    return BLOCK_K_WIDE_ROWS.get(block_isa(), 0)


# Rows from which a block product runs on AMX-BF16 tiles where the CPU has them (split bf16:
# hi + lo halves of every operand, ~2^-15 relative per product; block_matmul_amx.inc), and
# only for weights of at least BLOCK_AMX_MIN_K inputs. The tiles dequantize each block once
# for all rows, but they stream every panel's activations from L2 (about 9 ns per 1 KB tile
# load on the 2-vCPU Xeon here, against 4.9 ns per tile product), so since the 16-bit integer
# paths landed they only pay at prompt-chunk sizes on 1B-class projections. Whole steps on an
# Intel Xeon with AMX (2026-12-07, `tools.bench.profile_step`, AMX on / off alternated, best ms of
# 5, 2 rounds; docs/benchmarks.md "On an Intel Xeon with AMX"): SmolLM2-135M Q4_1 (K 576 /
# 1,536) 32 rows 72-75 on / 55-59 off, 135 rows 269-280 / 220-229; Llama-3.2-1B Q4_0 (K 2,048 /
# 8,192) 32 rows 309-322 / 261-264, 135 rows 900-937 / 1,093-1,117 (one projection alone from 64
# rows on is level or better only where N is wide). 0 in either: never. Past 1.5 MB of packed rows
# the tiles take K in pieces that stay in L2 (block_matmul_amx.inc): the 1B Q4_0's 135-row step's
# down projections 225-236 -> 157 ms (docs/benchmarks.md, "long-input products in L2").
BLOCK_AMX_ROWS = 128
BLOCK_AMX_MIN_K = 2048


def block_amx_rows() -> int:
    """BLOCK_AMX_ROWS where the block kernel can use AMX-BF16 here, else 0 (weights of fewer
    than BLOCK_AMX_MIN_K inputs never take the tiles by default: `pack_blocks_for_kernel`)."""
    return BLOCK_AMX_ROWS if block_amx() else 0


def block_amx() -> bool:
    """Whether the block kernel's AMX-BF16 path can run on this CPU (and OS)."""
    return unavailable_reason() is None and _ISA.get("block_amx") == "AMX-BF16"


def block_isa() -> str:
    """Which build of the block kernel this CPU runs ("AVX-512 VNNI", "AVX2"), or "none"."""
    return _ISA.get("block", "none") if unavailable_reason() is None else "none"


def block_k_isa() -> str:
    """Which build of the K-quant kernel this CPU runs ("AVX-512", "AVX2"), or "none"."""
    return _ISA.get("block_k", "none") if unavailable_reason() is None else "none"


def attention_isa() -> str:
    """Which build of the decode attention's lone rows this CPU runs ("AVX-512" where head_dim is a
    multiple of 16, else the AVX2 one; "AVX2"), or "none"."""
    return _ISA.get("attention", "none") if unavailable_reason() is None else "none"


def block_mxfp4_isa() -> str:
    """Which build of the MXFP4 kernel this CPU runs ("AVX-512", "AVX2"), or "none"."""
    return _ISA.get("block_mxfp4", "none") if unavailable_reason() is None else "none"


def block_target(fmt: str) -> str:
    """The custom call that multiplies blocks of `fmt` (a `models.gguf_blocks.BLOCK_FORMATS` key)."""
    if fmt == "mxfp4":
        return BLOCK_MXFP4_TARGET
    return BLOCK_K_TARGET if fmt in K_FORMATS else BLOCK_TARGET


def pack_blocks_for_kernel(model: nnx.Module, int_rows: int | None = None, amx_rows: int | None = None,
                           wide_rows: int | None = None) -> int:
    """Points every BlockQuantizedWeight of `model` at its block kernel, in place (the bytes
    stay as they are), with int8 activation blocks from `int_rows` rows (None:
    `block_int_rows()`; 0: never), AMX tiles from `amx_rows` (None: `block_amx_rows()` for
    weights of at least BLOCK_AMX_MIN_K inputs, never for narrower ones; a number: every weight;
    0: never) and int16 activation blocks from `wide_rows` (None: `block_wide_rows()`; 0:
    never); the K-quants' kernel takes `wide_rows` too (1: its one-row integer path, the
    only integer path it has; None: `block_k_wide_rows()`); MXFP4's has only the float path.
    Returns how many. Raises
    RuntimeError where the kernels cannot run."""
    require()
    int_rows = block_int_rows() if int_rows is None else int_rows
    amx_min_k = BLOCK_AMX_MIN_K if amx_rows is None else 0
    amx_rows = block_amx_rows() if amx_rows is None else amx_rows
    k_wide_rows = block_k_wide_rows() if wide_rows is None else wide_rows
    wide_rows = block_wide_rows() if wide_rows is None else wide_rows
    state = nnx.state(model)
    packed = 0

    def one(path, leaf):
        nonlocal packed
        if isinstance(leaf, BlockQuantizedWeight):
            # The embedding table kept as blocks is looked up, never multiplied: not a projection.
            packed += not _is_embedding(path)
            if leaf.fmt == "mxfp4":  # float activations only
                return with_kernel(leaf, block_target(leaf.fmt), 0, 0)
            if leaf.fmt in K_FORMATS:
                # the K-quant kernel reads wide_rows too: 1 puts its one-row products on 16-bit
                # integer activations (block_matmul_k_rowint.inc); it has no other integer path.
                # Expert stacks keep float32 activations, as below.
                k_wide = 0 if leaf.blocks.ndim == 3 else k_wide_rows
                return with_kernel(leaf, block_target(leaf.fmt), 0, 0, k_wide)
            if leaf.blocks.ndim == 3:
                # An expert stack multiplies tiles padded to 8+ rows (models/moe.py) even for one
                # token, so row thresholds measured on real rows would quantize a one-row decode's
                # activations (1.1e-3 on a Qwen3-MoE-shaped file's logits): float activations only.
                return with_kernel(leaf, BLOCK_TARGET, 0, 0, 0)
            amx = amx_rows if leaf.in_features >= amx_min_k else 0
            return with_kernel(leaf, BLOCK_TARGET, int_rows, amx, wide_rows)
        return leaf

    nnx.update(model, jax.tree_util.tree_map_with_path(one, state,
                                                       is_leaf=lambda x: isinstance(x, BlockQuantizedWeight)))
    return packed


def _is_embedding(path) -> bool:
    first = path[0] if path else None
    return getattr(first, "key", getattr(first, "name", None)) == "embed"


def k_quant_count(model: nnx.Module, formats=K_FORMATS) -> int:
    """How many of `model`'s BlockQuantizedWeights are in `formats` (the K-quants by default;
    for the start-up log)."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model), is_leaf=lambda x: isinstance(x, BlockQuantizedWeight))
    return sum(isinstance(leaf, BlockQuantizedWeight) and leaf.fmt in formats and not _is_embedding(path)
               for path, leaf in leaves)


def sample_rows(raw, logits, temperature, top_k, top_p, min_p, uniform):
    """The sampler's passes over the vocabulary, per row (sample_rows.cc; the caller checked
    `runtime_problems`): raw and logits f32[B, V] (the model's, and after penalties and
    masks), the rows' settings [B] and their uniform draws f32[B] in [0, 1).

    Returns:
      token i32[B] (the first maximum of `logits` where temperature is 0, else the draw),
      row_max f32[B] and log_sum f32[B] (raw logprobs are raw - row_max - log_sum),
      finite bool[B] (every raw logit finite).
    """
    b = raw.shape[0]
    i32, f32 = (jax.ShapeDtypeStruct((b,), t) for t in (jnp.int32, jnp.float32))
    token, row_max, log_sum, finite = jax.ffi.ffi_call(SAMPLE_TARGET, (i32, f32, f32, i32))(
        raw.astype(jnp.float32), logits.astype(jnp.float32), temperature.astype(jnp.float32),
        top_k.astype(jnp.int32), top_p.astype(jnp.float32), min_p.astype(jnp.float32), uniform.astype(jnp.float32))
    return token, row_max, log_sum, finite != 0


def main() -> None:
    try:
        path = build()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        print(f"models.cpu_kernels: the CPU kernels did not build; w8a8 and decode attention will use "
              f"XLA.\n{detail}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"built {path}")


if __name__ == "__main__":
    main()
