"""GGUF's quantized blocks kept as shipped: the weight type, its dequantization and matmul.

`--quantization gguf` serves a GGUF file's Q4_0, Q4_1 and Q8_0 projections (and the LM
head; the K-quants Q4_K / Q5_K / Q6_K too, their layout in `models/gguf_kquants.py`)
in the bytes the file stores, instead of dequantizing them to float32 (about six
times the bytes read per token for Q4_1) or requantizing them per channel (`int8`/`w8a8`,
which rounds every weight a second time). The file's blocks, dequantized, *are* the
reference weights, so the product is float32's up to float32 rounding on the float path.

Layout (`BlockQuantizedWeight.blocks`): u8[out, in / 32 * B], one output channel per
row, its `in` inputs as in / 32 consecutive blocks of B bytes, byte for byte the file's:

    Q4_0  B = 18   f16 d, u8 qs[16]          w = d * (q - 8)
    Q4_1  B = 20   f16 d, f16 m, u8 qs[16]   w = d * q + m
    Q8_0  B = 34   f16 d, s8 qs[32]          w = d * q

(Q4: value j is the low nibble of qs[j], value j + 16 its high nibble.) MXFP4 (B = 17,
gpt-oss's experts: u8 e, u8 qs[16], w = FP4[q] * 2^(e - 127)) has its own module,
`models/gguf_mxfp4.py`, and kernel, as the K-quants do. GGUF's numpy view
of a weight is already [out, in] with each row's blocks contiguous: loading is a
reshape, and llama's q/k row permutation (`models/loaders/gguf.py`) permutes whole rows.
The logical shape (`shape`) is the projection's [in, out], what the model expects.

The product (`block_matmul`): on one x86 CPU device the engine points `kernel` at
ferrox's block kernel (`models/kernels/block_matmul.cc` via `models/cpu_kernels.py`):
float32 activations times the blocks dequantized in registers for few rows; on AVX-512
VNNI, activations in 32-wide int16 blocks with 16-bit integer dots from `wide_rows` rows
(~1.5x faster for many rows, rounding ~1.5e-5 of a block's largest activation); as an
option, activations in 32-wide int8 blocks (llama.cpp's scheme, its accuracy) from
`int_rows` rows; and on a CPU with AMX-BF16 tiles from `amx_rows` rows. Elsewhere
(`kernel` None) XLA dequantizes the blocks (`dequantize_blocks`) and runs a float dot:
correct everywhere, fast nowhere, as the start-up log says.

Several products of the same activations (q/k/v, gate/up: `block_matmul_many`) are one
call of the kernel's multi-weight target when every weight is on the same kernel: the
columns of all of them are shared over the threads at once, so the small k/v products stop
paying a call's start and end (the default model's one-row step 9.6 -> 9.0 ms, median of 3
alternated runs, docs/benchmarks.md). Each output element is the one-weight call's, bit for bit.
The K-quants' kernel has a multi-weight target too (a Q4_K_M layer's q/k/v mixes Q4_K and Q6_K:
formats may differ within one call), so a K-quant layer makes 4 kernel calls instead of 7.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models import gguf_kquants, gguf_mxfp4

BLOCK = 32  # values per GGUF block
# Kernel targets that also multiply 2 or 3 weights of the same activations in one call
# (models/kernels/block_matmul.cc's multi-weight handler, registered by models/cpu_kernels.py).
MULTI_TARGETS = {"ferrox_block_matmul": "ferrox_block_matmul_multi",
                 "ferrox_block_matmul_k": "ferrox_block_matmul_k_multi"}  # the K-quants' (block_matmul_k.cc)


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    name: str  # "q4_0", "q4_1", "q8_0", "q4_k", ...: GGML's type name, lower case
    code: int  # the kernel's `fmt` attribute
    block_bytes: int
    block_values: int = BLOCK  # 256 for the K-quants' super-blocks (models/gguf_kquants.py)


# The K-quants (codes 3-5) are multiplied by models/kernels/block_matmul_k.cc, MXFP4 (code 6,
# models/gguf_mxfp4.py) by models/kernels/block_matmul_mxfp4.cc.
K_FORMATS = ("q4_k", "q5_k", "q6_k")
BLOCK_FORMATS = {f.name: f for f in (BlockFormat("q4_0", 0, 18), BlockFormat("q4_1", 1, 20),
                                     BlockFormat("q8_0", 2, 34),
                                     *(BlockFormat(name, 3 + i, gguf_kquants.SUPER_BYTES[name], gguf_kquants.SUPER)
                                       for i, name in enumerate(K_FORMATS)),
                                     BlockFormat("mxfp4", 6, gguf_mxfp4.BLOCK_BYTES))}


@struct.dataclass
class BlockQuantizedWeight:
    """A projection [in, out] as GGUF blocks, u8[out, in / 32 * B] (module docstring), or a
    stack of experts' projections [E, in, out] as u8[E, out, in / 32 * B] (each expert's
    rows as llama.cpp's `ffn_*_exps` hold them; `models/quant.py:select_expert` takes one)."""

    blocks: jax.Array  # u8[out, row bytes], or u8[E, out, row bytes] for an expert stack
    fmt: str = struct.field(pytree_node=False, default="q8_0")  # a BLOCK_FORMATS key
    # The XLA FFI target that multiplies it (models/cpu_kernels.py); None: XLA dequantizes.
    kernel: str | None = struct.field(pytree_node=False, default=None)
    # With `kernel`: products of at least this many rows quantize the activations (0: never).
    int_rows: int = struct.field(pytree_node=False, default=0)
    # With `kernel`: products of at least this many rows run on AMX-BF16 tiles where the CPU
    # has them (split bf16, models/kernels/block_matmul_amx.inc; 0: never).
    amx_rows: int = struct.field(pytree_node=False, default=0)
    # With `kernel`: products of at least this many rows (below `int_rows`) quantize the
    # activations to 32-wide int16 blocks where the kernel's AVX-512 VNNI build runs (0: never).
    wide_rows: int = struct.field(pytree_node=False, default=0)

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[-2])

    @property
    def in_features(self) -> int:
        f = BLOCK_FORMATS[self.fmt]
        return int(self.blocks.shape[-1]) // f.block_bytes * f.block_values

    @property
    def shape(self) -> tuple[int, ...]:
        """[in, out]; an expert stack (blocks u8[E, out, row bytes]) [E, in, out]."""
        return (*(int(n) for n in self.blocks.shape[:-2]), self.in_features, self.out_features)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.size)


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one output channel's blocks."""
    f = BLOCK_FORMATS[fmt]
    if in_features % f.block_values:
        raise ValueError(f"a {fmt} row holds a multiple of {f.block_values} values; got {in_features}")
    return in_features // f.block_values * f.block_bytes


def make_weight(blocks: np.ndarray, fmt: str, in_features: int) -> BlockQuantizedWeight:
    """A BlockQuantizedWeight from host bytes u8[out, row bytes] (an expert stack:
    u8[E, out, row bytes]), checked against `in_features`."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"block format must be one of {', '.join(BLOCK_FORMATS)}; got {fmt!r}")
    want = row_bytes(fmt, in_features)
    if blocks.dtype != np.uint8 or blocks.ndim not in (2, 3) or blocks.shape[-1] != want:
        raise ValueError(f"{fmt} blocks for {in_features} inputs must be uint8[out, {want}]; "
                         f"got {blocks.dtype}{tuple(blocks.shape)}")
    return BlockQuantizedWeight(device_copy(blocks), fmt)


HOST_ALIGN = 64  # the CPU backend adopts a host array this aligned instead of copying it


def device_copy(host: np.ndarray) -> jax.Array:
    """`host` placed on the default device as a copy of its own, for one host copy in all.

    The copy is made here, into a `HOST_ALIGN`-aligned buffer nothing else holds, which the
    CPU backend then adopts as the device array's memory (`jax.device_put` aliases an
    aligned host array rather than copying it); other backends transfer it. `jnp.asarray`
    stages the array through a second copy (about 4x the CPU time for the 1B's 0.67 GB,
    docs/benchmarks.md); `device_put` of the caller's array would alias it wherever it
    happens to be aligned: a GGUF's mapped file (the served weights would then be its
    pages) or an array the caller writes to later."""
    buf = np.empty(host.nbytes + HOST_ALIGN, np.uint8)
    start = -buf.ctypes.data % HOST_ALIGN
    own = buf[start:start + host.nbytes].view(host.dtype).reshape(host.shape)
    parallel_copy(own, host)
    return jax.device_put(own)


PARALLEL_COPY_BYTES = 4 << 20  # smaller arrays are copied on the calling thread


@functools.cache
def _copy_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's copy pool of `threads` workers, made on first use."""
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ferrox-copy")


def copy_threads() -> int:
    """Threads a large copy is split over: the CPUs this process may run on, at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`np.copyto(dst, src)` (same shape) split by leading rows over `copy_threads()` threads.

    The copy's cost at start-up is mostly the first touch of `dst`'s fresh pages, not the
    bytes: in a VM that hands free guest memory back to its host (free page reporting), a
    page the guest has not touched lately costs a host fault, and one thread placed the
    1B's 0.67 GB at ~130 MB/s there against ~6 GB/s into recently used pages. Those faults
    proceed on every vCPU at once: on the 2-vCPU host of docs/benchmarks.md two threads took
    667 MB of cold pages in 2.55-2.75 s against 5.44-5.48 s (four: 3.08 s;
    `bench/startup/first_touch.py`), and the 1B's whole `Engine.load` after 40 idle seconds
    4.39-6.4 s against 5.42-8.19 s (`bench/startup/cold_load_ab.sh`, alternated). numpy's copy
    releases the GIL for plain dtypes."""
    threads = copy_threads()
    rows = dst.shape[0] if dst.ndim else 0
    if threads == 1 or dst.nbytes < PARALLEL_COPY_BYTES or rows < threads:
        np.copyto(dst, src)
        return
    pool = _copy_pool(threads)
    bounds = np.linspace(0, rows, min(rows, threads * 4) + 1).astype(int)
    jobs = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    for job in jobs:
        job.result()


def dequantize_host(blocks: np.ndarray, fmt: str, dtype=np.float64) -> np.ndarray:
    """numpy u8[rows, row bytes] -> [rows, in] in `dtype` (float64 for test references)."""
    if fmt in K_FORMATS:
        return gguf_kquants.dequantize_host(blocks, fmt, dtype)
    if fmt == "mxfp4":
        return gguf_mxfp4.dequantize_host(blocks, dtype)
    size = BLOCK_FORMATS[fmt].block_bytes
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(rows, -1, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(dtype)[..., None]
    if fmt == "q8_0":
        return (d * b[..., 2:].view(np.int8).astype(dtype)).reshape(rows, -1)
    qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(dtype)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(dtype)[..., None] if fmt == "q4_1" else -8.0 * d
    return (d * q + m).reshape(rows, -1)


def dequantize_blocks(blocks: jax.Array, fmt: str) -> jax.Array:
    """jnp version of `dequantize_host`: u8[rows, row bytes] -> f32[rows, in] (traceable)."""
    if fmt in K_FORMATS:
        return gguf_kquants.dequantize_blocks(blocks, fmt)
    if fmt == "mxfp4":
        return gguf_mxfp4.dequantize_blocks(blocks)
    size = BLOCK_FORMATS[fmt].block_bytes
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, size)

    def half(at: int) -> jax.Array:  # the f16 at bytes at..at+1 of every block, as f32[rows, nb, 1]
        return jax.lax.bitcast_convert_type(b[..., at:at + 2], jnp.float16).astype(jnp.float32)[..., None]

    d = half(0)
    if fmt == "q8_0":
        q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
        return (d * q).reshape(rows, -1)
    qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
    q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.float32)
    m = half(2) if fmt == "q4_1" else -8.0 * d
    return (d * q + m).reshape(rows, -1)


def block_matmul(x: jax.Array, w: BlockQuantizedWeight) -> jax.Array:
    """x [..., in] @ w -> [..., out] in x's dtype (module docstring)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w.in_features:
        raise ValueError(f"block_matmul: x has {k} inputs and the {w.fmt} weight {w.in_features}")
    rows = x.reshape(-1, k).astype(jnp.float32)
    if w.kernel is None:
        y = rows @ dequantize_blocks(w.blocks, w.fmt).T
    else:
        out = jax.ShapeDtypeStruct((rows.shape[0], w.out_features), jnp.float32)
        y = jax.ffi.ffi_call(w.kernel, out)(rows, w.blocks, fmt=np.int32(BLOCK_FORMATS[w.fmt].code),
                                            int_rows=np.int32(w.int_rows), wide_rows=np.int32(w.wide_rows),
                                            amx_rows=np.int32(w.amx_rows))
    return y.reshape(*lead, -1).astype(x.dtype)


def fusable(weights) -> bool:
    """Whether `block_matmul_many` makes one kernel call of `weights` (2 or 3 block weights of
    the same inputs, on the same kernel with a multi-weight target, the same row thresholds)."""
    if not 2 <= len(weights) <= 3 or not all(isinstance(w, BlockQuantizedWeight) for w in weights):
        return False
    first = weights[0]
    return first.kernel in MULTI_TARGETS and all(
        (w.kernel, w.int_rows, w.wide_rows, w.amx_rows, w.in_features)
        == (first.kernel, first.int_rows, first.wide_rows, first.amx_rows, first.in_features) for w in weights)


def block_matmul_many(x: jax.Array, weights) -> list[jax.Array]:
    """[block_matmul(x, w) for w in weights]: one kernel call where `fusable(weights)`."""
    if not fusable(weights):
        return [block_matmul(x, w) for w in weights]
    lead, k = x.shape[:-1], x.shape[-1]
    if k != weights[0].in_features:
        raise ValueError(f"block_matmul_many: x has {k} inputs and the weights {weights[0].in_features}")
    rows = x.reshape(-1, k).astype(jnp.float32)
    first = weights[0]
    outs = [jax.ShapeDtypeStruct((rows.shape[0], w.out_features), jnp.float32) for w in weights]
    fmts = np.asarray([BLOCK_FORMATS[w.fmt].code for w in weights], np.int32)
    ys = jax.ffi.ffi_call(MULTI_TARGETS[first.kernel], outs)(
        rows, *(w.blocks for w in weights), fmts=fmts, int_rows=np.int32(first.int_rows),
        wide_rows=np.int32(first.wide_rows), amx_rows=np.int32(first.amx_rows))
    return [y.reshape(*lead, -1).astype(x.dtype) for y in ys]


def with_kernel(w: BlockQuantizedWeight, kernel: str | None, int_rows: int, amx_rows: int = 0,
                wide_rows: int = 0) -> BlockQuantizedWeight:
    """The same blocks, multiplied by `kernel` (None: XLA), int8 activation blocks from
    `int_rows` rows, on AMX tiles from `amx_rows` rows (where the CPU has them), int16
    activation blocks from `wide_rows` rows (where the AVX-512 VNNI build runs)."""
    return BlockQuantizedWeight(w.blocks, w.fmt, kernel, int_rows, amx_rows, wide_rows)
