"""LoRA slots under tensor parallelism, run by tests/system/test_lora_sharding.py in a subprocess.

The pytest process stays single-device; this script sets
`XLA_FLAGS=--xla_force_host_platform_device_count=2` before jax is imported, so the CPU
backend shows 2 devices. It prints one JSON object on the last stdout line; the test
asserts.

    python tests/support/lora_sharding_probe.py BASE ADAPTER...

BASE is an HF checkpoint, each ADAPTER a PEFT folder. One runner with adapter slots at
tp=1 and one at tp=2 each load every adapter and run the same batch: one row per adapter
plus a base row (slot 0), prefilled together and then decoded greedily together.
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

NUM_BLOCKS = 64
BLOCK_SIZE = 4
DECODE_STEPS = 5
PROMPT_LENGTHS = (19, 13, 7)  # rows of different lengths, so valid masks and block tables matter


def batched_greedy(runner, prompts, slots):
    """Each row's logits f32[len(prompt) + DECODE_STEPS, V] and tokens, every step one batch."""
    from ferrox_jax.plan import RowPlan

    order = np.random.RandomState(1).permutation(np.arange(1, NUM_BLOCKS))
    tables = [tuple(order[10 * i:10 * i + 10].tolist()) for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]

    def rows(new, starts):
        return [RowPlan(row_id=i, token_ids=tuple(t), start_pos=s, block_ids=tables[i], sample=False,
                        adapter_slot=slots[i]) for i, (t, s) in enumerate(zip(new, starts))]

    logits = [[x] for x in runner.run_logits(rows(tokens, [0] * len(tokens)))]
    for _ in range(DECODE_STEPS):
        for i, row in enumerate(logits):
            tokens[i].append(int(row[-1][-1].argmax()))
        step = runner.run_logits(rows([t[-1:] for t in tokens], [len(t) - 1 for t in tokens]))
        for i, x in enumerate(step):
            logits[i].append(x)
    return [np.concatenate(x) for x in logits], tokens


def placement(runner):
    """Shard shapes of the A/B stacks and the base weight beside them, per projection."""
    from ferrox_jax.sharding import describe_sharding

    layer = runner.state["layers"][0]
    out = {}
    for name in ("q_proj", "o_proj", "gate_proj", "down_proj"):
        w = layer[name].get_value()
        out[name] = {part: describe_sharding(getattr(w, part))["shard_shapes"] for part in ("base", "a", "b")}
    return out


def main(base, *adapters):
    from ferrox_jax.sharding import make_mesh
    from tests.support.lora_helpers import lora_runner

    t0 = time.perf_counter()
    results, placed = {}, None
    for tp in (1, 2):
        runner, registry, ckpt = lora_runner(base, max_loras=len(adapters), mesh=None if tp == 1 else make_mesh(1, tp),
                                             num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_context=128)
        slots = [registry.load(f"adapter{i}", path).slot for i, path in enumerate(adapters)] + [0]
        rng = np.random.RandomState(3)
        prompts = [rng.randint(3, ckpt.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS[:len(slots)]]
        results[tp] = batched_greedy(runner, prompts, slots)
        if tp == 2:
            placed = placement(runner)
    rows = []
    for i in range(len(results[1][0])):
        rows.append({"slot": i + 1 if i < len(adapters) else 0,
                     "max_abs_err": float(np.abs(results[2][0][i] - results[1][0][i]).max()),
                     "same_greedy": results[2][1][i] == results[1][1][i]})
    return {"rows": rows, "placement": placed, "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
