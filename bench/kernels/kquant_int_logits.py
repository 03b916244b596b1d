"""A K-quant GGUF's logits on the integer path against the float paths, at 1 to 15 rows a step.

    python bench/kernels/kquant_int_logits.py /work/gguf/llama-3.2-1b-Q4_K_M.gguf [--tokens 32] [--rows R]

Loads the file twice with the CPU kernels (the K-quant kernel's wide_rows 0: float32
activations, the float row path at 1 to 3 rows, the tile from 4; 1: the integer paths at 1 to
15 rows, block_matmul_k_rowint.inc at one row, block_matmul_k_rows16.inc from 2). Per prompt: the float side's greedy continuation
(chunked prefill, then one-row decode steps), then prompt + continuation fed one token a
step to both sides, the logits compared per position: max |diff|, KL(float || int) mean and
max, top-1 agreement; and the integer side's own greedy continuation, how many leading
tokens match. With --rows R (1 to 15) the steps carry R prompts at once (one token each:
every projection an R-row product, as a decode step of R sequences), R prompts compared
per group (the whole groups of the 16 prompts), up to the shortest prompt + continuation of the group, and the greedy
continuations run all R rows a step on both sides. The calls alternate between the sides
(in both orders) and are timed: best and median ms of a step through `run_logits` (its host
work and the full-vocabulary logits' copy included) on each path. The block kernel's Q4_0 /
Q4_1 / Q8_0 tensors change path too: wide_rows 1 puts their one-row products on integer dots
(block_matmul_rowint.inc), 2 rows and more on 32-wide int16 activation blocks; so on a file of
those formats (the default model, llama-3.2-1b-Q4_0) the same run measures that kernel.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of",
           "The three primary colors are", "import numpy as np\n\n", "In 1969, the first person to walk on",
           "A haiku about the sea:\n", "The largest planet in the solar system is",
           "SELECT name FROM users WHERE", "The speed of light in a vacuum is", "Once upon a time, in a small village,",
           "class Stack:\n    def __init__(self):\n", "Photosynthesis converts sunlight into",
           "The Pythagorean theorem states that", "To make a cup of tea, first", "The French word for cat is"]


def multi_greedy(side, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuations of all prompts, their rows in one `run_logits` call a step."""
    from ferrox_jax.plan import RowPlan

    rows = [RowPlan(row_id=j, token_ids=tuple(ids), start_pos=0, block_ids=side.tables[j], sample=False)
            for j, ids in enumerate(prompts)]
    last = [int(np.argmax(out[-1])) for out in side.runner.run_logits(rows)]
    outs = [[t] for t in last]
    for i in range(num_tokens - 1):
        rows = [RowPlan(row_id=j, token_ids=(out[-1],), start_pos=len(ids) + i, block_ids=side.tables[j], sample=False)
                for j, (ids, out) in enumerate(zip(prompts, outs))]
        for out, logits in zip(outs, side.runner.run_logits(rows)):
            out.append(int(np.argmax(logits[-1])))
    return outs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=1, help="prompts a step, 1 to 15")
    args = p.parse_args()
    if not 1 <= args.rows <= 15:
        p.error(f"--rows must be 1 to {len(PROMPTS)}")
    import jax.numpy as jnp

    from ferrox_jax.plan import RowPlan
    from models import cpu_attention, cpu_kernels
    from models.loader import load_checkpoint
    from tools.parity.compare_logits import FerroxSide

    sides = {}
    for wide in (0, 1):
        ckpt = load_checkpoint(args.model, dtype=jnp.float32, quantization="gguf",
                               decode_attention=cpu_attention.decode_attention())
        cpu_kernels.pack_blocks_for_kernel(ckpt.model, int_rows=0, wide_rows=wide)
        sides[wide] = FerroxSide(ckpt.model, 256, args.rows)
        tok = ckpt.tokenizer
    report = []
    times = {0: [], 1: []}
    r = args.rows
    groups = [PROMPTS[i:i + r] for i in range(0, len(PROMPTS) - r + 1, r)] if r > 1 else [[t] for t in PROMPTS[:3]]
    for group in groups:
        prompts = [list(tok.encode(text)) for text in group]
        conts = [sides[0].greedy(ids, args.tokens) for ids in prompts]
        seqs = [ids + cont for ids, cont in zip(prompts, conts)]
        length = min(len(seq) for seq in seqs)
        logits = {0: [], 1: []}
        for pos in range(length):
            for wide in ((0, 1) if pos % 2 else (1, 0)):  # the two sides alternate, in both orders
                side = sides[wide]
                rows = [RowPlan(row_id=j, token_ids=(seq[pos],), start_pos=pos, block_ids=side.tables[j],
                                sample=False) for j, seq in enumerate(seqs)]
                t0 = time.perf_counter()
                out = side.runner.run_logits(rows)
                times[wide].append(time.perf_counter() - t0)
                logits[wide].append(np.stack([np.asarray(o[-1], np.float64) for o in out]))
        a, b = np.concatenate(logits[0]), np.concatenate(logits[1])
        la = a - a.max(1, keepdims=True)
        la -= np.log(np.exp(la).sum(1, keepdims=True))
        lb = b - b.max(1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(1, keepdims=True))
        kl = (np.exp(la) * (la - lb)).sum(1)
        if r == 1:
            float_conts, int_conts = conts, [sides[1].greedy(prompts[0], args.tokens)]
        else:
            float_conts, int_conts = (multi_greedy(sides[w], prompts, args.tokens) for w in (0, 1))
        match = [next((i for i, (x, y) in enumerate(zip(c, ic)) if x != y), len(c))
                 for c, ic in zip(float_conts, int_conts)]
        report.append({"prompts": group, "rows": r, "positions": length, "max_abs": float(np.abs(a - b).max()),
                       "logit_spread": float(a.std()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                       "top1": float((a.argmax(1) == b.argmax(1)).mean()),
                       "greedy_match": match if r > 1 else match[0]})
        print(json.dumps(report[-1]), flush=True)
    # one-token steps past the first group's first 4 (compiles, caches): best and median ms
    for wide, name in ((0, "float path"), (1, "integer path")):
        ts = np.asarray(times[wide][4:]) * 1e3
        print(json.dumps({"path": name, "rows": r, "steps": len(ts), "best_ms": round(float(ts.min()), 2),
                          "median_ms": round(float(np.median(ts)), 2)}), flush=True)


if __name__ == "__main__":
    main()
