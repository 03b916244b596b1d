"""A prompt chunk's projections on a GGUF model, the K-quants' float panel against their 16-bit
integer path (bench/kernels/kquant_prefill.cc is the kernel-level harness).

    python -m bench.kernels.kquant_prefill_e2e --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf --rows 128

Loads the engine as `ferrox serve` does (the gguf mode on a CPU), then builds two views of the
same weights: wide_rows 1 (the default on AVX-512 VNNI: prompt chunks of 16+ rows on int16
activation blocks) and wide_rows 0 (float32 activations). Times one jit of every layer's
projections of a `--rows`-row chunk in the model's order (q/k/v and gate/up fused as the model
calls them, o, down; the LM head is left out: a prefill takes logits of its last row only), the
two views alternated per round, best and median of `--rounds`, with the largest difference of
the two outputs relative to max |float|. Then (unless `--no-prefill`) the engine's whole step
for one `--rows`-token prompt chunk at position 0 (`run_plan`: host batch, the compiled forward
with attention, norms and the last row's LM head, the sampler), each view's forward compiled for
that one shape (the runner's weights and compiled steps swapped per view), alternated likewise.
Timings move with the host's load: compare within one run. `--cpu-time` times in process CPU
time (all threads) instead of wall time: on a shared host a time slice lost to another
process is then not counted (wall-time samples read 1.0-2.4 s for the same chain at load 5 on
2 cores).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import cpu_kernels
from models.layers import project, project_many


def chain(model):
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    weights = [[getattr(layer, n).get_value() for n in names] for layer in model.layers]

    @jax.jit
    def run(x, weights):
        for wq, wk, wv, wo, wg, wu, wd in weights:
            q, k, v = project_many(x, [wq, wk, wv])
            x = x + 0.01 * project(q + jnp.mean(k) + jnp.mean(v), wo)
            g, u = project_many(x, [wg, wu])
            x = x + 0.01 * project(g * jax.nn.sigmoid(u), wd)
        return x

    return lambda x: run(x, weights)


def main(argv: list[str] | None = None) -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--no-prefill", action="store_true", help="time the projections only")
    p.add_argument("--cpu-time", action="store_true", help="process CPU time (all threads), not wall time")
    args = p.parse_args(argv)
    clock = time.process_time if args.cpu_time else time.perf_counter
    engine = Engine.load(EngineConfig(model=args.model, quantization="auto", max_context=512, max_seqs=1))
    runner = engine.runner
    views = {}
    for wide in (1, 0):
        model = nnx.merge(runner.graphdef, runner.state)
        cpu_kernels.pack_blocks_for_kernel(model, wide_rows=wide)
        views[wide] = chain(model)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((args.rows, model.cfg.hidden_size)), jnp.float32)
    outs = {w: np.asarray(jax.block_until_ready(f(x))) for w, f in views.items()}
    samples = {w: [] for w in views}
    for _ in range(args.rounds):
        for w, f in views.items():
            t = clock()
            jax.block_until_ready(f(x))
            samples[w].append((clock() - t) * 1e3)
    diff = float(np.abs(outs[1] - outs[0]).max() / np.abs(outs[0]).max())
    prefill = {} if args.no_prefill else prefill_step(runner, args.rows, args.rounds, clock)
    print(f"{args.model} {args.rows} rows, {len(model.layers)} layers' projections, "
          f"best / median of {args.rounds} alternated rounds")
    for w, name in ((0, "float32 activations (wide_rows 0)"), (1, "16-bit integer path (wide_rows 1)")):
        print(f"  {name}: {min(samples[w]):.1f} / {np.median(samples[w]):.1f} ms")
    print(f"  speed-up (best) {min(samples[0]) / min(samples[1]):.2f}x, median "
          f"{np.median(samples[0]) / np.median(samples[1]):.2f}x; max |diff| / max |float| {diff:.1e}")
    for w, name in ((0, "float32 activations"), (1, "16-bit integer path")):
        if w in prefill:
            print(f"  whole {args.rows}-token prefill step, {name}: {min(prefill[w]):.1f} / "
                  f"{np.median(prefill[w]):.1f} ms")
    if prefill:
        print(f"  prefill speed-up (best) {min(prefill[0]) / min(prefill[1]):.2f}x, median "
              f"{np.median(prefill[0]) / np.median(prefill[1]):.2f}x")
    return 0


def prefill_step(runner, rows: int, rounds: int, clock=time.perf_counter) -> dict[int, list[float]]:
    """ms of the engine's step for one `rows`-token chunk, per view (wide_rows 1, 0), alternated."""
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling
    from ferrox_jax.step_output import run_plan

    runner._store = None  # a stored executable is keyed by shape alone: compile each view's own
    base = runner.state
    views = {}
    for wide in (1, 0):
        model = nnx.merge(runner.graphdef, base)
        cpu_kernels.pack_blocks_for_kernel(model, wide_rows=wide)
        state = nnx.state(model)
        leaves, tree = jax.tree.flatten(state)
        views[wide] = (state, leaves, tree, {})
    blocks = tuple(range(1, 2 + rows // runner.block_size))
    plan = StepPlan(chunks=(RowPlan(row_id=0, token_ids=tuple(range(1000, 1000 + rows)), start_pos=0,
                                    block_ids=blocks, sample=True, sampling=RowSampling(temperature=0.0)),))

    def use(wide):
        runner._state, runner._state_leaves, runner._state_tree, runner._compiled = views[wide]

    for wide in views:
        use(wide)
        run_plan(runner, plan)  # compiles this view's shape
    samples = {w: [] for w in views}
    for _ in range(rounds):
        for w in views:
            use(w)
            t = clock()
            run_plan(runner, plan)
            samples[w].append((clock() - t) * 1e3)
    return samples


if __name__ == "__main__":
    raise SystemExit(main())
