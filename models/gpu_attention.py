"""Decode attention candidates for GPUs: the public ways JAX offers to attend over our paged cache.

A decode step asks one query per row to attend over that row's blocks (layout:
`ferrox_jax/kv_cache.py`, `[K kv_heads, N num_blocks, bs block_size, hd]`). Next to the
pure-JAX loop (`models/attention.py`) JAX offers these on a GPU without private APIs:

    attention_impl          what runs                                          where
    "pallas-gpu"            jax.experimental.pallas.ops.gpu.paged_attention     CUDA GPUs (Triton)
                            (reads our layout in place; it calls blocks pages)
    "pallas-gpu-interpret"  the same kernel in Pallas interpret mode           any backend; tests only
    "gather-xla"            gather each row's blocks into a dense [B, S, K, hd] any backend
                            buffer, then jax.nn.dot_product_attention
                            (implementation="xla") with key_value_seq_lengths
    "gather-cudnn"          the same gather, then implementation="cudnn"        CUDA GPUs, bf16/f16 cache

How they differ in bytes moved per decode step (per layer; S_row = a row's context,
W = the block-table width in positions, i.e. the engine's context ceiling):

    jax           reads each row's K/V up to the batch's furthest position: B * max(S_row)
    pallas-gpu    reads each row's K/V up to its own length: sum(S_row); partitions past
                  the length exit at once (grid: kv heads x head blocks x k_splits)
    gather-*      reads AND writes B * W positions of K and V (the whole table width,
                  whatever the rows' lengths: shapes are static), then the attention
                  reads them again: about 3x B * W, before cuDNN's or XLA's own work

So the gather candidates can only win where W is close to the rows' contexts and the
attention kernel itself is much faster than a loop; they are here because cuDNN's flash
attention is the one NVIDIA-tuned kernel reachable publicly. cuDNN's own paged attention
(page tables) is reachable only through `jax._src.cudnn` (private) and wants a
`[blocks, block_size, heads, hd]` layout; tokamax's paged attention (experimental
`batched_rpa`) is Mosaic TPU code with a reference fallback, and its GPU attention is
dense (the same gather would precede it): neither is a candidate here.

`select_gpu_decode_attention` builds one for an engine; `models/pallas_attention.py`
(`select_decode_attention`) dispatches to it. Each candidate is a frozen dataclass
(hashable: it is a static field of the model, part of the compiled step's graphdef)
with the contract of `models.attention.paged_attention` for T == 1:

    (q [B, 1, H, hd], k_cache, v_cache [K, N, bs, hd], block_tables i32[B, MB],
     positions i32[B, 1], scale) -> f32[B, 1, H, hd]

On a CUDA GPU `auto` takes the ragged GPU kernel (`models/ragged_gpu.py`), which serves
every row of a step, prompt chunks and windowed layers included; these decode-only
candidates stay as fallbacks a deployment can name, and `tools/device/device_check.py` times each
of them, and the ragged kernel, against the pure-JAX loop on an H200.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.attention import check_decode_inputs, shard_over_kv_heads

GPU_ATTENTION_IMPLS = ("pallas-gpu", "pallas-gpu-interpret", "gather-xla", "gather-cudnn")
GPU_BACKENDS = ("gpu", "cuda")
GPU_KERNEL_KEYS_PER_COMPUTE_BLOCK = 128  # keys one kernel iteration loads (a Triton tile)
GPU_KERNEL_MAX_SPLITS = 16  # partitions of a row's table (the upstream default k_splits)
GPU_KERNEL_BLOCK_H = 16  # query heads per program; the kernel pads each KV group up to it
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256  # Hopper (128 before it); a multiple of 8


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pallas_gpu_blocking(block_size: int, max_blocks_per_row: int) -> tuple[int, int]:
    """(pages_per_compute_block, k_splits) for the Pallas GPU kernel.

    pages_per_compute_block: the most blocks whose keys fit one 128-key tile and make a
    power-of-two tile (Triton's `arange` needs one). k_splits: up to 16 partitions per row,
    so one row still spreads over many programs (at 1 row and 8 KV heads, 16 splits make
    128 programs for the H200's 132 multiprocessors); the table is padded with the null
    block to a multiple of both inside the call, and padded pages past a row's length are
    never read.
    """
    ppcb = max(1, GPU_KERNEL_KEYS_PER_COMPUTE_BLOCK // block_size)
    while ppcb > 1 and not _is_power_of_two(ppcb * block_size):
        ppcb -= 1
    k_splits = max(1, min(GPU_KERNEL_MAX_SPLITS, -(-max_blocks_per_row // ppcb)))
    return ppcb, k_splits


def pallas_gpu_problems(head_dim: int, block_size: int, ppcb: int) -> list[str]:
    """Unmet Triton constraints of the Pallas GPU kernel (empty when it can run)."""
    problems = []
    if head_dim < 16 or not _is_power_of_two(head_dim):
        problems.append(f"head_dim {head_dim} is not a power of two >= 16 (a Triton tile dimension)")
    keys = ppcb * block_size
    if keys < 16 or not _is_power_of_two(keys):
        problems.append(f"block_size {block_size} makes a {keys}-key tile; Triton needs a power of two >= 16")
    return problems


def cudnn_problems(head_dim: int, kv_dtype) -> list[str]:
    """Unmet constraints of cuDNN flash attention (empty when it can run)."""
    problems = []
    name = jnp.dtype(kv_dtype).name
    if name not in CUDNN_DTYPES:
        problems.append(f"cuDNN attention needs a bfloat16 or float16 KV cache; this one is {name}")
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        problems.append(f"head_dim {head_dim} is not a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}")
    return problems


@dataclasses.dataclass(frozen=True)
class PallasGpuDecodeAttention:
    """Decode attention via JAX's Pallas GPU (Triton) paged-attention kernel. Hashable: static.

    Fields:
      pages_per_compute_block: blocks per kernel iteration (`pallas_gpu_blocking`).
      k_splits: partitions of each row's table, reduced after the kernel (flash-decoding).
      mesh: run under shard_map on this mesh (None: single device).
      kv_sharded: KV heads split over the mesh's "model" axis (False: replicated).
      interpret: run the kernel in Pallas interpret mode (any backend; slow; tests).
    """

    pages_per_compute_block: int
    k_splits: int
    mesh: Mesh | None = None
    kv_sharded: bool = False
    interpret: bool = False

    def __call__(self, q, k_cache, v_cache, block_tables, positions, scale: float):
        """Same contract as `models.attention.paged_attention` for T == 1 (module docstring)."""
        check_decode_inputs(q, k_cache, v_cache)
        b, _, num_heads, head_dim = q.shape
        q1 = (q[:, 0].astype(jnp.float32) * scale).astype(k_cache.dtype)  # the kernel does not scale
        lengths = (positions[:, 0] + 1).astype(jnp.int32)
        multiple = self.pages_per_compute_block * self.k_splits
        tables = block_tables.astype(jnp.int32)
        tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % multiple)))  # null block 0, never read
        out = shard_over_kv_heads(self._kernel, self.mesh, self.kv_sharded)(q1, k_cache, v_cache, tables, lengths)
        return out.astype(jnp.float32).reshape(b, 1, num_heads, head_dim)

    def _kernel(self, q, k_pages, v_pages, block_tables, lengths):
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        return paged_attention(q, k_pages, v_pages, block_tables, lengths, block_h=GPU_KERNEL_BLOCK_H,
                               pages_per_compute_block=self.pages_per_compute_block, k_splits=self.k_splits,
                               interpret=self.interpret)


@dataclasses.dataclass(frozen=True)
class GatherDecodeAttention:
    """Gather each row's blocks into a dense buffer, then `jax.nn.dot_product_attention`.

    Fields:
      implementation: "xla" (any backend) or "cudnn" (CUDA GPUs, bf16/f16 cache).
    """

    implementation: str

    def __call__(self, q, k_cache, v_cache, block_tables, positions, scale: float):
        """Same contract as `models.attention.paged_attention` for T == 1 (module docstring)."""
        check_decode_inputs(q, k_cache, v_cache)
        b, _, num_heads, head_dim = q.shape
        num_kv, _, block_size, _ = k_cache.shape
        width = block_tables.shape[1] * block_size

        def dense(cache):  # [K, N, bs, hd] -> [B, MB * bs, K, hd]
            rows = cache[:, block_tables]  # [K, B, MB, bs, hd]
            return rows.transpose(1, 2, 3, 0, 4).reshape(b, width, num_kv, head_dim)

        out = jax.nn.dot_product_attention(
            q.astype(k_cache.dtype), dense(k_cache), dense(v_cache), scale=scale,
            key_value_seq_lengths=(positions[:, 0] + 1).astype(jnp.int32), implementation=self.implementation)
        return out.astype(jnp.float32).reshape(b, 1, num_heads, head_dim)


def select_gpu_decode_attention(impl: str, *, head_dim: int, block_size: int, max_blocks_per_row: int,
                                backend: str, kv_dtype=jnp.bfloat16, mesh: Mesh | None = None,
                                kv_sharded: bool = False):
    """Build the GPU candidate `impl` names; returns (attention, why).

    Raises:
      ValueError naming the unmet constraint (a CUDA-only candidate off a GPU, a head_dim
      or dtype the kernel cannot take).
    """
    if impl not in GPU_ATTENTION_IMPLS:
        raise ValueError(f"{impl!r} is not a GPU decode attention; choose one of {', '.join(GPU_ATTENTION_IMPLS)}")
    needs_gpu = impl in ("pallas-gpu", "gather-cudnn")
    if needs_gpu and backend not in GPU_BACKENDS:
        raise ValueError(f"attention_impl={impl} needs a CUDA GPU backend; this one is {backend!r} "
                         f"(use auto, jax or gather-xla)")
    if impl.startswith("pallas-gpu"):
        ppcb, k_splits = pallas_gpu_blocking(block_size, max_blocks_per_row)
        problems = pallas_gpu_problems(head_dim, block_size, ppcb)
        if problems:
            raise ValueError(f"attention_impl={impl}: the Pallas GPU kernel cannot run this model: "
                             + "; ".join(problems))
        interpret = impl == "pallas-gpu-interpret"
        return (PallasGpuDecodeAttention(ppcb, k_splits, mesh, kv_sharded, interpret),
                f"decode attention: Pallas GPU kernel{' in interpret mode' if interpret else ''} "
                f"(pages_per_compute_block={ppcb}, k_splits={k_splits})")
    implementation = impl.removeprefix("gather-")
    if implementation == "cudnn":
        problems = cudnn_problems(head_dim, kv_dtype)
        if problems:
            raise ValueError("attention_impl=gather-cudnn: " + "; ".join(problems))
    return (GatherDecodeAttention(implementation),
            f"decode attention: gathered blocks + jax.nn.dot_product_attention(implementation={implementation!r})")
