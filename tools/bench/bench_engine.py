"""Offline engine benchmark: warm-up, prefill and decode throughput, batcher tick rate.

Measures the engine without HTTP, on whatever backend JAX picks:
  * warm-up: seconds to compile every bucket (cold, or with the persistent cache);
  * prefill tokens/s for one full chunk;
  * decode tokens/s at each row count asked for, with the step's achieved FLOP/s and
    memory bandwidth next to a plain jitted f32 matmul chain of the same shapes (the
    roofline this CPU actually reaches), since decode is bandwidth-bound at few rows and
    compute-bound at many;
  * the batcher's ticks/s with N rows decoding and its host-side overhead per tick.

`bench_prefill` and `bench_decode` are also the engine phase of `tools/device/device_check.py`
(several chunk sizes and contexts, time-boxed).

    python -m tools.bench.bench_engine --model default --rows 1 32 --json results/engine.json
    python -m tools.bench.bench_engine --quantization w8a8 --kv-cache-dtype bfloat16 --rows 1 32

Bytes moved per decode step count the weights as placed (`Engine.weights_bytes`: int8
values and their scales in the quantized modes) plus the KV read at that context.
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

from ferrox_jax.step_output import run_plan


def _decode_flops_bytes(cfg, rows: int, context: int, dtype_bytes: int,
                        weights_bytes: float | None = None) -> tuple[float, float]:
    """Model FLOPs and bytes moved for one decode step of `rows` rows at `context` tokens
    (`dtype_bytes`: KV element size; weights as `params * dtype_bytes` unless `weights_bytes`)."""
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


def prefill_flops(cfg, tokens: int) -> float:
    """Model FLOPs of one prefill chunk of `tokens` tokens from position 0 (causal attention:
    token i attends i + 1 keys, ~tokens/2 on average; only the last token's logits)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_params = d * (q + 2 * kv) + q * d + 3 * d * f
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * cfg.num_layers * layer_params * tokens + attn + 2 * d * v


def fill_kv_random(runner, seed: int = 0) -> None:
    """Overwrite every KV block with random values, made on the device with each array's
    sharding. Decode rows in these benchmarks sit at positions nothing prefilled; timing
    over a zeroed cache could flatter the attention (matrix units run faster on zeros)."""
    import functools

    from ferrox_jax.kv_cache import KVCache

    # One compile for all the layers' equal arrays. Each old array is donated, so its
    # buffer takes the new values: the cache (69 GB for the device check's 8B) never
    # exists twice.
    @functools.lru_cache(maxsize=None)
    def maker(shape, dtype, sharding):
        return jax.jit(lambda old, k: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                       donate_argnums=0, out_shardings=sharding)

    def fill(array, key):
        return maker(array.shape, array.dtype, array.sharding)(array, key)

    def random_cache(state):
        cache = state.kv_cache
        keys = jax.random.split(jax.random.key(seed), 2 * len(cache.k))
        new_k = tuple(fill(a, keys[i]) for i, a in enumerate(cache.k))
        new_v = tuple(fill(a, keys[len(cache.k) + i]) for i, a in enumerate(cache.v))
        return state._replace(kv_cache=KVCache(k=new_k, v=new_v))

    runner.swap_state(random_cache)


def _row_blocks(runner, tokens: int) -> int:
    return -(-tokens // runner.block_size)


def row_tables(runner, rows: int, tokens: int, extra_blocks: int = 0) -> list[tuple[int, ...]]:
    """Block tables for `rows` rows of `tokens` positions each, distinct blocks from 1 (0 is the
    null block), leaving `extra_blocks` after them for a caller's chunk (from 1 + the tables' total). Exits naming the sizes
    when they do not fit: a table past the cache would have the attention read past its buffer."""
    per_row = _row_blocks(runner, tokens)
    need = rows * per_row + extra_blocks
    if need >= runner.num_blocks:
        raise SystemExit(f"{rows} rows x {per_row} blocks{f' + {extra_blocks}' if extra_blocks else ''} do not fit "
                         f"in the cache's {runner.num_blocks} KV blocks (block 0 is the null block): lower the rows "
                         f"or the context")
    return [tuple(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows)]


def prefill_steps(runner, prompt: tuple[int, ...], block_ids: tuple[int, ...], chunk: int) -> list[float]:
    """Seconds of each step of one greedy prefill of `prompt` into `block_ids`, in chunks of
    `chunk` tokens as the scheduler cuts a prompt when nothing else runs (the last one samples)."""
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling

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


def bench_prefill(engine, tokens_list: list[int], repeats: int = 3, deadline: float | None = None) -> dict:
    """Tokens/s of one prefill chunk of each size (one warm-up run, then `repeats` timed)."""
    runner, cfg = engine.runner, engine.model_config
    out: dict = {}
    for tokens in tokens_list:
        if deadline is not None and time.monotonic() > deadline:
            out[f"prefill_{tokens}"] = {"skipped": "time box reached"}
            continue
        prompt = tuple(int(t) for t in np.random.RandomState(tokens).randint(10, cfg.vocab_size - 10, tokens))
        blocks = tuple(range(1, 1 + _row_blocks(runner, tokens)))
        prefill_steps(runner, prompt, blocks, tokens)
        seconds = sum(sum(prefill_steps(runner, prompt, blocks, tokens)) for _ in range(repeats)) / repeats
        out[f"prefill_{tokens}"] = {"tokens": tokens, "tokens_per_s": tokens / seconds, "step_ms": seconds * 1e3,
                                    "achieved_tflops": prefill_flops(cfg, tokens) / seconds / 1e12}
    return out


def bench_mixed(engine, decode_rows: int, context: int, chunk_tokens: int, chunks_list: list[int],
                steps: int) -> dict:
    """The unified step: `decode_rows` rows at `context` decoding while k prompt chunks of
    `chunk_tokens` run in the same forward, for each k of `chunks_list`, against the decode
    step and the chunk step apart. Reports the mixed step's time, its prompt tokens/s and
    what the same work costs as separate forwards (median of `steps` steps after one warm-up)."""
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling

    runner, cfg = engine.runner, engine.model_config
    greedy = RowSampling(temperature=0.0)
    chunk_blocks = _row_blocks(runner, chunk_tokens)
    tables = row_tables(runner, decode_rows, context + steps + 2, extra_blocks=max(chunks_list) * chunk_blocks)
    base = 1 + sum(map(len, tables))  # the chunks' blocks follow the rows'
    prompt = tuple(int(t) for t in np.random.RandomState(chunk_tokens).randint(10, cfg.vocab_size - 10, chunk_tokens))

    def decode_rows_at(pos):
        return tuple(RowPlan(row_id=r, token_ids=(7,), start_pos=pos, block_ids=tables[r], sample=True,
                             sampling=greedy) for r in range(decode_rows))

    def chunks(k):
        return tuple(RowPlan(row_id=1000 + c, token_ids=prompt, start_pos=0, sample=True, sampling=greedy,
                             block_ids=tuple(range(base + c * chunk_blocks, base + (c + 1) * chunk_blocks)))
                     for c in range(k))

    def median_ms(make_plan) -> float:
        run_plan(runner, make_plan(0))
        times = []
        for s in range(steps):
            t0 = time.perf_counter()
            run_plan(runner, make_plan(s + 1))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    decode_ms = median_ms(lambda s: StepPlan(decode=decode_rows_at(context + s)))
    out: dict = {"decode_rows": decode_rows, "context": context, "chunk_tokens": chunk_tokens, "decode_ms": decode_ms}
    for k in chunks_list:
        chunk_ms = median_ms(lambda s: StepPlan(chunks=chunks(k)))
        mixed_ms = median_ms(lambda s: StepPlan(decode=decode_rows_at(context + s), chunks=chunks(k)))
        out[f"chunks_{k}"] = {"chunk_ms": chunk_ms, "mixed_ms": mixed_ms, "apart_ms": decode_ms + chunk_ms,
                              "mixed_prompt_tokens_per_s": k * chunk_tokens / mixed_ms * 1e3,
                              "apart_prompt_tokens_per_s": k * chunk_tokens / (decode_ms + chunk_ms) * 1e3}
    return out


def bench_decode(engine, rows_list: list[int], contexts: list[int], steps: int,
                 deadline: float | None = None, greedy: bool = False) -> dict:
    """Decode tokens/s for each (rows, context): rows at `context` tokens each, sampling with
    temperature 0.8 / top-p 0.95 (or greedily), `steps` timed steps after one warm-up step. Blocks are
    laid out row after row; the cache must hold max(rows) x (max(contexts) + steps + 1)."""
    from ferrox_jax.plan import RowPlan, StepPlan
    from ferrox_jax.request import RowSampling

    runner, cfg = engine.runner, engine.model_config
    dtype_bytes = jnp.dtype(engine.model_card.kv_cache_dtype).itemsize
    sampling = RowSampling(temperature=0.0) if greedy else RowSampling(temperature=0.8, top_p=0.95, seed=1)
    out: dict = {}
    for rows in rows_list:
        tables = row_tables(runner, rows, max(contexts) + steps + 1)
        for context in contexts:
            key = f"decode_{rows}_rows_{context}_context"
            if deadline is not None and time.monotonic() > deadline:
                out[key] = {"skipped": "time box reached"}
                continue

            def plan_at(pos):
                return StepPlan(decode=tuple(RowPlan(row_id=r, token_ids=(7,), start_pos=pos, block_ids=tables[r],
                                                     sample=True, sampling=sampling) for r in range(rows)))

            run_plan(runner, plan_at(context))
            t0 = time.perf_counter()
            for s in range(steps):
                run_plan(runner, plan_at(context + 1 + s))
            step_s = (time.perf_counter() - t0) / steps
            flops, nbytes = _decode_flops_bytes(cfg, rows, context, dtype_bytes, engine.weights_bytes)
            out[key] = {"rows": rows, "context": context, "tokens_per_s": rows / step_s, "step_ms": step_s * 1e3,
                        "achieved_tflops": flops / step_s / 1e12, "achieved_tbytes_per_s": nbytes / step_s / 1e12,
                        "bytes_per_step": nbytes, "flops_per_step": flops}
    return out


def bench_runner(engine, rows_list: list[int], context: int, steps: int, greedy: bool = False,
                 roofline: bool = True) -> dict:
    runner = engine.runner
    cfg = engine.model_config
    out = {"prefill_tokens_per_s": bench_prefill(engine, [runner.max_chunk_tokens])[
        f"prefill_{runner.max_chunk_tokens}"]["tokens_per_s"]}
    decode = bench_decode(engine, rows_list, [context], steps, greedy=greedy)
    for rows in rows_list:
        d = decode[f"decode_{rows}_rows_{context}_context"]
        out[f"decode_{rows}_rows"] = {
            "tokens_per_s": d["tokens_per_s"],
            "step_ms": d["step_ms"],
            "achieved_gflops": d["achieved_tflops"] * 1e3,
            "achieved_gbytes_per_s": d["achieved_tbytes_per_s"] * 1e3,
        }
        if roofline:  # the float32 chain: what the unquantized step's matmuls reach here
            out[f"decode_{rows}_rows"]["matmul_roofline_gflops"] = _matmul_roofline(cfg, rows, jnp.float32) / 1e9
    return out


def bench_batcher(engine, rows: int, prompt_tokens: int, max_tokens: int) -> dict:
    """Ticks/s and host overhead with `rows` jobs decoding through the real batcher."""
    from ferrox_jax.request import Job, RowSampling

    done = threading.Semaphore(0)

    def on_event(event):
        if event.finish_reason:
            done.release()

    before = engine.stats()
    t0 = time.perf_counter()
    for i in range(rows):
        prompt = tuple(int(t) for t in np.random.RandomState(i).randint(10, 1000, prompt_tokens))
        engine.submit(Job(f"bench-{i}", prompt, max_tokens, RowSampling(temperature=0.8, seed=i),
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
    from ferrox_jax.config import QUANTIZATION_NAMES, EngineConfig
    from ferrox_jax.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_NAMES,
                   help="auto: what `ferrox serve` picks (gguf for the default model on CPU)")
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
    fill_kv_random(engine.runner)
    card = engine.model_card
    result = {"model": engine.model_name, "backend": jax.default_backend(), "quantization": card.quantization,
              "kv_cache_dtype": card.kv_cache_dtype, "weights_bytes": card.weights_bytes, "kv_bytes": card.kv_bytes,
              "load_s": load_s, "warmup_s": warmup_s, "num_compiled_shapes": len(engine.runner.compile_keys())}
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
