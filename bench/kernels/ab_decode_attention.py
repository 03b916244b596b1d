"""In-process A/B of two builds of the kernel library's decode attention.

    cp models/kernels/_ferrox_cpu.so /tmp/A.so      # before the change
    .venv/bin/python -m models.cpu_kernels && cp models/kernels/_ferrox_cpu.so /tmp/B.so
    .venv/bin/python bench/kernels/ab_decode_attention.py /tmp/A.so /tmp/B.so

Both builds are loaded into one process under their own FFI target names and timed
interleaved (25 rounds, median), so the machine's drift hits both alike. Each case runs
the default model's attention shape (9 heads, 3 kv heads, head_dim 64, blocks of 16)
over 30 layers' own caches, as a decode step does, so the keys and values come from
memory, not from a cache the previous call warmed. Prints A and B in ms per 30 layers,
A/B, and the largest difference between the two builds' outputs. Environment: SHAPE
"heads,kv_heads,head_dim,block_size,layers" (default "9,3,64,16,30"; the 1B: "32,8,64,16,16"),
CASES "rows:context,..." and DTYPES (f32, bf16, f16) pick other cases; SHUFFLE=1 hands the rows
their blocks in a random order (a cache whose blocks were freed and reused), not consecutively.
CHUNK=1 makes each case a prompt chunk instead: `rows` query tokens of one sequence that share
its block table, at positions ctx .. ctx + rows - 1 (the kernel's SharedRows path, as
`models.cpu_attention.CpuDecodeAttention.chunks` calls it), e.g. CHUNK=1 CASES=128:1920 DTYPES=f16.
"""
import ctypes
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

for name, path in (("attA", sys.argv[1]), ("attB", sys.argv[2])):
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.FerroxDecodeAttention), platform="cpu")
import os
H, K, hd, bs, layers = [int(v) for v in os.environ.get("SHAPE", "9,3,64,16,30").split(",")]
def case(rows, ctx, dtype):
    rng = np.random.default_rng(0)
    chunk = bool(os.environ.get("CHUNK"))
    width = -(-(ctx + rows) // bs) if chunk else -(-ctx // bs)
    nblocks = (1 if chunk else rows) * width + 1
    caches = []
    for _ in range(layers):
        k = rng.standard_normal((K, nblocks, bs, hd)).astype(np.float32)
        v = rng.standard_normal((K, nblocks, bs, hd)).astype(np.float32)
        if dtype == "bf16":
            k, v = (jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.bfloat16), jnp.uint16) for x in (k, v))
        if dtype == "f16":
            k, v = (jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float16), jnp.int16) for x in (k, v))
        caches.append((jnp.asarray(k), jnp.asarray(v)))
    ids = 1 + np.arange(nblocks - 1)
    if os.environ.get("SHUFFLE"):  # a cache whose blocks were freed and handed out again in no order
        ids = np.random.default_rng(1).permutation(ids)
    if chunk:  # one sequence's table for every query token; token i sees ctx + i + 1 keys
        tables = jnp.asarray(np.tile(ids, (rows, 1)).astype(np.int32))
        lengths = jnp.asarray(ctx + 1 + np.arange(rows), jnp.int32)
    else:
        tables = jnp.asarray(ids.reshape(rows, width).astype(np.int32))
        lengths = jnp.full((rows,), ctx, jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, H, hd)).astype(np.float32))
    def make(target):
        @jax.jit
        def f(q, caches):
            for k, v in caches:
                q = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, v, tables, lengths, scale=np.float32(0.125)) + q
            return q
        return f
    fa, fb = make("attA"), make("attB")
    ya, yb = fa(q, caches), fb(q, caches)
    err = float(jnp.max(jnp.abs(ya - yb)))
    ta, tb = [], []
    for _ in range(25):
        for f, t in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter(); jax.block_until_ready(f(q, caches)); t.append(time.perf_counter() - t0)
    a, b = np.median(ta) * 1e3, np.median(tb) * 1e3
    print(f"{'chunk of' if chunk else 'rows'} {rows} ctx {ctx} {dtype}: A {a:.2f} ms  B {b:.2f} ms  A/B {a/b:.2f}  max|diff| {err:.2g}", flush=True)
CASES = os.environ.get("CASES", "1:256,1:1000,1:2000,8:500,32:256,32:1000")
for rows, ctx in (tuple(int(v) for v in c.split(":")) for c in CASES.split(",")):
    for dt in os.environ.get("DTYPES", "f32,bf16").split(","):
        case(rows, ctx, dt)
