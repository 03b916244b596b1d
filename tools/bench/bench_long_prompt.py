"""A long prompt's whole prefill, chunk by chunk, through the runner's verbs: its time to first token
without HTTP, scheduling or other requests.

    python -m tools.bench.bench_long_prompt --model /work/gguf/llama-3.2-1b-Q4_K_M.gguf --prompt-len 2048

Loads the engine as `ferrox serve` would (`--quantization auto`), one row, and runs a random
prompt of `--prompt-len` tokens as the scheduler cuts it when nothing else runs: chunks of the
largest chunk bucket, each one step (`run_plan`: host batch, forward, sampler, fetch), the last
sampling the first token. One untimed prefill compiles and warms the shapes; then `--rounds`
timed ones. Prints JSON: each round's total seconds and the last round's per-chunk milliseconds,
which grow with the position as each chunk's attention reads the keys before it (the projections'
share stays flat). For before / after runs of a change, run it from each checkout in turn.
Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def prefill_steps(runner, prompt: tuple[int, ...], block_ids: tuple[int, ...], chunk: int) -> list[float]:
    """Seconds of each chunk step of one prefill of `prompt` into `block_ids`."""
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling
    from ferrox_jax.step_output import run_plan

    seconds = []
    for start in range(0, len(prompt), chunk):
        end = min(len(prompt), start + chunk)
        row = RowPlan(row_id=0, token_ids=prompt[start:end], start_pos=start, block_ids=block_ids,
                      sample=end == len(prompt), sampling=RowSampling(temperature=0.0),
                      next_token_id=prompt[end] if end < len(prompt) else -1, num_prompt_tokens=len(prompt))
        t0 = time.perf_counter()
        run_plan(runner, StepPlan(chunks=(row,)))
        seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv: list[str] | None = None) -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine
    from tools.bench.bench_engine import row_tables

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
