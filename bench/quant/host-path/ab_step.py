# A/B in one process: the decode forward as the runner dispatches it (new: flat-state leaves,
# numpy inputs; `runner.forward`) against the former call (old: an nnx.State argument and a
# `jax.device_put` of the inputs, rebuilt here from the runner's public weights on a KV cache
# of its own), alternated in 10 rounds of 20 steps; each side pads the same way
# (`ferrox_jax/padding.py`) and waits for its logits. Usage:
#   .venv/bin/python bench/quant/host-path/ab_step.py 1,8,32
import time, os, sys, numpy as np, jax, jax.numpy as jnp
from flax import nnx
from models import cpu_attention, cpu_kernels
from ferrox_jax.host_batch import HostBatch
from ferrox_jax.kv_cache import KVCache
from ferrox_jax.padding import pad_batch
from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.request import RowSampling
from ferrox_jax.runner import ModelRunner
from models.loader import open_checkpoint
rows = [int(r) for r in sys.argv[1].split(",")]
source = open_checkpoint("default")
model = source.build(quantization="gguf", decode_attention=cpu_attention.decode_attention())
cpu_kernels.pack_blocks_for_kernel(model)
R = max(rows)
runner = ModelRunner(model, num_blocks=40 * R + 1, block_size=16, max_rows=R, max_chunk_tokens=16, max_context=640)
greedy = RowSampling(temperature=0.0)
old_kv = [jax.tree.map(jnp.zeros_like, runner.kv_cache)]
old_exes = {}
def old_model(state, kv, b):
    m = nnx.merge(runner.graphdef, state)
    hidden, k, v = m(b.tokens, b.positions, b.valid, kv.k, kv.v, b.block_tables, b.segment_tokens)
    return KVCache(k=k, v=v), m.logits(hidden[b.last_index])
def old_forward(batch):
    shape, _, inputs = pad_batch(batch, runner.buckets, runner.geometry.table_width, runner.max_loras > 0)
    inputs = jax.device_put(inputs)
    key = shape
    if key not in old_exes:
        old_exes[key] = jax.jit(old_model, donate_argnums=(1,)).lower(runner.state, old_kv[0], inputs).compile()
    old_kv[0], logits = old_exes[key](runner.state, old_kv[0], inputs)
    return logits
def step(old, batch):
    logits = old_forward(batch) if old else runner.forward(batch).result.logits
    logits.block_until_ready()
res = {}
for b in rows:
    tables = [tuple(range(1 + i * 40, 1 + (i + 1) * 40)) for i in range(b)]
    plan = lambda pos: StepPlan(decode=tuple(RowPlan(row_id=i, token_ids=(7,), start_pos=pos, block_ids=tables[i], sample=True, sampling=greedy) for i in range(b)))
    batch = lambda pos: HostBatch.build(plan(pos), runner.geometry)
    for old in (0, 1):
        step(old, batch(192))
    for rnd in range(int(os.environ.get("ROUNDS", "10"))):
        for old in (0, 1):
            ts = []
            for s in range(20):
                t = time.perf_counter(); step(old, batch(192 + s)); ts.append(time.perf_counter() - t)
            res.setdefault((b, old), []).append(np.median(ts) * 1e3)
    n, o = np.array(res[(b, 0)]), np.array(res[(b, 1)])
    print(f"rows {b}: new {np.median(n):.2f} ms, old {np.median(o):.2f} ms, old/new per round median {np.median(o / n):.3f} (range {np.min(o/n):.3f}-{np.max(o/n):.3f})", flush=True)
