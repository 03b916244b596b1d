"""Offline engine benchmark: warm-up, prefill and decode throughput, batcher tick rate.

Measures the engine without HTTP, on whatever backend JAX picks:
  * warm-up: seconds to compile every bucket (cold, or with the persistent cache);
  * prefill tokens/s for one full chunk;
  * decode tokens/s at each row count asked for, with the step's achieved FLOP/s and
    memory bandwidth next to a plain jitted f32 matmul chain of the same shapes (the
    roofline this CPU actually reaches), since decode is bandwidth-bound at few rows and
    compute-bound at many;
  * the batcher's ticks/s with N rows decoding and its host-side overhead per tick.

    python -m tools.bench_engine --model default --rows 1 32 --json results/engine.json
    python -m tools.bench_engine --quantization w8a8 --kv-cache-dtype bfloat16 --rows 1 32

Bytes moved per decode step count the weights as placed (`ModelRunner.weights_bytes`:
int8 values and their scales in the quantized modes) plus the KV read at that context.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


def _decode_flops_bytes(cfg, rows: int, context: int, dtype_bytes: int,
                        weights_bytes: float | None = None) -> tuple[float, float]:
    """Model FLOPs and bytes moved for one decode step of `rows` rows at `context` tokens
    (`dtype_bytes`: KV element size; weights as f32 of that size unless `weights_bytes`)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer_params = d * (q + 2 * kv) + q * d + 3 * d * f
    params = cfg.num_layers * per_layer_params + v * d
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    flops = rows * (2 * params + attn_flops)
    kv_bytes = rows * context * cfg.kv_bytes_per_token(dtype_bytes)
    return flops, (params * dtype_bytes if weights_bytes is None else weights_bytes) + kv_bytes


def _matmul_roofline(cfg, rows: int, dtype) -> float:
    """FLOP/s of a plain jitted chain of the decode step's matmuls (same shapes, no attention)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    key = jax.random.key(0)
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    weights = [[jax.random.normal(key, s, dtype) * 0.02 for s in shapes] for _ in range(cfg.num_layers)]
    head = jax.random.normal(key, (d, v), dtype) * 0.02

    @jax.jit
    def chain(x, weights, head):
        kv_sum = jnp.zeros((), dtype)  # keeps the k/v projections alive
        for wq, wk, wv, wo, wg, wu, wd in weights:
            kv_sum = kv_sum + (x @ wk).sum() + (x @ wv).sum()
            x = x + (x @ wq) @ wo
            x = x + ((x @ wg) * (x @ wu)) @ wd
        return x @ head, kv_sum

    x = jax.random.normal(key, (rows, d), dtype)
    jax.block_until_ready(chain(x, weights, head))
    t0 = time.perf_counter()
    n = 5
    for _ in range(n):
        jax.block_until_ready(chain(x, weights, head))
    seconds = (time.perf_counter() - t0) / n
    flops, _ = _decode_flops_bytes(cfg, rows, 0, 4)
    return flops / seconds


def bench_runner(engine, rows_list: list[int], context: int, steps: int, greedy: bool = False,
                 roofline: bool = True) -> dict:
    from ferrox_jax.plan import RowStep, StepPlan
    from ferrox_jax.request import SamplingParams

    runner = engine.runner
    cfg = engine.model_config
    dtype_bytes = jnp.dtype(runner.kv_dtype).itemsize
    out: dict = {}
    blocks_per_row = -(-(max(context, runner.max_prefill_tokens) + steps + 1) // runner.block_size)
    # Prefill: one full chunk.
    chunk = runner.max_prefill_tokens
    prompt = tuple(int(t) for t in np.random.RandomState(0).randint(10, cfg.vocab_size - 10, chunk))
    blocks = tuple(range(1, 1 + blocks_per_row))
    plan = StepPlan(prefill=(RowStep(row_id=0, token_ids=prompt, start_pos=0, block_ids=blocks, sample=True,
                                     sampling=SamplingParams(temperature=0.0)),))
    runner.run(plan)
    t0 = time.perf_counter()
    for _ in range(3):
        runner.run(plan)
    out["prefill_tokens_per_s"] = 3 * chunk / (time.perf_counter() - t0)
    for rows in rows_list:
        if rows * blocks_per_row >= runner.num_blocks:
            raise SystemExit(f"{rows} rows x {blocks_per_row} blocks do not fit in {runner.num_blocks} KV blocks")
        tables = [tuple(range(1 + r * blocks_per_row, 1 + (r + 1) * blocks_per_row)) for r in range(rows)]
        sampling = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.8, top_p=0.95, seed=1)

        def plan_at(pos):
            return StepPlan(decode=tuple(RowStep(row_id=r, token_ids=(7,), start_pos=pos, block_ids=tables[r],
                                                 sample=True, sampling=sampling) for r in range(rows)))
        runner.run(plan_at(context))
        t0 = time.perf_counter()
        for s in range(steps):
            runner.run(plan_at(context + s))
        step_s = (time.perf_counter() - t0) / steps
        flops, nbytes = _decode_flops_bytes(cfg, rows, context, dtype_bytes, runner.weights_bytes)
        out[f"decode_{rows}_rows"] = {
            "tokens_per_s": rows / step_s,
            "step_ms": step_s * 1e3,
            "achieved_gflops": flops / step_s / 1e9,
            "achieved_gbytes_per_s": nbytes / step_s / 1e9,
        }
        if roofline:
            out[f"decode_{rows}_rows"]["matmul_roofline_gflops"] = _matmul_roofline(cfg, rows, jnp.float32) / 1e9
    return out


def bench_batcher(engine, rows: int, prompt_tokens: int, max_tokens: int) -> dict:
    """Ticks/s and host overhead with `rows` jobs decoding through the real batcher."""
    from ferrox_jax.request import GenerationRequest, SamplingParams

    done = threading.Semaphore(0)

    def on_event(event):
        if event.finish_reason:
            done.release()

    before = engine.stats()
    t0 = time.perf_counter()
    for i in range(rows):
        prompt = tuple(int(t) for t in np.random.RandomState(i).randint(10, 1000, prompt_tokens))
        engine.submit(GenerationRequest(f"bench-{i}", prompt, max_tokens, SamplingParams(temperature=0.8, seed=i),
                                        ignore_eos=True), on_event)
    for _ in range(rows):
        done.acquire(timeout=600)
    wall = time.perf_counter() - t0
    time.sleep(0.2)
    after = engine.stats()
    ticks = after.ticks - before.ticks
    host = after.host_s - before.host_s
    device = after.device_s - before.device_s
    return {
        "rows": rows, "wall_s": wall, "ticks": ticks, "ticks_per_s": ticks / wall,
        "output_tokens_per_s": rows * max_tokens / wall,
        "host_ms_per_tick": 1e3 * host / max(ticks, 1), "device_ms_per_tick": 1e3 * device / max(ticks, 1),
    }


def main(argv: list[str] | None = None) -> int:
    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default="none", choices=["none", "int8", "w8a8"])
    p.add_argument("--kv-cache-dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--greedy", action="store_true", help="decode greedily (default: temperature 0.8, top-p 0.95)")
    p.add_argument("--no-roofline", action="store_true", help="skip the f32 matmul chain per row count")
    p.add_argument("--no-batcher", action="store_true", help="skip the batcher run")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256, help="context length the decode rows sit at")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--batcher-rows", type=int, default=32)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    engine = Engine.load(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                      kv_cache_dtype=args.kv_cache_dtype, max_context=args.max_context,
                                      max_seqs=max(args.rows + [args.batcher_rows]),
                                      compile_cache_dir=args.compile_cache_dir))
    load_s = time.perf_counter() - t0
    warmup_s = engine.warmup()
    result = {"model": engine.model_name, "backend": jax.default_backend(), "quantization": args.quantization,
              "kv_cache_dtype": engine.model_card.kv_cache_dtype, **engine.memory(), "load_s": load_s,
              "warmup_s": warmup_s, "num_compiled_shapes": len(engine.runner.buckets.keys())}
    result.update(bench_runner(engine, args.rows, args.context, args.steps, args.greedy, not args.no_roofline))
    engine.start()
    if not args.no_batcher:
        result["batcher"] = bench_batcher(engine, args.batcher_rows, 128, 64)
    result["recompiles_after_warmup"] = engine.stats().recompiles_after_warmup
    engine.shutdown()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
