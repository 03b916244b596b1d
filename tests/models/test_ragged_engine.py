"""The ragged kernels end to end through the engine (Pallas interpret mode on the CPU):
greedy continuations equal to the pure-JAX engine's.

Three prompts go in at once into an engine of 4 rows and 16-token chunks, so steps mix
decode rows with prompt chunks that start at position 0 and mid-prompt; every layer of
every step attends through the kernel in one call. A two-layer Llama with the default model's
attention geometry (head_dim 64, 9 heads over 3 KV heads) runs the GPU kernel, whose
interpret mode compiles in seconds a layer (tests/models/test_ragged_engine_gpu.py, with
this file's helpers). The TPU kernel, whose interpret mode costs several times that, runs two tiny
families here: Gemma 2 (a sliding window on alternate layers and soft-capped logits) and
a Llama with prompt-lookup speculation, whose verification steps hand the kernel spans
of 1 + k tokens (`models/ragged_attention.py: ragged_spans`).

No warm-up: only the shapes the workload reaches are compiled.
"""

from __future__ import annotations

import pytest
import transformers

from ferrox_jax import LLM, SamplingParams
from ferrox_jax.config import EngineConfig, SpeculativeConfig
from ferrox_jax.engine import Engine
from tests.support import family_checks as fc

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is Paris. The capital of Italy is",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
MAX_TOKENS = 12
LIMITS = dict(dtype="float32", block_size=16, kv_blocks=64, max_seqs=4, prefill_chunk=16, max_context=256)


def greedy(model: str, impl: str, **settings):
    """Each prompt's greedy tokens through an engine with `attention_impl=impl`, the
    engine's note of which attention it chose, and its stats."""
    engine = Engine.load(EngineConfig(model=model, attention_impl=impl, **{**LIMITS, **settings}))
    try:
        engine.start()
        outputs = LLM.from_engine(engine).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                                   use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs], engine.describe()["attention"], engine.stats()
    finally:
        engine.shutdown()


def assert_same_greedy(model: str, impl: str, **settings):
    """Returns the kernel engine's stats."""
    want, _, _ = greedy(model, "jax", **settings)
    got, note, stats = greedy(model, impl, **settings)
    assert "ragged paged attention" in note, f"the engine did not choose the ragged kernel: {note}"
    # 3 prompts, one 16-token chunk a step: every chunk after the first shares its step
    # with decoding rows.
    assert stats.prefill_chunks >= 3 and stats.decode_steps > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(w) == MAX_TOKENS, f"prompt {i}: the reference stopped early ({len(w)} tokens)"
        assert g == w, f"prompt {i}: {impl} greedy {g} differs from pure JAX {w}"
    return stats


def test_gemma2_through_the_tpu_kernel_matches_pure_jax(tmp_path):
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=512, query_pre_attn_scalar=24, sliding_window=12,
                                       attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    path = fc.make_checkpoint(tmp_path / "tiny-gemma2", config)
    assert_same_greedy(str(path), "ragged-tpu-interpret")


def test_speculating_llama_through_the_tpu_kernel_matches_pure_jax(tiny_llama):
    stats = assert_same_greedy(str(tiny_llama), "ragged-tpu-interpret",
                               speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1))
    assert stats.spec_decode_num_draft_tokens > 0, "no step verified a draft: no 1 + k span reached the kernel"
