"""What the DeltaNet scan costs: a Qwen3.5 model (8 layers, 6 Gated DeltaNet + 2 full attention)
against a Qwen3 of the same width and depth (8 full-attention layers), random weights, float32,
one row computing T new tokens after 256 positions (`ModelRunner.run_logits`), best of 5 runs
alternating the two models. Accuracy beside it: the Qwen3.5 model's 192-token prefill against HF
transformers in float32 (its chunked delta rule), token by token, and in float64.

    cd <repo> && python bench/deltanet/scan_cost.py      (docs/benchmarks.md, "Qwen3.5")
"""
import sys, tempfile, time

import numpy as np
import torch
import transformers
sys.path.insert(0, '.')
from pathlib import Path
from tests.support import family_checks as fc
from tests.support.engine_helpers import make_runner, shuffled_blocks
from ferrox_jax.plan import RowPlan
common = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
q35 = transformers.Qwen3_5TextConfig(**common, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=64, linear_value_head_dim=64,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])
q35.architectures = ["Qwen3_5ForCausalLM"]
q3 = transformers.Qwen3Config(**common); q3.architectures = ["Qwen3ForCausalLM"]
runners = {}
for name, cfg in (("qwen3_5", q35), ("qwen3", q3)):
    path = fc.make_checkpoint(Path(tempfile.mkdtemp()) / name, cfg)
    runners[name] = (make_runner(path, num_blocks=600, block_size=16, max_context=1024, max_chunk_tokens=256)[0], path)
blocks = shuffled_blocks(64, 600, 1)
rng = np.random.RandomState(0)
prompt = rng.randint(0, 380, 512).tolist()
def step(r, toks, start):
    return r.run_logits([RowPlan(row_id=1, token_ids=tuple(toks), start_pos=start, block_ids=tuple(blocks), sample=False, state_slot=1)])[0]
hf = fc.hf_model(runners["qwen3_5"][1])
ours = step(runners["qwen3_5"][0], prompt[:192], 0)
ref, rec = fc.hf_logits(hf, prompt[:192]), fc.hf_chunked_logits(hf, prompt[:192], 1)
with torch.no_grad():
    ref64 = hf.double()(torch.tensor([prompt[:192]])).logits[0].numpy()
print(f"192-token prefill max |dlogit|: ours vs HF f32 {np.abs(ours - ref).max():.2e}, vs HF token by token "
      f"{np.abs(ours - rec).max():.2e}, vs HF f64 {np.abs(ours - ref64).max():.2e}; HF f32 vs HF f64 "
      f"{np.abs(ref - ref64).max():.2e}; logits up to {np.abs(ref64).max():.1f}")
for t in (1, 16, 64, 256):
    best = {}
    for rep in range(5):
        for name in (("qwen3_5", "qwen3") if rep % 2 == 0 else ("qwen3", "qwen3_5")):
            r = runners[name][0]
            step(r, prompt[:256], 0)  # the row's first 256 positions
            t0 = time.perf_counter(); step(r, prompt[256:256 + t], 256); dt = time.perf_counter() - t0
            best[name] = min(best.get(name, 1e9), dt)
    print(f"T={t:4d}: qwen3_5 {best['qwen3_5']*1e3:8.2f} ms  qwen3 {best['qwen3']*1e3:8.2f} ms  ratio {best['qwen3_5']/best['qwen3']:.2f}")
