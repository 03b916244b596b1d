"""Where a verification step's time goes: warmed decode steps of R one-token rows (a lone
speculating row with d drafts is R = 1 + d such rows), the forward and the sampler timed apart.

    python -m tools.bench.profile_verify --model default --context 300 --reps 20

Prints one JSON line per row count: median ms of the whole step (`runner.run`: pad, forward,
sampler, fetch), of the forward alone, of the sampler alone, and of the LM head's projection
alone (R x D against the V x D head, inside the forward too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from ferrox_jax.host_batch import HostBatch
    from ferrox_jax.plan import RowPlan, StepPlan

    engine = Engine.load(EngineConfig(model=args.model, max_seqs=max(args.rows)))
    runner = engine.runner
    bs = runner.block_size
    blocks = tuple(range(1, args.context // bs + 2))
    from flax import nnx

    model = runner.state
    head = jax.jit(lambda state, h: nnx.merge(runner.graphdef, state).logits(h))
    for rows in args.rows:
        plans = tuple(RowPlan(row_id=i, token_ids=(100 + i,), start_pos=args.context + i, block_ids=blocks, sample=True)
                      for i in range(rows))
        batch = HostBatch.build(StepPlan(decode=plans), runner.geometry)
        step_ms = _median_ms(lambda: runner.sample(runner.forward(batch), None), args.reps)
        forward_ms = _median_ms(lambda: runner.forward(batch).result.logits.block_until_ready(), args.reps)
        pending = runner.forward(batch)
        pending.result.logits.block_until_ready()
        # The sampler with its one fetch (the rows' arrays and the step's other results).
        sample_ms = _median_ms(lambda: runner.sample(pending, None), args.reps)
        shape = pending.shape
        hidden = jnp.asarray(np.random.RandomState(0).randn(shape.num_rows, runner.cfg.hidden_size), runner.compute_dtype)
        head_ms = _median_ms(lambda: head(model, hidden).block_until_ready(), args.reps)
        print(json.dumps(dict(rows=rows, padded_rows=shape.num_rows, step_ms=step_ms, forward_ms=forward_ms,
                              sample_ms=sample_ms, lm_head_ms=head_ms)), flush=True)


if __name__ == "__main__":
    main()
