# A/B in one process: the decode step with the flat-state, numpy-input forward (new) against the
# nnx.State + jax.device_put call (old), alternated in 10 rounds of 20 steps. Usage:
#   .venv/bin/python bench/quant/host-path/ab_step.py 1,8,32
import time, os, sys, numpy as np, jax, dataclasses
from models import cpu_kernels
from ferrox_jax import step as stepmod
from ferrox_jax.host_batch import run_plan
from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.request import SamplingParams
from ferrox_jax.runner import ModelRunner
from models.loader import open_checkpoint
rows = [int(r) for r in sys.argv[1].split(",")]
source = open_checkpoint("default")
model = source.build(quantization="gguf", decode_attention=cpu_kernels.decode_attention())
cpu_kernels.pack_blocks_for_kernel(model)
R = max(rows)
runner = ModelRunner(model, num_blocks=40 * R + 1, block_size=16, max_rows=R, max_chunk_tokens=16, max_context=640)
greedy = SamplingParams(temperature=0.0)
old_exes = {}
new_run_forward = runner._run_forward
def old_run_forward(shape, inputs):
    key = dataclasses.astuple(shape)
    if key not in old_exes:
        fn = jax.jit(lambda st, kv, b: stepmod._forward(runner.graphdef, runner._state_tree, jax.tree.leaves(st), kv, b), donate_argnums=(1,))
        old_exes[key] = fn.lower(runner.state, runner.kv_cache, jax.device_put(inputs)).compile()
    runner.kv_cache, r = old_exes[key](runner.state, runner.kv_cache, jax.device_put(inputs))
    return r
def mode(old):
    runner._run_forward = old_run_forward if old else new_run_forward
    runner._place_inputs = old
res = {}
for b in rows:
    tables = [tuple(range(1 + i * 40, 1 + (i + 1) * 40)) for i in range(b)]
    plan = lambda pos: StepPlan(decode=tuple(RowPlan(row_id=i, token_ids=(7,), start_pos=pos, block_ids=tables[i], sample=True, sampling=greedy) for i in range(b)))
    for old in (0, 1):
        mode(old); run_plan(runner, plan(192))
    for rnd in range(int(os.environ.get("ROUNDS", "10"))):
        for old in (0, 1):
            mode(old)
            ts = []
            for s in range(20):
                t = time.perf_counter(); run_plan(runner, plan(192 + s)); ts.append(time.perf_counter() - t)
            res.setdefault((b, old), []).append(np.median(ts) * 1e3)
    n, o = np.array(res[(b, 0)]), np.array(res[(b, 1)])
    print(f"rows {b}: new {np.median(n):.2f} ms, old {np.median(o):.2f} ms, old/new per round median {np.median(o / n):.3f} (range {np.min(o/n):.3f}-{np.max(o/n):.3f})", flush=True)
