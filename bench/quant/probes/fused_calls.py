# Upper bound for fusing q/k/v and gate/up into one kernel call: separate calls vs one call on
# row-concatenated blocks, 30 layers of SmolLM2-135M shapes, Q4_1, alternated rounds.
# Run from the repository root: .venv/bin/python bench/quant/probes/fused_calls.py
import os, sys, time, numpy as np, jax, jax.numpy as jnp
from models import cpu_kernels
from models.gguf_blocks import make_weight, with_kernel, block_matmul, row_bytes
cpu_kernels.require()
rng = np.random.default_rng(0)
def blocks(n, k=576):
    b = rng.integers(0, 256, (n, k // 32, 20), dtype=np.uint8)
    b[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    b[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    return b.reshape(n, -1)
L = 30
IR = cpu_kernels.block_int_rows()
W = lambda b, k=576: with_kernel(make_weight(b, "q4_1", k), cpu_kernels.BLOCK_TARGET, IR)
layers = []
for _ in range(L):
    q, k, v, g, u = blocks(576), blocks(192), blocks(192), blocks(1536), blocks(1536)
    layers.append(dict(q=W(q), k=W(k), v=W(v), g=W(g), u=W(u), qkv=W(np.concatenate([q, k, v])), gu=W(np.concatenate([g, u]))))
def sep(x, ls):
    for l in ls:
        q, k, v = block_matmul(x, l["q"]), block_matmul(x, l["k"]), block_matmul(x, l["v"])
        g, u = block_matmul(x, l["g"]), block_matmul(x, l["u"])
        x = x + 1e-3 * (q + jnp.tile(k + v, 3) + g[:, :576] * u[:, :576])
    return x
def cat(x, ls):
    for l in ls:
        qkv, gu = block_matmul(x, l["qkv"]), block_matmul(x, l["gu"])
        q, k, v = qkv[:, :576], qkv[:, 576:768], qkv[:, 768:]
        g, u = gu[:, :1536], gu[:, 1536:]
        x = x + 1e-3 * (q + jnp.tile(k + v, 3) + g[:, :576] * u[:, :576])
    return x
for rows in [int(r) for r in sys.argv[1].split(",")]:
    x = np.asarray(rng.standard_normal((rows, 576)), np.float32)
    fs = {n: jax.jit(f).lower(x, layers).compile() for n, f in (("sep", sep), ("cat", cat))}
    np.testing.assert_allclose(np.asarray(fs["sep"](x, layers)), np.asarray(fs["cat"](x, layers)), rtol=1e-4, atol=1e-4)
    res = {n: [] for n in fs}
    for rnd in range(int(os.environ.get("ROUNDS", "10"))):
        for n, f in fs.items():
            ts = []
            for _ in range(30):
                t = time.perf_counter(); f(x, layers).block_until_ready(); ts.append(time.perf_counter() - t)
            res[n].append(np.median(ts) * 1e3)
    s, c = np.array(res["sep"]), np.array(res["cat"])
    print(f"rows {rows}: separate {np.median(s):.3f} ms, concatenated {np.median(c):.3f} ms, sep/cat {np.median(s/c):.3f} ({np.min(s/c):.3f}-{np.max(s/c):.3f})", flush=True)
