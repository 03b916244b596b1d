"""How to run the experts of a mixture-of-experts layer: four ways measured at decode
and prefill shapes (the numbers behind the choice in models/moe.py).

  * all experts: every expert on every token, weighted by the (mostly zero) routing;
    the baseline, not a candidate (it computes E/k times the work);
  * gather: each (token, expert) pair gathers its expert's weights; reads one expert
    per pair;
  * ragged_dot: pairs sorted by expert, `jax.lax.ragged_dot` per projection;
  * tiles (models.moe.moe_mlp): pairs sorted by expert, each expert's run padded to
    whole tiles, a loop over the tiles in use, one expert's weights per tile.

Each is jitted once per shape and timed as the minimum of a few runs (ms per MoE block,
float32). Shapes: a Mixtral-like layer (E=8, top-2) and a Qwen3-MoE-like one (E=64,
top-8), scaled down to fit a small CPU.

    python -m tools.bench.bench_moe                     # both layers, T = 1 4 8 16 32 128
    python -m tools.bench.bench_moe --layer mixtral --tokens 1 32 --json moe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import silu
from models.moe import moe_mlp, route

LAYERS = {"mixtral": dict(d=1024, f=3584, e=8, k=2), "qwen3moe": dict(d=1024, f=384, e=64, k=8)}


def all_experts(x, router, gate, up, down, k):
    w, e = route(x, router, k, True)
    weights = jnp.zeros((x.shape[0], gate.shape[0]), jnp.float32).at[jnp.arange(x.shape[0])[:, None], e].add(w)
    h = jax.nn.silu(jnp.einsum("td,edf->etf", x, gate)) * jnp.einsum("td,edf->etf", x, up)
    return jnp.einsum("etd,te->td", jnp.einsum("etf,efd->etd", h, down), weights)


def gather(x, router, gate, up, down, k):
    w, e = route(x, router, k, True)
    idx = e.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)
    h = jax.nn.silu(jnp.einsum("nd,ndf->nf", xs, gate[idx])) * jnp.einsum("nd,ndf->nf", xs, up[idx])
    y = jnp.einsum("nf,nfd->nd", h, down[idx])
    return (y.reshape(x.shape[0], k, -1) * w[..., None]).sum(1)


def ragged(x, router, gate, up, down, k):
    w, e = route(x, router, k, True)
    flat = e.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    xs = x[token]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
    y = jax.lax.ragged_dot(h, down, sizes) * w.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


def tiles(x, router, gate, up, down, k, tile=None):
    return moe_mlp(x, router, gate, up, down, top_k=k, normalize=True, act=silu, tile=tile)


STRATEGIES = {"all experts": all_experts, "gather": gather, "ragged_dot": ragged,
              "tiles of 8": functools.partial(tiles, tile=8), "tiles of 32": functools.partial(tiles, tile=32),
              "tiles (tile_rows)": tiles}


def time_ms(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def bench_layer(name: str, tokens: list[int], reps: int, max_gather_bytes: float) -> dict:
    c = LAYERS[name]
    rng = np.random.RandomState(0)
    gate, up = (jnp.asarray(rng.randn(c["e"], c["d"], c["f"]) * 0.02, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.randn(c["e"], c["f"], c["d"]) * 0.02, jnp.float32)
    router = jnp.asarray(rng.randn(c["d"], c["e"]), jnp.float32)
    rows = {}
    for t in tokens:
        x = jnp.asarray(rng.randn(t, c["d"]), jnp.float32)
        args = (x, router, gate, up, down)
        ref = jax.jit(functools.partial(all_experts, k=c["k"]))(*args)
        row = {}
        for sname, fn in STRATEGIES.items():
            if sname == "gather" and t * c["k"] * 3 * c["d"] * c["f"] * 4 > max_gather_bytes:
                row[sname] = None  # gathered weights would not fit in memory
                continue
            jitted = jax.jit(functools.partial(fn, k=c["k"]))
            np.testing.assert_allclose(np.asarray(jitted(*args)), np.asarray(ref), atol=1e-4, rtol=1e-3,
                                       err_msg=f"{sname} disagrees with all experts")
            row[sname] = time_ms(jitted, args, reps if t < 128 else max(1, reps // 2))
        rows[t] = row
        print(f"{name} T={t:4d}  " + "  ".join(f"{s}={'-' if v is None else f'{v:.1f}'}" for s, v in row.items()),
              flush=True)
    return {"layer": c, "ms": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", choices=sorted(LAYERS), action="append")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 128])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-gather-gib", type=float, default=6.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = {name: bench_layer(name, args.tokens, args.reps, args.max_gather_gib * 2**30)
               for name in args.layer or list(LAYERS)}
    results["backend"] = jax.default_backend()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
