import sys, time
import numpy as np
from models.loader import load_checkpoint
from ferrox_jax.step_output import run_plan
from ferrox_jax.runner import ModelRunner
from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.request import RowSampling
import jax.numpy as jnp
ROWS = 32
for q, kvd in (("w8a8", None), ("w8a8", jnp.bfloat16), ("none", None)):
    ck = load_checkpoint('default', quantization=q)
    r = ModelRunner(ck.model, num_blocks=40 * ROWS + 1, block_size=16, max_rows=ROWS, max_chunk_tokens=16,
                    max_context=512, kv_dtype=kvd)
    tables = [tuple(range(1 + i * 40, 1 + (i + 1) * 40)) for i in range(ROWS)]
    sp = RowSampling(temperature=0.0)
    def plan(pos):
        return StepPlan(decode=tuple(RowPlan(row_id=i, token_ids=(7,), start_pos=pos, block_ids=tables[i], sample=True,
                                             sampling=sp) for i in range(ROWS)))
    run_plan(r, plan(5))
    for ctx in (8, 192, 400, 8, 192, 400):
        run_plan(r, plan(ctx))
        ts = []
        for s in range(6):
            t = time.perf_counter(); run_plan(r, plan(ctx + 1 + s)); ts.append(time.perf_counter() - t)
        print(f"{q} kv {kvd} ctx {ctx:4d}: median {np.median(ts)*1e3:6.1f} best {min(ts)*1e3:6.1f}", flush=True)
