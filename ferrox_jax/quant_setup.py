"""Which quantization an engine serves and which matmul kernels run it: the mode "auto" and
"gguf" resolve to (`resolve_quantization`), the KV cache's dtype that follows
(`resolve_kv_dtype`), and laying a quantized model's projections out for ferrox's x86 CPU
kernels where they apply (`int8_matmul`, `block_matmul`: each returns the start-up log line
saying which matmul runs). `ferrox_jax/engine_builder.py` calls these while it builds an
engine; nothing here holds state.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from ferrox_jax.config import EngineConfig
from models import cpu_kernels
from models.checkpoint import CheckpointSource
from models.cpu_isa import ENV as ISA_ENV, isa_cap

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}  # names -> jax dtypes


def int8_matmul(model: Any, config: EngineConfig, mesh: Any) -> str:
    """Lays a w8a8 model's projections out for the x86 CPU kernel where it applies
    (`models/cpu_kernels.py`); returns the start-up log line saying which matmul runs."""
    if config.quantization != "w8a8":
        return ""
    backend = jax.default_backend()
    if backend == "cpu" and config.int8_kernel == "xla":
        return "w8a8 projections: XLA's int8 dot (--int8-kernel xla)"
    problems = cpu_kernels.runtime_problems(backend, mesh)
    if not problems:
        packed = cpu_kernels.pack_for_kernel(model)
        return f"w8a8 projections: {packed} on the AVX2 int8 kernel (models/cpu_kernels.py)"
    if backend != "cpu":  # XLA fuses the int8 convert into its dot there: nothing to warn about
        return f"w8a8 projections: XLA's int8 dot on {backend}"
    note = "w8a8 projections: XLA's int8 dot, several times slower on CPU: " + "; ".join(problems)
    log.warning("%s", note)
    return note


def resolve_quantization(config: EngineConfig, source: CheckpointSource, mesh: Any) -> tuple[str, str]:
    """The mode to build ("auto" and "gguf" resolved) and a start-up note ("" for none).

    "auto": a GGUF whose projections are Q4_0 / Q4_1 / Q8_0 / K-quant / MXFP4 blocks, or an HF
    checkpoint with MXFP4 experts (gpt-oss), on one CPU device with ferrox's kernels, serves
    its own blocks ("gguf", `models/gguf_blocks.py`); anything else "none" (MXFP4 experts
    dequantized to float at load, as on TPU and GPU). "gguf" where it cannot apply (no such blocks, or tensor parallelism: the blocks
    have no sharding rule) serves float weights, with a warning."""
    mode = config.quantization
    if mode not in ("auto", "gguf"):
        return mode, ""
    backend = jax.default_backend()
    problems = [] if source.block_tensors else [
        "the checkpoint has no Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 projections"]
    if mesh is not None:
        problems.append("tensor parallelism (GGUF blocks have no sharding rule)")
    if mode == "auto":
        problems += cpu_kernels.runtime_problems(backend, mesh)
        if problems:
            return "none", ""
        return "gguf", "quantization auto -> gguf: the checkpoint's own blocks on the CPU block kernel"
    if problems:
        note = "quantization gguf -> none (float weights): " + "; ".join(problems)
        log.warning("%s", note)
        return "none", note
    return "gguf", ""


def resolve_kv_dtype(kv_cache_dtype: str | None, quantization: str, dtype):
    """The KV cache's dtype: `kv_cache_dtype` (a DTYPES name) when set; float16 for the "gguf" mode (already
    resolved) on a CPU, as llama.cpp's server keeps its cache; else the compute dtype.

    Why float16 there: a decode step's attention reads every cached key and value, and at
    32 rows that is as many bytes as the weights; 16-bit words halve it (the default model:
    32-row step 84 -> 77 ms). float16 keeps 11 significant bits to bfloat16's 8, and the
    CPU kernel converts it exactly (F16C); its accuracy against float32 is measured beside
    every other mode in docs/benchmarks.md. `--kv-cache-dtype float32` keeps float32."""
    if kv_cache_dtype:
        return DTYPES[kv_cache_dtype]
    if quantization == "gguf" and jax.default_backend() == "cpu":
        return jnp.float16
    return dtype


def block_matmul(model: Any, config: EngineConfig, mesh: Any) -> str:
    """Points a gguf model's block projections at the x86 block kernel where it applies
    (`models/cpu_kernels.py`); returns the start-up log line saying which matmul runs."""
    if config.quantization != "gguf":
        return ""
    problems = cpu_kernels.runtime_problems(jax.default_backend(), mesh)
    if not problems:
        packed = cpu_kernels.pack_blocks_for_kernel(model)
        rows, wide = cpu_kernels.block_int_rows(), cpu_kernels.block_wide_rows()
        if rows:
            paths = f"float32 activations below {rows} rows, 32-wide int8 activation blocks from there"
        elif wide and cpu_kernels.block_isa() == "AVX2":  # one row on integer dots (block_matmul_rowint256.inc)
            paths = "16-bit integer activations at one row, float32 from 2 rows"
        elif wide:  # wide_rows > 0 also puts one row on integer dots (block_matmul_rowint.inc)
            between = f", float32 from 2 to {wide - 1} rows" if wide > 2 else ""
            paths = (f"16-bit integer activations at one row{between}, 32-wide int16 activation blocks from "
                     f"{max(wide, 2)} ({cpu_kernels.BLOCK_ROWS16_RANGE} rows with rows and columns in the vector lanes)")
        else:
            paths = "float32 activations at every row count"
        if amx := cpu_kernels.block_amx_rows():
            paths += (f"; AMX-BF16 tiles (split bf16) from {amx} rows for weights of "
                      f"{cpu_kernels.BLOCK_AMX_MIN_K}+ inputs")
        k_quants = cpu_kernels.k_quant_count(model)
        # wide_rows 1 takes the AVX2 build's integer rows or the VNNI build's integer paths (an
        # AVX-512 CPU without VNNI runs neither: its float paths)
        if cpu_kernels.block_k_wide_rows() == 1 and cpu_kernels.block_k_isa() == "AVX2":
            k_acts = (f"16-bit integer activations at 1-{cpu_kernels.K_INT_ROWS_AVX2} rows, float32 from "
                      f"{cpu_kernels.K_INT_ROWS_AVX2 + 1}")
        elif cpu_kernels.block_k_wide_rows() == 1 and cpu_kernels.block_isa() == "AVX-512 VNNI":
            k_acts = "16-bit integer activations at every row count"
        else:
            k_acts = "float32 activations"
        k_note = (f"; of them {k_quants} K-quants, on the {cpu_kernels.block_k_isa()} K-quant kernel "
                  f"({k_acts})" if k_quants else "")
        if mxfp4 := cpu_kernels.k_quant_count(model, ("mxfp4",)):
            k_note += (f"; of them {mxfp4} MXFP4 (expert stacks), on the {cpu_kernels.block_mxfp4_isa()} "
                       "MXFP4 kernel (float32 activations)")
        if (cap := isa_cap()) != "native":
            k_note += f"; {ISA_ENV}={cap}"
        return f"gguf projections: {packed} on the {cpu_kernels.block_isa()} block kernel ({paths}){k_note}"
    note = "gguf projections: XLA dequantizes the blocks every step (slow): " + "; ".join(problems)
    log.warning("%s", note)
    return note
