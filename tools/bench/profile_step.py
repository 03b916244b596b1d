"""Where one decode step goes: the real runner's step, split into its parts, on one model.

    python -m tools.bench.profile_step --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf --rows 1 --context 128

Loads the engine as `ferrox serve` would (`--quantization auto`: the gguf mode on a CPU),
compiles only the shapes it runs, and times, in rounds that alternate the parts so that a
shared machine's load hits all of them alike (best and median of `--rounds`):

  step       the whole tick as `run_plan` drives it (host batch, pad, dispatch, sample, fetch)
  host       HostBatch.build + padding: the Python side before dispatch
  forward    the compiled forward alone (inputs already padded; blocks until its logits are ready)
  sample     the compiled sampler and the one `device_get` (what follows the forward)
  matmuls    a jitted chain of exactly the step's projections on the model's own weights
             (q/k/v and gate/up as the model calls them, o, down, the LM head), nothing else;
             "matmuls unfused" the same with one kernel call per weight (the A/B of fusing)
  per kind   each projection kind over all layers in one jit (16 products of the same shape
             from 16 different weights, so they stream from DRAM as in the step), in ms per
             call and GB/s of the bytes the call reads
  one call   each kind's one call (per layer, each timed alone; the LM head in 4096-row pieces),
             best over layers and rounds, in
             ms and GB/s: comparable with bench/kernels/kquant_stream.cc's best-sample rates
  attention  the decode attention of every layer at `--context` (one jit, all layers)
  calls      the same chain of `--calls` empty kernel calls (x -> x through the cheapest
             custom call there is: a 1-row product with a [32, 32] weight): the fixed cost
             of one FFI call inside an XLA CPU executable
  ops        the compiled forward's instruction count (each is one thunk XLA CPU dispatches)

What is left of `forward` after matmuls and attention is the norms, RoPE, the KV writes,
the embedding lookup and the per-thunk dispatch. Timings are never asserted anywhere;
they move with the machine's load, so compare parts within one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.gguf_blocks import BlockQuantizedWeight, block_matmul
from models.layers import project, project_many

KINDS = (("q/k/v", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate/up", ("gate_proj", "up_proj")),
         ("down", ("down_proj",)))


def _weight(layer, name):
    return getattr(layer, name).get_value()


def _nbytes(w) -> int:
    if isinstance(w, BlockQuantizedWeight):
        return int(w.nbytes)
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w)))


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def _many(x, ws, fused: bool):
    """q/k/v or gate/up as the model multiplies them (`fused`: one kernel call where the
    weights allow it), or one call per weight (what the step did before the K-quants fused)."""
    return project_many(x, ws) if fused else [project(x, w) for w in ws]


def matmul_chain(model, fused: bool = True):
    """The step's projections in the step's order and data flow, nothing else."""
    cfg = model.cfg
    head = model.tied_lm_head.get_value() if cfg.tie_word_embeddings else model.lm_head.get_value()

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    weights = [[_weight(layer, n) for n in names] for layer in model.layers]

    @jax.jit  # weights are arguments: captured as constants they would be copied into the executable
    def chain(x, weights, head):
        for wq, wk, wv, wo, wg, wu, wd in weights:
            q, k, v = _many(x, [wq, wk, wv], fused)
            x = x + project(q + jnp.sum(k) + jnp.sum(v), wo)
            g, u = _many(x, [wg, wu], fused)
            x = x + project(g * u, wd)
        return project(x, head)

    return lambda x: chain(x, weights, head)


def kind_chain(model, names, fused: bool = True):
    """Every layer's `names` projections of one fixed input, in one jit."""
    ws = [[_weight(layer, n) for n in names] for layer in model.layers]

    @jax.jit
    def run(x, ws):
        total = 0.0
        for group in ws:
            xi = x[:, :group[0].in_features] if isinstance(group[0], BlockQuantizedWeight) else x
            for y in _many(xi, group, fused):
                total = total + y[:, :8]
        return total

    in_features = ws[0][0].in_features if isinstance(ws[0][0], BlockQuantizedWeight) else ws[0][0].shape[0]
    return (lambda x: run(x, ws)), in_features, sum(_nbytes(w) for group in ws for w in group), len(ws)


def single_calls(model, names, fused: bool = True):
    """One jitted call of `names` per layer's weights (distinct arrays, so each call streams
    its bytes from DRAM), for timing each call alone: on a shared machine the best single
    call is the one that ran with both cores free."""
    ws = [[_weight(layer, n) for n in names] for layer in model.layers]
    run = jax.jit(lambda x, group: [y[:, :8] for y in _many(x, group, fused)])
    return [(functools.partial(run, group=group), sum(_nbytes(w) for w in group)) for group in ws]


def _head_pieces(head, rows: int = 4096):
    """The LM head as separate arrays of `rows` output rows each (a block head; a float one
    whole): one call of the whole head is long enough (~6 ms) that on a shared machine it
    hardly ever runs with both cores free, while its pieces' best calls do, at the same
    kernel's rate (each piece a copy: together they stream from DRAM as the head does)."""
    if not isinstance(head, BlockQuantizedWeight):
        return [head]
    return [head.replace(blocks=jnp.array(head.blocks[i:i + rows])) for i in range(0, head.out_features, rows)]


def attention_chain(model, runner, rows: int, context: int):
    cfg = model.cfg
    attend = model.decode_attention
    per_row = -(-(context + 1) // runner.block_size)
    tables = jnp.asarray(np.arange(1, 1 + rows * per_row, dtype=np.int32).reshape(rows, per_row))
    positions = jnp.full((rows, 1), context, jnp.int32)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((rows, 1, cfg.num_heads, cfg.head_dim)), jnp.float32)

    @jax.jit
    def run(q, ks, vs):
        out = 0.0
        for k, v in zip(ks, vs):
            out = out + attend(q, k, v, tables, positions, cfg.head_dim ** -0.5)
        return out

    return lambda: run(q, runner.kv_cache.k, runner.kv_cache.v)  # the step donates the cache: read it now


def call_chain(calls: int):
    """`calls` dependent 1 x [32 -> 32] Q8_0 products on the block kernel: the fixed cost per call."""
    from models import cpu_kernels
    from models.gguf_blocks import make_weight, with_kernel
    blocks = np.zeros((32, 34), np.uint8)  # 32 rows of one Q8_0 block (f16 scale 0: all zeros)
    w = with_kernel(make_weight(blocks, "q8_0", 32), cpu_kernels.BLOCK_TARGET, 0)

    @jax.jit
    def run(x):
        for _ in range(calls):
            x = x + block_matmul(x, w)
        return x

    return run


def main(argv: list[str] | None = None) -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from ferrox_jax.host_batch import HostBatch
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling
    from ferrox_jax.step_output import run_plan
    from tools.bench.bench_engine import fill_kv_random, row_tables

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed calls of each part per round")
    p.add_argument("--calls", type=int, default=128, help="empty kernel calls in the fixed-cost chain")
    p.add_argument("--quantization", default="auto", help="auto: what `ferrox serve` picks (gguf on a CPU)")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    engine = Engine.load(EngineConfig(model=args.model, quantization=args.quantization, max_context=args.max_context,
                                      max_seqs=max(args.rows, 1),
                                      compile_cache_dir=args.compile_cache_dir))
    load_s = time.perf_counter() - t0
    runner = engine.runner
    fill_kv_random(runner)
    model = nnx.merge(runner.graphdef, runner.state)
    tables = row_tables(runner, args.rows, args.context + args.rounds * args.steps * 4 + 8)
    greedy = RowSampling(temperature=0.0)
    pos = [args.context]

    def plan():
        pos[0] += 1
        return StepPlan(decode=tuple(RowPlan(row_id=r, token_ids=(7,), start_pos=pos[0], block_ids=tables[r],
                                             sample=True, sampling=greedy) for r in range(args.rows)))

    def host():
        batch = HostBatch.build(plan(), runner.geometry)
        return batch, runner._pad(batch)

    def forward_only(padded):
        shape, _, inputs = padded
        jax.block_until_ready(runner._run_forward(shape, inputs).logits)

    def sample_after(batch):
        runner.sample(runner.forward(batch), None)

    t0 = time.perf_counter()
    run_plan(runner, plan())
    first_step_s = time.perf_counter() - t0
    chain = matmul_chain(model)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((args.rows, model.cfg.hidden_size)) * 0.1, jnp.float32)
    kinds = {name: kind_chain(model, names) for name, names in KINDS}
    kinds.update({f"{name} unfused": kind_chain(model, names, fused=False) for name, names in KINDS if len(names) > 1})
    unfused = matmul_chain(model, fused=False)
    kind_x = {name: jnp.asarray(np.random.default_rng(2).standard_normal((args.rows, k)) * 0.1, jnp.float32)
              for name, (_, k, _, _) in kinds.items()}
    singles = {f"one call {name}": single_calls(model, names) for name, names in KINDS}
    singles.update({f"one call {name} unfused": single_calls(model, names, fused=False)
                    for name, names in KINDS if len(names) > 1})
    singles_x = {key: kind_x[key.removeprefix("one call ")] for key in singles}
    head = model.tied_lm_head.get_value() if model.cfg.tie_word_embeddings else model.lm_head.get_value()
    singles["one call head"] = [(functools.partial(jax.jit(lambda x, w: project(x, w)[:, :8]), w=piece), _nbytes(piece))
                                for piece in _head_pieces(head)]
    singles_x["one call head"] = x
    for key, calls_of in singles.items():
        jax.block_until_ready(calls_of[0][0](singles_x[key]))
    attention = attention_chain(model, runner, args.rows, args.context)
    calls = call_chain(args.calls)
    cx = jnp.zeros((args.rows, 32), jnp.float32)
    for warm in (lambda: chain(x), lambda: unfused(x), attention, lambda: calls(cx),
                 *(lambda n=n: kinds[n][0](kind_x[n]) for n in kinds)):
        jax.block_until_ready(warm())

    samples: dict[str, list[float]] = {}
    rates: dict[str, float] = {}  # each single call's best GB/s (layers' formats may differ)

    def add(key, seconds):
        samples.setdefault(key, []).append(seconds * 1e3)

    for _ in range(args.rounds):
        for _ in range(args.steps):
            t = time.perf_counter()
            run_plan(runner, plan())
            add("step", time.perf_counter() - t)
            t = time.perf_counter()
            batch, padded = host()
            add("host", time.perf_counter() - t)
            t = time.perf_counter()
            forward_only(padded)
            add("forward", time.perf_counter() - t)
            batch, _ = host()
            pending = runner.forward(batch)
            jax.block_until_ready(pending.result.logits)
            t = time.perf_counter()
            runner.sample(pending, None)
            add("sample", time.perf_counter() - t)
            add("matmuls", _timed(chain, x))
            add("matmuls unfused", _timed(unfused, x))
            add("attention", _timed(attention))
            add("calls", _timed(calls, cx))
            for name, (fn, _, _, _) in kinds.items():
                add(f"kind {name}", _timed(fn, kind_x[name]))
            for key, calls_of in singles.items():
                for fn, nbytes in calls_of:
                    seconds = _timed(fn, singles_x[key])
                    add(key, seconds)
                    rates[key] = max(rates.get(key, 0.0), nbytes / seconds / 1e9)

    best = {k: min(v) for k, v in samples.items()}
    median = {k: float(np.median(v)) for k, v in samples.items()}
    exe = runner._compiled[next(k for k in runner._compiled if k[0] == "forward")]
    hlo = exe.as_text() if hasattr(exe, "as_text") else ""
    entry = hlo[hlo.find("ENTRY"):]
    ops = sum(1 for line in entry.splitlines() if " = " in line)
    custom = entry.count("custom-call(")
    result = {"model": engine.model_name, "rows": args.rows, "context": args.context, "load_s": load_s,
              "first_step_s": first_step_s, "weights_bytes": engine.weights_bytes,
              "forward_entry_ops": ops, "forward_custom_calls": custom, "best_ms": best, "median_ms": median,
              "rounds": args.rounds, "steps_per_round": args.steps, "empty_calls": args.calls,
              "per_kind": {name: {"calls": n, "bytes": b, "best_ms_per_call": best[f"kind {name}"] / n,
                                  "gb_per_s": b / (best[f"kind {name}"] / 1e3) / 1e9}
                           for name, (_, _, b, n) in kinds.items()},
              "one_call": {key: {"best_ms": best[key], "best_gb_per_s": rates[key],
                                 "bytes": sorted({nbytes for _, nbytes in calls_of})}
                           for key, calls_of in singles.items()},
              "fixed_us_per_call": best["calls"] * 1e3 / args.calls,
              "recompiles_after_warmup": runner.recompiles_after_warmup}
    engine.shutdown()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
