"""Decode attention through JAX's Pallas TPU paged-attention kernel, and the choice of every attention kernel.

`jax.experimental.pallas.ops.tpu.paged_attention.paged_attention` reads the KV layout
we already keep (`[K kv_heads, N num_blocks, bs block_size, hd]`, `ferrox_jax/kv_cache.py`;
the kernel calls blocks "pages"), so decode steps can use it without copying: one query
per row, `lengths = position + 1`, `page_indices = block_tables`. Prefill (T > 1 queries
per row) stays on the pure-JAX `models.attention.paged_attention`; the kernel has no
causal mask between new tokens. Nor does it know sliding windows, logit soft-capping or
attention sinks: layers that need them (Mistral, Gemma 2's every layer, Gemma 3's sliding
ones, Phi-3 with a window, every gpt-oss layer) decode with pure JAX whatever was chosen
here (`models/layers.py`), while the model's other layers use the kernel.

`select_decode_attention` decides the model's attention per engine (the result is a static
field of the model, so it is part of the compiled step's graphdef):

    attention_impl     backend    constraints met   attention uses
    "jax"              any        -                 pure JAX (models/attention.py)
    "auto"             tpu        yes               the ragged TPU kernel (every row, every layer)
    "auto"             cuda/gpu   yes               the ragged GPU kernel (every row, every layer)
    "auto"             tpu / gpu  no                pure JAX (reason logged: a block size the
                                                    kernel's tiles refuse)
    "auto"             cpu        -                 ferrox's decode kernel where it can
                                                    run (models/cpu_attention.py), else pure JAX
    "auto"             other      -                 pure JAX
    "ragged-tpu", "ragged-gpu", and their "-interpret" variants
                                                    the ragged kernels of models/ragged_tpu.py
                                                    and models/ragged_gpu.py; a named one off
                                                    its backend or with unmet constraints is a
                                                    ValueError; interpret mode runs anywhere
    "pallas"           tpu        yes               this module's one-query decode kernel
    "pallas"           tpu/other  no / -            ValueError naming the unmet constraint
    "pallas-interpret" any        -                 the decode kernel in Pallas TPU interpret
                                                    mode (simulated on CPU; slow; tests only)
    "pallas-gpu", "pallas-gpu-interpret", "gather-xla", "gather-cudnn"
                                                    the GPU decode candidates of
                                                    models/gpu_attention.py

The ragged kernels (`models/ragged_attention.py`) serve the whole unified step in one call
per layer: decode rows, prompt chunks and verification spans, with sliding windows,
soft-capping, attention sinks and any head_dim; so `auto` takes them on TPUs and CUDA GPUs for every family.
This module's decode kernel and the GPU decode candidates stay for `tools/device/device_check.py`
to time against them (and for a deployment that measures one faster): with one of them,
prompt chunks, windowed and soft-capped layers run on the pure-JAX loop.

Decode-kernel constraints on real TPUs (Mosaic tiling; the upstream kernel test covers
head_dim 128/256 and page sizes 16/32/64): head_dim a multiple of 128, block_size a
multiple of 16, and `pages_per_compute_block` dividing the block-table width.

On a mesh every kernel runs per device under `shard_map`: each device attends its own
KV heads (KV sharded over "model") or all of them (replicate_attention).

The ragged kernels' modules (and with them Pallas TPU and Triton) are imported when one is
chosen, not with this module: a CPU server never needs them, and they were 0.4-1.3 s of its
start-up's imports on a loaded 2-core host (`python -X importtime`, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.attention import check_decode_inputs, shard_over_kv_heads
from models.gpu_attention import GPU_ATTENTION_IMPLS, GPU_BACKENDS, select_gpu_decode_attention

RAGGED_IMPLS = ("ragged-tpu", "ragged-tpu-interpret", "ragged-gpu", "ragged-gpu-interpret")
ATTENTION_IMPLS = ("auto", "jax", "pallas", "pallas-interpret", "cpu") + GPU_ATTENTION_IMPLS + RAGGED_IMPLS
KERNEL_HEAD_DIM_MULTIPLE = 128
KERNEL_BLOCK_SIZE_MULTIPLE = 16
KERNEL_KEYS_PER_COMPUTE_BLOCK = 512  # keys one kernel iteration loads (the upstream test's choice)


def pages_per_compute_block(block_size: int, max_blocks_per_row: int) -> int:
    """Largest divisor of the table width with at most KERNEL_KEYS_PER_COMPUTE_BLOCK keys."""
    limit = max(1, KERNEL_KEYS_PER_COMPUTE_BLOCK // block_size)
    return max(d for d in range(1, min(limit, max_blocks_per_row) + 1) if max_blocks_per_row % d == 0)


@dataclasses.dataclass(frozen=True)
class PallasDecodeAttention:
    """Decode attention (one query per row) via the Pallas TPU kernel. Hashable: static.

    Fields:
      pages_per_compute_block: blocks per kernel iteration; divides the table width.
      mesh: run under shard_map on this mesh (None: single device).
      kv_sharded: KV heads split over the mesh's "model" axis (False: replicated).
      interpret: trace the kernel in Pallas TPU interpret mode (CPU simulation).
    """

    pages_per_compute_block: int
    mesh: Mesh | None = None
    kv_sharded: bool = False
    interpret: bool = False

    def __call__(self, q, k_cache, v_cache, block_tables, positions, scale: float):
        """Same contract as `models.attention.paged_attention` for T == 1.

        Args:
          q: [B, 1, H, hd] rotated queries; k_cache, v_cache: [K, N, bs, hd].
          block_tables: i32[B, MB]; positions: i32[B, 1] (key s visible iff s <= position).
        Returns:
          f32[B, 1, H, hd].
        """
        check_decode_inputs(q, k_cache, v_cache)
        b, _, num_heads, head_dim = q.shape
        q1 = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)  # the kernel does not scale
        lengths = (positions[:, 0] + 1).astype(jnp.int32)
        tables = block_tables.astype(jnp.int32)
        out = shard_over_kv_heads(self._kernel, self.mesh, self.kv_sharded)(q1, k_cache, v_cache, lengths, tables)
        return out.astype(jnp.float32).reshape(b, 1, num_heads, head_dim)

    def _kernel(self, q, k_pages, v_pages, lengths, page_indices):
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        def call():
            return paged_attention(q, k_pages, v_pages, lengths, page_indices,
                                   pages_per_compute_block=self.pages_per_compute_block)

        if self.interpret:
            with pltpu.force_tpu_interpret_mode():
                return call()
        return call()


def kernel_problems(head_dim: int, block_size: int, max_blocks_per_row: int, ppcb: int) -> list[str]:
    """Unmet Mosaic constraints of the kernel on a real TPU (empty when it can run)."""
    problems = []
    if head_dim % KERNEL_HEAD_DIM_MULTIPLE:
        problems.append(f"head_dim {head_dim} is not a multiple of {KERNEL_HEAD_DIM_MULTIPLE}")
    if block_size % KERNEL_BLOCK_SIZE_MULTIPLE:
        problems.append(f"block_size {block_size} is not a multiple of {KERNEL_BLOCK_SIZE_MULTIPLE}")
    if max_blocks_per_row % ppcb:
        problems.append(f"pages_per_compute_block {ppcb} does not divide the block-table width {max_blocks_per_row}")
    return problems


def _cpu_decode_attention(impl: str, *, head_dim: int, backend: str, mesh: Mesh | None, kv_dtype):
    """`auto` on a CPU backend, or `cpu`: ferrox's kernel (AVX-512 or AVX2) where it can run."""
    from models import cpu_attention, cpu_kernels

    problems = cpu_kernels.runtime_problems(backend, mesh) + cpu_attention.attention_problems(head_dim, kv_dtype)
    if not problems:
        isa = "AVX-512" if cpu_kernels.attention_isa() == "AVX-512" and head_dim % 16 == 0 else "AVX2"
        return cpu_attention.decode_attention(), f"decode attention: ferrox's {isa} CPU kernel (models/cpu_attention.py)"
    if impl == "cpu":
        raise ValueError("attention_impl=cpu: the CPU kernel cannot run here: " + "; ".join(problems))
    return None, "decode attention: pure JAX (the CPU kernel cannot run here: " + "; ".join(problems) + ")"


def select_decode_attention(impl: str, *, head_dim: int, block_size: int, max_blocks_per_row: int,
                            backend: str | None = None, mesh: Mesh | None = None,
                            kv_sharded: bool = False, kv_dtype=jnp.bfloat16):
    """Pick the decode attention for an engine; returns (None for pure JAX | a hashable
    callable with `models.attention.paged_attention`'s T == 1 contract, why).

    `kv_dtype` matters only to candidates with dtype limits (gather-cudnn)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}; got {impl!r}")
    backend = backend or jax.default_backend()
    if impl in RAGGED_IMPLS or (impl == "auto" and (backend == "tpu" or backend in GPU_BACKENDS)):
        kernel, why = select_ragged_attention(impl, backend=backend, block_size=block_size, kv_dtype=kv_dtype,
                                              mesh=mesh, kv_sharded=kv_sharded)
        # auto whose ragged kernel cannot run: the decode kernels' constraints are no weaker
        # (block sizes), so the loop serves it
        return (kernel, why) if kernel is not None else (None, f"attention: pure JAX ({why})")
    if impl in GPU_ATTENTION_IMPLS:
        return select_gpu_decode_attention(impl, head_dim=head_dim, block_size=block_size,
                                           max_blocks_per_row=max_blocks_per_row, backend=backend,
                                           kv_dtype=kv_dtype, mesh=mesh, kv_sharded=kv_sharded)
    ppcb = pages_per_compute_block(block_size, max_blocks_per_row)
    if impl == "jax":
        return None, "decode attention: pure JAX (attention_impl=jax)"
    if impl == "pallas-interpret":
        kernel = PallasDecodeAttention(ppcb, mesh, kv_sharded, interpret=True)
        return kernel, f"decode attention: Pallas TPU kernel in interpret mode (pages_per_compute_block={ppcb})"
    if impl == "cpu" or (impl == "auto" and backend == "cpu"):
        return _cpu_decode_attention(impl, head_dim=head_dim, backend=backend, mesh=mesh, kv_dtype=kv_dtype)
    if impl == "auto":  # a backend with no kernel of ours (TPUs and CUDA GPUs took the ragged branch)
        return None, f"decode attention: pure JAX (backend {backend}; the Pallas kernels are TPU-only or CUDA-only)"
    if backend != "tpu":
        raise ValueError(f"attention_impl=pallas needs a TPU backend; this one is {backend!r} (use auto or jax)")
    problems = kernel_problems(head_dim, block_size, max_blocks_per_row, ppcb)
    if problems:
        raise ValueError("attention_impl=pallas: the Pallas TPU kernel cannot run this model: " + "; ".join(problems))
    return (PallasDecodeAttention(ppcb, mesh, kv_sharded),
            f"decode attention: Pallas TPU kernel (pages_per_compute_block={ppcb}, "
            f"{ppcb * block_size} keys per iteration)")


def select_ragged_attention(impl: str, *, backend: str, block_size: int, kv_dtype, mesh: Mesh | None = None,
                            kv_sharded: bool = False):
    """Build the ragged kernel `impl` names (one of RAGGED_IMPLS, or "auto" for the one of
    `backend`); returns (kernel or None, why). An interpret-mode kernel runs anywhere.

    Raises:
      ValueError naming the unmet constraint, for an explicitly named kernel that cannot
      run here (auto returns None with the reason instead).
    """
    if impl == "auto":
        impl = "ragged-tpu" if backend == "tpu" else "ragged-gpu" if backend in GPU_BACKENDS else None
        if impl is None:
            return None, f"no ragged kernel for backend {backend}"
        auto = True
    else:
        auto = False
    # Imported here, once a ragged kernel is asked for: their Pallas TPU and Triton modules
    # are a few tenths of a second of every CPU server's start-up otherwise.
    from models.ragged_gpu import GpuRaggedAttention, gpu_problems
    from models.ragged_tpu import TpuRaggedAttention, tpu_problems

    interpret = impl.endswith("-interpret")
    on_tpu = impl.startswith("ragged-tpu")
    if not interpret:
        needed = ("tpu",) if on_tpu else GPU_BACKENDS
        if backend not in needed:
            raise ValueError(f"attention_impl={impl} needs a {'TPU' if on_tpu else 'CUDA GPU'} backend; this one "
                             f"is {backend!r} (use auto, jax or {impl}-interpret)")
        problems = tpu_problems(block_size, kv_dtype) if on_tpu else gpu_problems(block_size)
        if problems and auto:
            return None, "ragged kernel constraints unmet: " + "; ".join(problems)
        if problems:
            raise ValueError(f"attention_impl={impl}: the ragged kernel cannot run this model: " + "; ".join(problems))
    if on_tpu:  # interpret mode: the TPU simulator (DMAs and VMEM simulated, out-of-bounds reads raise)
        from jax.experimental.pallas import tpu as pltpu

        kernel = TpuRaggedAttention(mesh=mesh, kv_sharded=kv_sharded,
                                    interpret=pltpu.InterpretParams() if interpret else False)
    else:
        kernel = GpuRaggedAttention(mesh=mesh, kv_sharded=kv_sharded, interpret=interpret)
    what = "Pallas TPU (Mosaic)" if on_tpu else "Pallas GPU (Triton)"
    return kernel, (f"attention: ragged paged attention, {what} kernel{' in interpret mode' if interpret else ''}, "
                    f"one call per layer for every row of a step")
