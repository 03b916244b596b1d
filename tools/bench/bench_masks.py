"""Offline cost of grammar masks per decode step: the same rows stepped with and without
constraints, interleaved in one process so both sides see the same machine load.

    python -m tools.bench.bench_masks --model default --rows 1 32 --steps 40

For each row count: R rows are prefilled, then decode steps alternate between plain rows
and the same rows each carrying a JSON-schema matcher (a list of records that cannot end
within the run, so every step is constrained). Reported per step, medians over the steps:
wall time of the step (`forward`, the masks, `sample`), host time filling the masks, and the share of fills that ended
before the model call did (`is_ready()` still false: the mask cost nothing but host time).
Tokens are sampled with temperature 1 and each matcher accepts its row's token, so the
masks walk real documents; the plain side replays the same positions (K/V rewritten).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from ferrox_jax.config import EngineConfig
from ferrox_jax.constraint import GrammarSpec
from ferrox_jax.grammar import GrammarCompiler
from ferrox_jax.plan import RowPlan, StepPlan
from ferrox_jax.host_batch import HostBatch, bitmask_words
from ferrox_jax.step_output import run_plan, step_output
from ferrox_jax.request import RowSampling

# Records of a name, an age and a city; at least 64 of them, so no document ends mid-run.
SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"]}}


def _prefill(runner, rows: int, prompt: list[int], blocks_per_row: int) -> list[tuple[list[int], int]]:
    """Prefill `rows` copies of the prompt; returns (block ids, first token) per row."""
    out = []
    for r in range(rows):
        blocks = list(range(1 + r * blocks_per_row, 1 + (r + 1) * blocks_per_row))
        step = RowPlan(row_id=r, token_ids=tuple(prompt), start_pos=0, block_ids=tuple(blocks), sample=True,
                       sampling=RowSampling(temperature=1.0, seed=r))
        out.append((blocks, run_plan(runner, StepPlan(chunks=(step,))).results[r].token_id))
    return out


def bench_rows(engine, rows: int, steps: int, prompt: list[int]) -> dict:
    runner = engine.runner
    blocks_per_row = -(-(len(prompt) + steps + 1) // runner.block_size)
    if rows * blocks_per_row > runner.num_blocks - 1:
        raise SystemExit(f"{rows} rows x {blocks_per_row} blocks do not fit in {runner.num_blocks} KV blocks")
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size)
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    state = _prefill(runner, rows, prompt, blocks_per_row)
    matchers = [grammar.new_matcher() for _ in range(rows)]
    fill_s: list[float] = []
    hidden_fills: list[bool] = []

    def masked_step(step_plan: StepPlan):  # the batcher's tick: forward, the masks meanwhile, sample
        batch = HostBatch.build(step_plan, runner.geometry)
        pending = runner.forward(batch)
        start_s = time.perf_counter()
        bitmask = np.empty((batch.num_rows, bitmask_words(runner.geometry.vocab_size)), np.int32)
        compiler.fill_bitmask(bitmask, [matchers[int(r)] if c else None
                                        for r, c in zip(batch.row_ids, batch.constrained)])
        fill_s.append(time.perf_counter() - start_s)
        hidden_fills.append(not pending.is_done())
        return step_output(step_plan, batch, runner.sample(pending, bitmask))
    # The prefill's token is context; each document starts with the first masked token.
    tokens = [[first] for _, first in state]
    plain_s, masked_s, mask_s, hidden, fills = [], [], [], 0, 0
    pos = len(prompt)

    def plan(with_matchers: bool) -> StepPlan:
        return StepPlan(decode=tuple(
            RowPlan(row_id=r, token_ids=(tokens[r][-1],), start_pos=pos, block_ids=tuple(state[r][0]), sample=True,
                    sampling=RowSampling(temperature=1.0, seed=r), is_constrained=with_matchers)
            for r in range(rows)))

    for _ in range(steps):
        t0 = time.perf_counter()
        run_plan(runner, plan(False))
        plain_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = masked_step(plan(True))
        masked_s.append(time.perf_counter() - t0)
        mask_s.append(fill_s[-1])
        hidden += hidden_fills[-1]
        fills += 1
        for r in range(rows):
            token = out.results[r].token_id
            assert matchers[r].accept(token), "a masked row sampled a token its grammar forbids"
            tokens[r].append(token)
        pos += 1
    med = statistics.median
    return {"rows": rows, "steps": steps, "step_ms_plain": med(plain_s) * 1e3, "step_ms_masked": med(masked_s) * 1e3,
            "mask_ms_per_step": med(mask_s) * 1e3, "mask_us_per_row": med(mask_s) / rows * 1e6,
            "fills_hidden": f"{hidden}/{fills}",
            "overhead_pct": (med(masked_s) / med(plain_s) - 1) * 100}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    from ferrox_jax.engine import Engine

    blocks_per_row = -(-(args.prompt_len + args.steps + 1) // 16)
    engine = Engine.load(EngineConfig(model=args.model, max_seqs=max(args.rows), block_size=16,
                                      kv_blocks=max(args.rows) * blocks_per_row, max_context=256,
                                      compile_cache_dir=args.compile_cache_dir))
    engine.warmup()
    prompt = engine.tokenizer.encode("List people as JSON records with a name, an age and a city. " * 8)
    prompt = prompt[:args.prompt_len]
    results = [bench_rows(engine, rows, args.steps, prompt) for rows in args.rows]
    for r in results:
        print(json.dumps(r))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
