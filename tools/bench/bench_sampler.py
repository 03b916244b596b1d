"""One sampler call, XLA's path against the CPU kernel's (`ferrox_jax/sampling.py:sample_checked`,
`models/kernels/sample_rows.cc`), for the settings people serve with.

    python -m tools.bench.bench_sampler --rows 1 8 32 --vocab 49152

Per rows x settings: the best of --repeats timings of --calls calls each (hot: the same logits
again), ms a call on each path, and the fraction of rows whose token is the same on both.
Logits are random, std 3; every row its own seed, position and penalty-free settings.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import timeit

import jax
import numpy as np

from ferrox_jax.host_batch import SamplingArrays
from ferrox_jax.step import _sample
from models import cpu_kernels

SETTINGS = {
    "greedy": {},
    "t 0.7": dict(temperature=0.7),
    "t 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "t 1, top_k 40": dict(temperature=1.0, top_k=40),
    "t 0.7, top_k 50, top_p 0.95, min_p 0.05": dict(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05),
}


def _arrays(rows: int, vocab: int, settings: dict) -> SamplingArrays:
    s = SamplingArrays.padding(rows, vocab)
    for name, value in settings.items():
        getattr(s, name)[:] = value
    s.seed[:] = np.arange(rows) + 11
    return jax.device_put(s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    if (reason := cpu_kernels.unavailable_reason()) is not None:
        print(f"the CPU kernels are unavailable: {reason}", file=sys.stderr)
        return 1
    results = []
    rng = np.random.default_rng(0)
    for rows in args.rows:
        logits = jax.device_put((rng.standard_normal((rows, args.vocab)) * 3).astype(np.float32))
        positions = jax.device_put(np.arange(rows, dtype=np.int32))
        mask = jax.device_put(np.full((rows, (args.vocab + 31) // 32), -1, np.int32))
        for name, settings in SETTINGS.items():
            s = _arrays(rows, args.vocab, settings)
            timed, tokens = {}, {}
            for kernel in (False, True):
                f = jax.jit(functools.partial(_sample, cpu_kernel=kernel)).lower(logits, positions, s, mask).compile()
                tokens[kernel] = np.asarray(f(logits, positions, s, mask).packed)[:, 0]
                call = lambda: jax.block_until_ready(f(logits, positions, s, mask))  # noqa: E731
                timed[kernel] = min(timeit.repeat(call, number=args.calls, repeat=args.repeats)) / args.calls * 1e3
            same = float((tokens[False] == tokens[True]).mean())
            results.append(dict(rows=rows, settings=name, xla_ms=timed[False], kernel_ms=timed[True], same_tokens=same))
            print(f"rows {rows:3d}  {name:42s} XLA {timed[False]:8.3f} ms  kernel {timed[True]:7.3f} ms  "
                  f"same tokens {same:.3f}", flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
