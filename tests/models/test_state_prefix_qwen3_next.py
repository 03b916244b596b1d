"""A prefix hit from Qwen3-Next (fused DeltaNet projections, experts with a shared expert) equals
cold, through the whole engine: the same prompt twice on one engine with prefix caching on
(ferrox_jax/state_snapshots.py). The first run is cold (nothing cached shares its tokens) and
leaves its snapshot at floor((21 - 1) / 4) * 4 = 20; the second hits 5 blocks and restores it.
The Qwen3.5 file (tests/models/test_state_prefix_qwen3_5.py) has the mechanism's negative
controls; this one shows the hit for the fused family at one engine's cost.
"""

from __future__ import annotations

import numpy as np
import transformers

from ferrox_jax import LLM, SamplingParams
from tests.models.test_family_qwen3_5 import SHAPES
from tests.support import family_checks as fc


def test_a_qwen3_next_prefix_hit_equals_its_cold_run(tmp_path):
    config = transformers.Qwen3NextConfig(**SHAPES, intermediate_size=128, mlp_only_layers=[2])
    config.architectures = ["Qwen3NextForCausalLM"]
    path = fc.make_checkpoint(tmp_path / "tiny-qwen3-next", config)
    prompt = np.random.RandomState(0).randint(0, 250, 21).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    with LLM(str(path), dtype="float32", quantization="none", block_size=4, max_seqs=2, prefill_chunk=16,
             max_context=64, kv_blocks=32) as llm:
        runs = []
        for _ in range(2):
            out, = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            choice = out.outputs[0]
            runs.append((out.num_cached_tokens, choice.token_ids,
                         np.asarray([lp[t].logprob for lp, t in zip(choice.logprobs, choice.token_ids)])))
        stats = llm.engine.stats()
    (cold_cached, cold_tokens, cold_lp), (warm_cached, warm_tokens, warm_lp) = runs
    err = float(np.abs(warm_lp - cold_lp).max())
    print(f"qwen3_next prefix hit vs cold: max |Δlogprob| {err:.2e}")
    assert cold_cached == 0 and warm_cached == 20, "the second run hits the first's 5 blocks"
    assert stats.state_snapshots_restored == 1 and stats.recompiles_after_warmup == 0
    assert warm_tokens == cold_tokens and err < 1e-5, f"a Qwen3-Next hit differs from cold by {err:.3g}"
