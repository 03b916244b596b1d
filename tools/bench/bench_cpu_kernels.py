"""Side-by-side timings of ferrox's x86 CPU kernels (models/cpu_kernels.py) against XLA.

    python -m tools.bench.bench_cpu_kernels                 # all the tables
    python -m tools.bench.bench_cpu_kernels --only steps --rows 1 32
    python -m tools.bench.bench_cpu_kernels --only kquants   # the K-quant formats, 1 and 32 rows

Tables (median of --repeats calls, one process, interleaved per line so that load on a
shared machine hits both sides alike):
  products   one w8a8 projection of the default model's shapes: XLA's int8 dot (1 row padded
             to 2) against the int8 matmul kernel, in µs and GB/s of int8 weights
  attention  one layer's decode attention (9 heads, 3 kv heads, head_dim 64, blocks of 16):
             the pure-JAX paged attention against the kernel, float32 and bfloat16 caches
  blocks     one projection on GGUF blocks (models/gguf_blocks.py; Q4_1, the LM head Q8_0):
             the w8a8 matmul kernel beside the block kernel's float path, integer path and
             (where the CPU has AMX-BF16) AMX path, in µs and GB/s of the bytes each reads
  kquants    one projection on K-quant super-blocks (models/gguf_kquants.py; Q4_K, Q5_K,
             Q6_K; 1 to 3 rows take the kernel's row path on AVX-512, and the weights here
             fit the L3, so this is not the DRAM rate: bench/kernels/kquant_stream.cc
             measures that) beside Q4_1's block kernel on the same shape: XLA's dequantize + dot and
             the K-quant kernel, in µs and GB/s of the bytes read, with the kernel's error
             against float64 in float32 ulps of sum |x||w| (the accuracy beside the speed)
  steps      the default model's whole decode step (`ModelRunner.run`, greedy): float32,
             w8a8 on XLA and on the kernels, and gguf on the block kernel
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ferrox_jax.step_output import run_plan
from models import cpu_attention, cpu_kernels
from models.attention import paged_attention
from models.quant import quantize, quantized_matmul

PRODUCTS = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


def median_us(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e6)


def products(rows: list[int], repeats: int) -> None:
    print("| rows | [K, N] | XLA int8 dot (µs) | kernel (µs) | kernel GB/s | speed-up |\n|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    matmul = jax.jit(quantized_matmul)
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, 576)).astype(np.float32))
        for k, n in PRODUCTS:
            xk = x if k == 576 else jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            qw = quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) * 0.05), "w8a8")
            packed = cpu_kernels.pack(qw)
            xla = median_us(matmul, xk, qw, repeats=repeats)
            ours = median_us(matmul, xk, packed, repeats=repeats)
            print(f"| {m} | [{k}, {n}] | {xla:,.0f} | {ours:,.0f} | {k * n / ours / 1e3:.1f} | {xla / ours:.1f} × |")


def blocks(rows: list[int], repeats: int) -> None:
    from models.gguf_blocks import block_matmul, make_weight, with_kernel
    from tests.models.test_block_matmul import random_blocks

    amx, wide = cpu_kernels.block_amx(), cpu_kernels.block_isa() == "AVX-512 VNNI"
    print("| rows | [K, N] fmt | w8a8 kernel (µs) | blocks, float path (µs) | blocks, integer path (µs) "
          + ("| blocks, 16-bit path (µs) " if wide else "") + ("| blocks, AMX-BF16 path (µs) " if amx else "")
          + "| float path GB/s |\n|---|---|---|---|---|" + ("---|" if wide else "") + ("---|" if amx else "") + "---|")
    rng = np.random.default_rng(0)
    matmul, blocked = jax.jit(quantized_matmul), jax.jit(block_matmul)
    for m in rows:
        for k, n in PRODUCTS:
            fmt = "q8_0" if n == 49152 else "q4_1"
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            packed = cpu_kernels.pack(quantize(jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)), "w8a8"))
            w = make_weight(random_blocks(fmt, n, k), fmt, k)
            w8 = median_us(matmul, x, packed, repeats=repeats)
            fl = median_us(blocked, x, with_kernel(w, cpu_kernels.BLOCK_TARGET, 0), repeats=repeats)
            it = median_us(blocked, x, with_kernel(w, cpu_kernels.BLOCK_TARGET, 1), repeats=repeats)
            on_wide = with_kernel(w, cpu_kernels.BLOCK_TARGET, 0, wide_rows=1)
            wd = f"{median_us(blocked, x, on_wide, repeats=repeats):,.0f} | " if wide else ""
            am = (f"{median_us(blocked, x, with_kernel(w, cpu_kernels.BLOCK_TARGET, 0, 1), repeats=repeats):,.0f} | "
                  if amx else "")
            print(f"| {m} | [{k}, {n}] {fmt} | {w8:,.0f} | {fl:,.0f} | {it:,.0f} | {wd}{am}{w.nbytes / fl / 1e3:.1f} |")


# SmolLM2's ffn_down; a 1B model's square, gate / up and down projections
K_PRODUCTS = ((1536, 576), (2048, 2048), (2048, 8192), (8192, 2048))


def alternating_us(calls: list, repeats: int) -> list[float]:
    """Median µs of each zero-argument call, timed in alternating rounds (one call of each per
    round), so that load on a shared machine hits every variant alike."""
    for call in calls:
        jax.block_until_ready(call())
    times = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            t = time.perf_counter()
            jax.block_until_ready(call())
            times[i].append(time.perf_counter() - t)
    return [float(np.median(t) * 1e6) for t in times]


def kquants(rows: list[int], repeats: int) -> None:
    from models.gguf_blocks import block_matmul, dequantize_host, make_weight, with_kernel
    from tests.support.kquant_blocks import random_k_blocks
    from tests.models.test_block_matmul import random_blocks

    print("| rows | [K, N] | fmt | XLA dequantize + dot (µs) | kernel (µs) | kernel GB/s "
          "| kernel max error (f32 ulps of Σ|x||w|) |\n|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    blocked = jax.jit(block_matmul)
    eps = float(np.finfo(np.float32).eps)
    formats = ("q4_1", "q4_k", "q5_k", "q6_k")
    for m in rows:
        for k, n in K_PRODUCTS:
            x = rng.standard_normal((m, k)).astype(np.float32)
            xj = jnp.asarray(x)
            raws = {f: random_blocks(f, n, k) if f == "q4_1" else random_k_blocks(f, n, k) for f in formats}
            plain = {f: make_weight(raws[f], f, k) for f in formats}
            kernels = {f: with_kernel(plain[f], cpu_kernels.block_target(f), 0) for f in formats}
            calls = [functools.partial(blocked, xj, w) for f in formats for w in (plain[f], kernels[f])]
            us = alternating_us(calls, repeats)
            for i, f in enumerate(formats):
                wd = dequantize_host(raws[f], f)
                err = np.abs(np.asarray(blocked(xj, kernels[f])) - x.astype(np.float64) @ wd.T)
                ulps = float((err / (eps * (np.abs(x).astype(np.float64) @ np.abs(wd).T))).max())
                xla, ours = us[2 * i], us[2 * i + 1]
                print(f"| {m} | [{k}, {n}] | {f} | {xla:,.0f} | {ours:,.0f} | {plain[f].nbytes / ours / 1e3:.1f} "
                      f"| {ulps:.2f} |", flush=True)


def attention(rows: list[int], contexts: list[int], repeats: int) -> None:
    print("| rows | context | KV dtype | pure JAX (µs) | kernel (µs) | speed-up |\n|---|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    kernel = jax.jit(cpu_attention.decode_attention(), static_argnums=(5,))
    reference = jax.jit(paged_attention, static_argnums=(5,))
    for b in rows:
        width = max(contexts) // bs + 8
        width += -width % 8  # paged_attention walks 8 blocks per iteration
        blocks = b * width + 1
        for kv_dtype in (jnp.float32, jnp.bfloat16):
            k, v = (jnp.asarray(rng.standard_normal((kv_heads, blocks, bs, hd)).astype(np.float32)) for _ in "kv")
            if kv_dtype == jnp.bfloat16:  # the CPU storage of a bfloat16 cache
                k, v = (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16) for x in (k, v))
            tables = jnp.asarray(1 + np.arange(b * width, dtype=np.int32).reshape(b, width))
            q = jnp.asarray(rng.standard_normal((b, 1, heads, hd)).astype(np.float32))
            for ctx in contexts:
                pos = jnp.full((b, 1), ctx - 1, jnp.int32)
                ref = median_us(reference, q, k, v, tables, pos, hd ** -0.5, repeats=repeats)
                ours = median_us(kernel, q, k, v, tables, pos, hd ** -0.5, repeats=repeats)
                name = jnp.dtype(kv_dtype).name
                print(f"| {b} | {ctx} | {name} | {ref:,.0f} | {ours:,.0f} | {ref / ours:.1f} × |")


def steps(rows: list[int], contexts: list[int], repeats: int) -> None:
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling
    from ferrox_jax.runner import ModelRunner
    from models.loader import open_checkpoint

    source = open_checkpoint("default")
    variants = {"float32 + attention kernel": ("none", False, True), "w8a8, XLA": ("w8a8", False, False),
                "w8a8, matmul + attention kernels": ("w8a8", True, True),
                "gguf blocks + attention kernels": ("gguf", True, True)}
    if cpu_kernels.block_amx():  # the default model's weights are too narrow for the default's tiles
        variants["gguf blocks, AMX from 16 rows"] = ("gguf-amx16", True, True)
    runners = {}
    for name, (mode, matmul, attend) in variants.items():
        model = source.build(quantization=mode.removesuffix("-amx16"),
                             decode_attention=cpu_attention.decode_attention() if attend else None)
        if matmul and mode == "w8a8":
            cpu_kernels.pack_for_kernel(model)
        if matmul and mode.startswith("gguf"):
            cpu_kernels.pack_blocks_for_kernel(model, amx_rows=16 if mode.endswith("-amx16") else None)
        runners[name] = ModelRunner(model, num_blocks=40 * max(rows) + 1, block_size=16, max_rows=max(rows),
                                    max_chunk_tokens=16, max_context=640)
    print("| rows | context | " + " | ".join(f"{n} (ms)" for n in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    greedy = RowSampling(temperature=0.0)
    for b in rows:
        tables = [tuple(range(1 + i * 40, 1 + (i + 1) * 40)) for i in range(b)]
        for ctx in contexts:
            def plan(pos):
                return StepPlan(decode=tuple(RowPlan(row_id=i, token_ids=(7,), start_pos=pos, block_ids=tables[i],
                                                     sample=True, sampling=greedy) for i in range(b)))
            cells = []
            for runner in runners.values():
                run_plan(runner, plan(ctx))
                times = []
                for s in range(repeats):
                    t = time.perf_counter()
                    run_plan(runner, plan(ctx + s))
                    times.append(time.perf_counter() - t)
                cells.append(f"{np.median(times) * 1e3:.1f}")
            print(f"| {b} | {ctx} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("products", "blocks", "kquants", "attention", "steps"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8, 192, 500])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if (reason := cpu_kernels.unavailable_reason()) is not None:
        raise SystemExit(f"bench_cpu_kernels: {reason}")
    if args.only in (None, "products"):
        products(args.rows, args.repeats)
    if args.only in (None, "blocks"):
        blocks(args.rows, args.repeats)
    if args.only in (None, "kquants"):
        kquants(args.rows, args.repeats)
    if args.only in (None, "attention"):
        attention(args.rows, args.contexts, args.repeats)
    if args.only in (None, "steps"):
        steps(args.rows, args.contexts, args.repeats)


if __name__ == "__main__":
    main()
