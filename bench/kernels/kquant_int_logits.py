"""A K-quant GGUF's one-row logits on the integer row path against the float row path.

    python bench/kernels/kquant_int_logits.py /work/gguf/llama-3.2-1b-Q4_K_M.gguf [--tokens 32]

Loads the file twice with the CPU kernels (the K-quant kernel's wide_rows 0: float32
activations, the float row path; 1: the one-row integer path, block_matmul_k_rowint.inc).
Per prompt: the float side's greedy continuation (chunked prefill, then one-row decode
steps), then prompt + continuation fed one token a step to both sides (every projection a
one-row product), the logits compared per position: max |diff|, KL(float || int) mean and
max, top-1 agreement; and the integer side's own greedy continuation, how many leading
tokens match. The one-token calls alternate between the sides (in both orders) and are
timed: best and median ms of a one-row step through `run_logits` (its host work and the
full-vocabulary logits' copy included) on each path. Only the K-quant tensors change path (the block kernel's Q4_0 / Q8_0 tensors
keep wide_rows 0 in both: the same as the float side below 5 rows).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    import jax.numpy as jnp

    from ferrox_jax.plan import RowPlan
    from models import cpu_kernels
    from models.loader import load_checkpoint
    from tools.parity.compare_logits import FerroxSide

    sides = {}
    for wide in (0, 1):
        ckpt = load_checkpoint(args.model, dtype=jnp.float32, quantization="gguf",
                               decode_attention=cpu_kernels.decode_attention())
        cpu_kernels.pack_blocks_for_kernel(ckpt.model, int_rows=0, wide_rows=wide)
        sides[wide] = FerroxSide(ckpt.model, 256, 1)
        tok = ckpt.tokenizer
    report = []
    times = {0: [], 1: []}
    for text in PROMPTS:
        ids = list(tok.encode(text))
        cont = sides[0].greedy(ids, args.tokens)
        seq = ids + cont
        logits = {0: [], 1: []}
        for pos, t in enumerate(seq):
            for wide in ((0, 1) if pos % 2 else (1, 0)):  # the two sides alternate, in both orders
                side = sides[wide]
                row = RowPlan(row_id=0, token_ids=(t,), start_pos=pos, block_ids=side.tables[0], sample=False)
                t0 = time.perf_counter()
                out = side.runner.run_logits([row])[0]
                times[wide].append(time.perf_counter() - t0)
                logits[wide].append(np.asarray(out[-1], np.float64))
        a, b = np.stack(logits[0]), np.stack(logits[1])
        la = a - a.max(1, keepdims=True)
        la -= np.log(np.exp(la).sum(1, keepdims=True))
        lb = b - b.max(1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(1, keepdims=True))
        kl = (np.exp(la) * (la - lb)).sum(1)
        int_cont = sides[1].greedy(ids, args.tokens)
        match = next((i for i, (x, y) in enumerate(zip(cont, int_cont)) if x != y), len(cont))
        report.append({"prompt": text, "positions": len(seq), "max_abs": float(np.abs(a - b).max()),
                       "logit_spread": float(a.std()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                       "top1": float((a.argmax(1) == b.argmax(1)).mean()), "greedy_match": match})
        print(json.dumps(report[-1]), flush=True)
    # one-token steps past the first prompt's first 4 (compiles, caches): best and median ms
    for wide, name in ((0, "float row path"), (1, "integer row path")):
        ts = np.asarray(times[wide][4:]) * 1e3
        print(json.dumps({"path": name, "steps": len(ts), "best_ms": round(float(ts.min()), 2),
                          "median_ms": round(float(np.median(ts)), 2)}), flush=True)


if __name__ == "__main__":
    main()
