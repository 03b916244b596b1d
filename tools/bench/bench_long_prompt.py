"""A long prompt's whole prefill, chunk by chunk, through the runner's verbs: its time to first token
without HTTP, scheduling or other requests.

    python -m tools.bench.bench_long_prompt --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf --prompt-len 2048

Loads the engine as `ferrox serve` would (`--quantization auto`), one row, and runs a random
prompt of `--prompt-len` tokens as the scheduler cuts it when nothing else runs: chunks of the
largest chunk bucket, each one step (`run_plan`: host batch, forward, sampler, fetch), the last
sampling the first token (`bench_engine.prefill_steps`). One untimed prefill compiles and warms the shapes; then `--rounds`
timed ones. Prints JSON: each round's total seconds and the last round's per-chunk milliseconds,
which grow with the position as each chunk's attention reads the keys before it (the projections'
share stays flat). For before / after runs of a change, run it from each checkout in turn.
Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from tools.bench.bench_engine import prefill_steps, row_tables

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantization", default="auto", help="auto: what `ferrox serve` picks (gguf on a CPU)")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    engine = Engine.load(EngineConfig(model=args.model, quantization=args.quantization, max_seqs=1,
                                      max_context=args.prompt_len + 64))
    runner = engine.runner
    chunk = max(runner.buckets.chunk_tokens)
    (table,) = row_tables(runner, 1, args.prompt_len + 16)
    rng = np.random.default_rng(0)
    prompt = tuple(int(t) for t in rng.integers(100, engine.model_config.vocab_size - 100, args.prompt_len))
    prefill_steps(runner, prompt, table, chunk)
    rounds = [prefill_steps(runner, prompt, table, chunk) for _ in range(args.rounds)]
    result = {"model": engine.model_name, "prompt_len": args.prompt_len, "chunk_tokens": chunk,
              "total_s": [round(sum(r), 4) for r in rounds], "best_s": round(min(map(sum, rounds)), 4),
              "chunk_ms": [round(s * 1e3, 1) for s in rounds[-1]]}
    print(json.dumps(result, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
