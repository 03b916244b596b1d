"""The LoRA slot layout probe behind models/lora.py: a 30-layer chain of the default model's seven
projections (D 576, F 1536, KV 192) at 1 and 32 rows, without LoRA ("base"), with slots stacked
as [S, in, r] / [S, r, out] ("3d") and flat [in, S*r] / [S*r, out] ("flat"); 5 slots, rank 16.
Best of 5 x 5 calls, ms.  python bench/lora/layout_probe.py"""
import time, jax, jax.numpy as jnp, numpy as np
D, F, Q, KV, L, S, R = 576, 1536, 576, 192, 30, 5, 16
shapes = [(D, Q), (D, KV), (D, KV), (Q, D), (D, F), (D, F), (F, D)]
key = jax.random.key(0)
W = [[jax.random.normal(key, s) * 0.02 for s in shapes] for _ in range(L)]
A3 = [[jax.random.normal(key, (S, i, R)) * 0.02 for i, o in shapes] for _ in range(L)]
B3 = [[jax.random.normal(key, (S, R, o)) * 0.02 for i, o in shapes] for _ in range(L)]
Af = [[a.transpose(1, 0, 2).reshape(a.shape[1], S * R) for a in l] for l in A3]
Bf = [[b.reshape(S * R, -1) for b in l] for l in B3]

def run(x, W, A, B, slots, mode):
    if mode == "flat":
        mask = jnp.repeat(slots[:, None] == jnp.arange(S)[None], R, axis=1)  # [N, S*R]
    for l in range(L):
        h = x
        outs = []
        for j, (i, o) in enumerate(shapes):
            inp = h if i == D else (outs[-1] if i == F else h)
            y = inp @ W[l][j]
            if mode == "3d":
                u = jnp.einsum("ni,sir->nsr", inp, A[l][j])
                own = slots[:, None, None] == jnp.arange(S)[None, :, None]
                y = y + jnp.einsum("nsr,sro->no", jnp.where(own, u, 0.0), B[l][j])
            elif mode == "flat":
                y = y + jnp.where(mask, inp @ A[l][j], 0.0) @ B[l][j]
            outs.append(y)
        x = x + jnp.tanh(outs[3][:, :D]) * 0.01 + outs[6] * 0.01
    return x

for n in (1, 32):
    x = jax.random.normal(key, (n, D)); slots = jnp.asarray(np.arange(n) % S, jnp.int32)
    res = {}
    for mode, A, B in (("base", A3, B3), ("3d", A3, B3), ("flat", Af, Bf)):
        f = jax.jit(lambda x, W, A, B, s, mode=mode: run(x, W, A, B, s, mode))
        jax.block_until_ready(f(x, W, A, B, slots))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter(); 
            for _ in range(5): jax.block_until_ready(f(x, W, A, B, slots))
            ts.append((time.perf_counter() - t0) / 5 * 1e3)
        res[mode] = round(min(ts), 2)
    print(n, res, flush=True)
