"""A K-quant GGUF's one-row logits on the integer row path against the float row path.

    python bench/kernels/kquant_int_logits.py /work/gguf/llama-3.2-1b-Q4_K_M.gguf [--tokens 32]

Loads the file twice with the CPU kernels (the K-quant kernel's wide_rows 0: float32
activations, the float row path; 1: the one-row integer path, block_matmul_k_rowint.inc).
Per prompt: the float side's greedy continuation (chunked prefill, then one-row decode
steps), then prompt + continuation fed one token a step to both sides (every projection a
one-row product), the logits compared per position: max |diff|, KL(float || int) mean and
max, top-1 agreement; and the integer side's own greedy continuation, how many leading
tokens match. Only the K-quant tensors change path (the block kernel's Q4_0 / Q8_0 tensors
keep wide_rows 0 in both: the same as the float side below 5 rows).
"""

from __future__ import annotations

import argparse
import json

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
    for text in PROMPTS:
        ids = list(tok.encode(text))
        cont = sides[0].greedy(ids, args.tokens)
        seq = ids + cont
        logits = {}
        for wide, side in sides.items():
            rows = []
            for pos, t in enumerate(seq):
                row = RowPlan(row_id=0, token_ids=(t,), start_pos=pos, block_ids=side.tables[0], sample=False)
                rows.append(np.asarray(side.runner.run_logits([row])[0][-1], np.float64))
            logits[wide] = np.stack(rows)
        a, b = logits[0], logits[1]
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


if __name__ == "__main__":
    main()
