"""TTFT of a chat's turn 2 (turn 1's 190-token prompt, its 96-token reply, 16 new tokens = 302
tokens) served from the host KV tier after turn 1's blocks and decode snapshot left the device
(3 other 300-token prompts in between), against the same prompt cold (prefix caching off).
Synthetic Qwen3.5 (hidden 256, 8 layers: 6 DeltaNet + 2 full), float32, CPU, blocks of 16,
chunks of 64; the tiered engine's device cache 48 blocks. Paired runs, order alternated.

    .venv/bin/python bench/offload/snapshot_ttft.py   (results: docs/benchmarks.md, "Recurrent-state snapshot copies")
"""
import os
import time
from pathlib import Path

import numpy as np
import transformers

from tests.support import family_checks as fc
from ferrox_jax import LLM, SamplingParams

lt = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
cfg = transformers.Qwen3_5TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, layer_types=lt, max_position_embeddings=1024,
    rms_norm_eps=1e-6, tie_word_embeddings=False)
cfg.architectures = ["Qwen3_5ForCausalLM"]
path = fc.make_checkpoint(Path(os.environ.get("SNAPSHOT_TTFT_CKPT", "/tmp/snapshot-ttft-ckpt")), cfg)
S = dict(dtype="float32", quantization="none", block_size=16, max_seqs=2, prefill_chunk=64, max_context=512)
rng = np.random.RandomState(0)
first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1)
reply_params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)


def run(llm, p, params=first):
    t = time.perf_counter()
    out, = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    return time.perf_counter() - t, out.outputs[0], out.num_cached_tokens


with LLM(str(path), kv_blocks=48, kv_offload_gib=0.05, **S) as tier, LLM(str(path), prefix_caching=False, kv_blocks=160, **S) as cold:
    times = {"host tier": [], "cold": []}
    errs, cached_all = [], []
    print("load", os.getloadavg(), flush=True)
    for i in range(7):
        turn1 = rng.randint(0, 250, 190).tolist()
        _, c, _ = run(tier, turn1, reply_params)
        reply, tail = list(c.token_ids), rng.randint(0, 250, 16).tolist()
        for _ in range(3):
            run(tier, rng.randint(0, 250, 300).tolist())
        turn2 = turn1 + reply + tail
        before = tier.engine.stats()
        res = {}
        for name in (["host tier", "cold"] if i % 2 == 0 else ["cold", "host tier"]):
            llm = tier if name == "host tier" else cold
            t, c, cached = run(llm, turn2)
            res[name] = (t, c.token_ids[0], c.logprobs[0][c.token_ids[0]].logprob, cached)
            times[name].append(t)
        after = tier.engine.stats()
        assert res["host tier"][1] == res["cold"][1]
        errs.append(abs(res["host tier"][2] - res["cold"][2]))
        cached_all.append((res["host tier"][3], after.prefix_cache_hits_host - before.prefix_cache_hits_host,
                           after.kv_offload_snapshots_restored - before.kv_offload_snapshots_restored))
        print(i, {k: round(v[0] * 1e3, 1) for k, v in res.items()}, cached_all[-1], f"{errs[-1]:.2e}", flush=True)
    for k, v in times.items():
        print(k, "best %.1f ms median %.1f ms" % (1e3 * min(v), 1e3 * float(np.median(v))))
    print("max |dlogprob|", max(errs), "recompiles", tier.engine.stats().recompiles_after_warmup,
          cold.engine.stats().recompiles_after_warmup, "snapshot bytes", tier.engine.stats().kv_offload_snapshot_bytes,
          "host snapshots", tier.engine.stats().kv_offload_snapshots_total)
    print("load", os.getloadavg(), flush=True)
