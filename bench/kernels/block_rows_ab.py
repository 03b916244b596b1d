"""A model's projections at R rows on this build's block kernel against another build's, in one
process, alternated (the A/B of a kernel change on a shared host).

    PYTHONPATH=. python bench/kernels/block_rows_ab.py /work/gguf/llama-3.2-1b-Q4_0.gguf \\
        --old-lib /tmp/rows_old/models/kernels/_ferrox_cpu.so --rows 8 12 5 --rounds 15

Loads the file as `ferrox serve` does, registers the other build's block kernel as a second
FFI target, and times tools/bench/profile_step.py's chain of a decode step's projections (every
layer's q, k, v, o, gate, up, down and the LM head, in the step's data flow, with a weightless RMS
norm after each residual add so the values stay finite; one kernel call a
weight on both sides, since the second target has no multi-weight handler) with every block
weight on one build, then on the other, the order swapped each round. Prints the best and
median ms per chain and side, and whether the two sides' outputs are the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import cpu_kernels
from models.gguf_blocks import BlockQuantizedWeight, with_kernel
from models.layers import project

OLD_TARGET = "ferrox_block_matmul_ab_old"


def chain(model, target: str):
    """The step's projections with every block-kernel weight on `target`."""
    def point(w):
        if isinstance(w, BlockQuantizedWeight) and w.kernel == cpu_kernels.BLOCK_TARGET:
            return with_kernel(w, target, w.int_rows, w.amx_rows, w.wide_rows)
        return w

    cfg = model.cfg
    head = model.tied_lm_head.get_value() if cfg.tie_word_embeddings else model.lm_head.get_value()
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    weights = [[point(getattr(layer, n).get_value()) for n in names] for layer in model.layers]
    head = point(head)

    @jax.jit
    def run(x, weights, head):
        def norm(v):  # keeps the chain's values finite over the layers (no weights: the step's norms)
            return v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6)

        for wq, wk, wv, wo, wg, wu, wd in weights:
            q, k, v = project(x, wq), project(x, wk), project(x, wv)
            x = norm(x + project(q + jnp.mean(k) + jnp.mean(v), wo))
            x = norm(x + project(project(x, wg) * project(x, wu), wd))
        return project(x, head)

    return lambda x: run(x, weights, head)


def main() -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--old-lib", required=True, help="the other build's _ferrox_cpu.so")
    p.add_argument("--rows", type=int, nargs="+", default=[8])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()

    lib = ctypes.cdll.LoadLibrary(args.old_lib)
    jax.ffi.register_ffi_target(OLD_TARGET, jax.ffi.pycapsule(lib.FerroxBlockMatmul), platform="cpu")
    engine = Engine.load(EngineConfig(model=args.model, max_seqs=max(args.rows), max_context=512))
    model = nnx.merge(engine.runner.graphdef, engine.runner.state)
    sides = {"new": chain(model, cpu_kernels.BLOCK_TARGET), "old": chain(model, OLD_TARGET)}
    for rows in args.rows:
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, model.cfg.hidden_size)), jnp.float32)
        outs = {name: np.asarray(fn(x)) for name, fn in sides.items()}  # compile, warm
        same = np.array_equal(outs["new"], outs["old"])
        times = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in (("new", "old") if r % 2 else ("old", "new")):
                t = time.perf_counter()
                jax.block_until_ready(sides[name](x))
                times[name].append(1e3 * (time.perf_counter() - t))
        best = {n: min(v) for n, v in times.items()}
        med = {n: float(np.median(v)) for n, v in times.items()}
        print(f"{rows} rows: old best / median {best['old']:.1f} / {med['old']:.1f} ms, new {best['new']:.1f} / "
              f"{med['new']:.1f} ms ({best['old'] / best['new']:.2f}x / {med['old'] / med['new']:.2f}x), "
              f"outputs {'the same bits' if same else 'DIFFER: max ' + str(np.abs(outs['new'] - outs['old']).max())}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
