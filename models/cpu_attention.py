"""The decode attention object the model calls on an x86 CPU: `models/kernels/decode_attention.cc`
(AVX2, or AVX-512 where the CPU has it) behind the XLA FFI target `models/cpu_kernels.py`
registers. One query per row over the paged KV cache, and prompt chunks as rows that share a
table; a head size or cache dtype the kernel cannot read falls back to the pure-JAX
`paged_attention`. Chosen by `models/pallas_attention.py:select_decode_attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models import cpu_kernels
from models.attention import KV_WORD_FLOATS, check_decode_inputs, paged_attention


def attention_problems(head_dim: int, kv_dtype) -> list[str]:
    """Why the decode attention cannot serve this model ([] when it can)."""
    problems = []
    if head_dim % 8:
        problems.append(f"head_dim {head_dim} is not a multiple of 8")
    if jnp.dtype(kv_dtype) not in (jnp.dtype(jnp.float32), *map(jnp.dtype, KV_WORD_FLOATS.values())):
        problems.append(f"KV cache dtype {jnp.dtype(kv_dtype).name} (the kernel reads float32, bfloat16 or float16)")
    return problems


def _kernel_reads(head_dim: int, k_cache) -> bool:
    """Whether the kernel reads this head size and cache storage (float32, or the uint16 /
    int16 words of a bfloat16 / float16 cache); `attention_problems` says the same from the
    logical dtype."""
    return head_dim % 8 == 0 and (k_cache.dtype == jnp.float32 or k_cache.dtype in KV_WORD_FLOATS)


@dataclasses.dataclass(frozen=True)
class CpuDecodeAttention:
    """Decode attention (one query per row) via `decode_attention.cc`. Hashable: static.
    A head size or cache dtype the kernel cannot read (`attention_problems`) takes the
    pure-JAX path instead, so the object is safe to hand any model. `avx2` forces the
    kernel's AVX2 build (tests compare it with the AVX-512 one on one host)."""

    avx2: bool = False

    def __call__(self, q, k_cache, v_cache, block_tables, positions, scale: float):
        """Same contract as `models.attention.paged_attention` for T == 1.

        Args:
          q: [B, 1, H, hd] rotated queries; k_cache, v_cache: [K, N, bs, hd], float32,
            uint16 or int16 (bfloat16 / float16 words, the CPU storage of a 16-bit cache).
          block_tables: i32[B, MB]; positions: i32[B, 1] (key s visible iff s <= position).
        Returns:
          f32[B, 1, H, hd].
        """
        check_decode_inputs(q, k_cache, v_cache)
        b, _, num_heads, head_dim = q.shape
        if not _kernel_reads(head_dim, k_cache):
            return paged_attention(q, k_cache, v_cache, block_tables, positions, scale)
        out = jax.ShapeDtypeStruct((b, num_heads, head_dim), jnp.float32)
        lengths = (positions[:, 0] + 1).astype(jnp.int32)
        target = cpu_kernels.ATTENTION_AVX2_TARGET if self.avx2 else cpu_kernels.ATTENTION_TARGET
        y = jax.ffi.ffi_call(target, out)(q[:, 0].astype(jnp.float32), k_cache, v_cache,
                                                    block_tables.astype(jnp.int32), lengths,
                                                    scale=np.float32(scale))
        return y.reshape(b, 1, num_heads, head_dim)

    def chunks(self, q, k_cache, v_cache, block_tables, positions, valid, scale: float):
        """`paged_attention`'s contract for T >= 1 (no window, no soft-cap): prompt chunks
        on the same kernel. Each query token becomes a one-query row of its own (its row's
        block table, length position + 1): the keys it may see are exactly its causal
        prefix, read in place. The chunk's rows share one table, so the kernel walks their
        keys once, in tiles, for all of them (decode_attention_shared.inc), where XLA's path
        gathered them and computed masked scores for a whole chunk of blocks.
        Padding tokens (valid False) read one key and give zeros.

        Args:
          q: [B, T, H, hd]; k_cache, v_cache: as `__call__`; block_tables: i32[B, MB];
          positions: i32[B, T]; valid: bool[B, T].
        Returns:
          f32[B, T, H, hd].
        """
        b, t, num_heads, head_dim = q.shape
        if not _kernel_reads(head_dim, k_cache):
            return paged_attention(q, k_cache, v_cache, block_tables, positions, scale, valid=valid)
        rows = jnp.repeat(block_tables, t, axis=0)  # [B T, MB]: token i of row r reads row r's table
        first = jnp.where(valid, positions, 0).reshape(b * t, 1)
        out = self(q.reshape(b * t, 1, num_heads, head_dim), k_cache, v_cache, rows, first, scale)
        return jnp.where(valid[:, :, None, None], out.reshape(b, t, num_heads, head_dim), 0.0)


def decode_attention(avx2: bool = False) -> CpuDecodeAttention:
    """The attention object (raises RuntimeError where the kernels cannot run); `avx2` forces
    the kernel's AVX2 build."""
    cpu_kernels.require()
    return CpuDecodeAttention(avx2)
