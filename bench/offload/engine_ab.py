"""A working set 4x the device KV budget, replayed: the host KV tier (`--kv-offload-gib`) against recompute.

    .venv/bin/python bench/offload/engine_ab.py > bench/offload/engine-ab.json

Two engines over the default model in one process, the same device budget (`kv_blocks`
for about 10 of the prompts at once), one with a host tier that holds the whole working
set and one without. Each pass submits the same 40 random 600-token prompts (no two share
a block) at once, 8 greedy tokens each. Pass 1 is cold on both; passes 2 and 3 replay it,
the engines taking turns and the order swapped between the two replays. Per pass and
engine: wall seconds, TTFT (submit to the first token event, mean and median over the 40),
the pass's prefix-cache hit rate by tier (hit tokens over looked-up tokens, from
`BatcherStats`), and whether every output equals the tier-less engine's first pass.
"""

import json
import os
import statistics
import sys
import threading
import time

import numpy as np

from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
from ferrox_jax.request import Job, RowSampling

NUM_PROMPTS = int(os.environ.get("OFFLOAD_PROMPTS", 40))
PROMPT_TOKENS = int(os.environ.get("OFFLOAD_PROMPT_TOKENS", 600))
MAX_TOKENS = 8
BLOCK = 16
# ceil((600 + 8) / 16) = 38 blocks promised per job; 10 jobs' worth, plus the null block
KV_BLOCKS = 10 * -(-(PROMPT_TOKENS + MAX_TOKENS) // BLOCK) + 1
OFFLOAD_GIB = float(os.environ.get("OFFLOAD_GIB", 1.5))  # 40 x 37 blocks x 720 KiB (float32) = 1.04 GiB


def make(offload_gib: float) -> Engine:
    engine = Engine.load(EngineConfig(model="default", kv_blocks=KV_BLOCKS, max_seqs=8, max_context=1024,
                                      kv_offload_gib=offload_gib,
                                      compile_cache_dir=os.path.expanduser("~/.cache/ferrox_jax/jax")))
    engine.warmup()
    engine.start()
    return engine


PROMPTS = [tuple(int(t) for t in np.random.RandomState(1000 + i).randint(100, 40000, PROMPT_TOKENS))
           for i in range(NUM_PROMPTS)]


def run_pass(engine: Engine, tag: str) -> dict:
    before = engine.stats()
    lock, done = threading.Lock(), threading.Event()
    first: dict[int, float] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(NUM_PROMPTS)}
    left = [NUM_PROMPTS]

    def on_event(event):
        i = int(event.request_id.rsplit("-", 1)[1])
        now = time.perf_counter()
        with lock:
            if event.token_ids and i not in first:
                first[i] = now
            tokens[i] += event.token_ids
            if event.finish_reason:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    start = time.perf_counter()
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Job(f"{tag}-{i}", prompt, MAX_TOKENS, RowSampling(temperature=0.0), ignore_eos=True), on_event)
    assert done.wait(7200), "pass did not finish"
    wall = time.perf_counter() - start
    after = engine.stats()
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    ttft = [first[i] - start for i in range(NUM_PROMPTS)]
    return {"wall_s": round(wall, 2), "ttft_mean_s": round(statistics.mean(ttft), 2),
            "ttft_median_s": round(statistics.median(ttft), 2),
            "hit_rate_device": round((after.prefix_cache_hits_device - before.prefix_cache_hits_device) / queried, 3),
            "hit_rate_host": round((after.prefix_cache_hits_host - before.prefix_cache_hits_host) / queried, 3),
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
            "blocks_restored": after.kv_offload_blocks_restored - before.kv_offload_blocks_restored,
            "blocks_stored": after.kv_offload_blocks_stored - before.kv_offload_blocks_stored,
            "recompiles_after_warmup": after.recompiles_after_warmup,
            "tokens": [tokens[i] for i in range(NUM_PROMPTS)]}


def main() -> None:
    engines = {"tier": make(OFFLOAD_GIB), "recompute": make(0.0)}
    order = [("pass1", ["tier", "recompute"]), ("pass2", ["tier", "recompute"]), ("pass3", ["recompute", "tier"])]
    results: dict[str, dict[str, dict]] = {}
    for name, engine_order in order:
        for key in engine_order:
            results.setdefault(name, {})[key] = run_pass(engines[key], f"{name}{key}")
            print(name, key, {k: v for k, v in results[name][key].items() if k != "tokens"}, file=sys.stderr)
    reference = results["pass1"]["recompute"]["tokens"]
    for passes in results.values():
        for r in passes.values():
            r["outputs_equal_reference"] = r.pop("tokens") == reference
    print(json.dumps({"prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                      "kv_blocks": KV_BLOCKS, "kv_offload_gib": OFFLOAD_GIB,
                      "tier_slots": engines["tier"].stats().kv_offload_blocks_total, "results": results}, indent=1))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
