"""No-sharing traffic with the prefix cache on and off, side by side in one process.

    .venv/bin/python bench/prefix/engine_ab.py > results/prefix/engine-ab-no-sharing.json

Two engines over the default model (one with the cache, one without) take turns running
the same batch: 16 random 128-token prompts submitted at once, 64 greedy tokens each (no
two prompts share a block, so the cache can only cost). Three rounds, the order swapped
every round. Prints seconds per batch, output tokens/s, and each scheduler's host and
device seconds from `BatcherStats`.
"""

import json
import os
import sys
import threading
import time

import numpy as np

from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
from ferrox_jax.request import Job, RowSampling

NUM_JOBS, PROMPT_TOKENS, MAX_TOKENS = 16, 128, 64


def make(caching: bool) -> Engine:
    engine = Engine.load(EngineConfig(model="default", kv_memory_gib=0.5, max_seqs=NUM_JOBS, prefix_caching=caching,
                                      compile_cache_dir=os.path.expanduser("~/.cache/ferrox_jax/jax")))
    engine.warmup()
    engine.start()
    return engine


def batch(engine: Engine, tag: str, seed: int) -> float:
    """Seconds from submitting the batch to its last row's end."""
    rng = np.random.RandomState(seed)
    done, left, lock = threading.Event(), [NUM_JOBS], threading.Lock()

    def on_event(event):
        if event.finish_reason:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    start = time.perf_counter()
    for i in range(NUM_JOBS):
        prompt = tuple(int(t) for t in rng.randint(100, 40000, PROMPT_TOKENS))
        engine.submit(Job(f"{tag}-{i}", prompt, MAX_TOKENS, RowSampling(temperature=0.0),
                          ignore_eos=True), on_event)
    assert done.wait(3600), "batch did not finish"
    return time.perf_counter() - start


def main() -> None:
    engines = {"on": make(True), "off": make(False)}
    batch(engines["on"], "warm-on", 999)
    batch(engines["off"], "warm-off", 998)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for rnd in range(3):
        for name in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
            times[name].append(batch(engines[name], f"{name}{rnd}", 1000 + rnd))  # same prompts for both
            print(name, rnd, round(times[name][-1], 2), file=sys.stderr, flush=True)
    stats = {name: engine.stats() for name, engine in engines.items()}
    print(json.dumps({
        "s_per_batch": times,
        "tok_per_s": {k: [round(NUM_JOBS * MAX_TOKENS / t, 1) for t in v] for k, v in times.items()},
        "hits_on": stats["on"].prefix_cache_hits, "queries_on": stats["on"].prefix_cache_queries,
        "host_s": {k: round(s.host_s, 2) for k, s in stats.items()},
        "device_s": {k: round(s.device_s, 2) for k, s in stats.items()}}))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
