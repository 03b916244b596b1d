"""Fused gate/up (FerroxBlockMatmulKMulti, one call for both weights) against two calls, at a
c8 decode step's rows, on 16 layers of Llama-3.2-1B-shaped Q4_K gate / up weights
([2048 -> 8192] each, random super-blocks: 302 MB, past the L3): in a chain whose every layer
depends on the one before (as the model's step runs them), and with the layers independent
(as tools/bench/profile_step.py's "kind" chains: XLA may then run the calls concurrently).
Alternated rounds, best and median per variant, the load average beside them.
  .venv/bin/python bench/kernels/ab_fused_k.py [ROWS [ROUNDS]]
"""
from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import cpu_kernels
from models.gguf_blocks import block_matmul, block_matmul_many, make_weight, with_kernel
from tests.support.kquant_blocks import random_k_blocks

cpu_kernels.require()

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
LAYERS, K, N = 16, 2048, 8192


def weight(seed):
    w = make_weight(random_k_blocks("q4_k", N, K, seed=seed), "q4_k", K)
    return with_kernel(w, cpu_kernels.BLOCK_K_TARGET,
                       0, wide_rows=cpu_kernels.block_k_wide_rows())


layers = [(weight(2 * i), weight(2 * i + 1)) for i in range(LAYERS)]


def pair(x, g, u, fused):
    return block_matmul_many(x, [g, u]) if fused else [block_matmul(x, g), block_matmul(x, u)]


def chain(fused):
    @jax.jit
    def run(x, ls):
        for g, u in ls:
            a, b = pair(x, g, u, fused)
            x = x + 1e-3 * (a[:, :K] * b[:, :K])
        return x
    return run


def independent(fused):
    @jax.jit
    def run(x, ls):
        total = 0.0
        for g, u in ls:
            for y in pair(x, g, u, fused):
                total = total + y[:, :8]
        return total
    return run


x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, K)) * 0.1, jnp.float32)
fns = {"chain fused": chain(True), "chain two calls": chain(False),
       "independent fused": independent(True), "independent two calls": independent(False)}
outs = {n: np.asarray(f(x, layers)) for n, f in fns.items()}
assert np.array_equal(outs["chain fused"], outs["chain two calls"]), "fusing changed a value"
samples = {n: [] for n in fns}
load0 = os.getloadavg()[0]
for _ in range(rounds):
    for n, f in fns.items():
        t = time.perf_counter()
        jax.block_until_ready(f(x, layers))
        samples[n].append((time.perf_counter() - t) * 1e3)
print(f"rows {rows}, {LAYERS} layers of gate/up Q4_K [{K} -> {N}] x 2, {rounds} alternated rounds, "
      f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
for n, s in samples.items():
    print(f"  {n:24s} best {min(s):7.2f} ms  median {np.median(s):7.2f} ms")
