"""KV bytes per token of context, and rows a fixed KV budget holds, with the sliding-window
layers in a pool of their own (`ferrox_jax/kv_groups.py`) and without it (one pool for
every layer, as before).

Measured through the engine's own sizing (`ferrox_jax.engine_builder.size_kv`: the bytes
a loaded engine's `describe()` and `/v1/cache/status` report as `kv_bytes`) from the
config alone, so it runs on a laptop in seconds; nothing is timed.

    python -m tools.bench.kv_groups_bytes                     # the docs' table (bfloat16 cache, blocks of 16)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import tempfile
from pathlib import Path

from models.known_shapes import SHAPES

# gpt-oss-20b's config.json (the shapes that size the cache: 24 layers, 8 KV heads of 64,
# a 128-key window on every other layer).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_local_experts": 32, "num_experts_per_tok": 4, "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "original_max_position_embeddings": 4096},
    "attention_bias": True, "tie_word_embeddings": False, "eos_token_id": 200002,
}
# Mistral-7B-v0.1's config.json: a 4096-key window on every layer (the pool is the whole
# cache; the block ids hold no bytes).
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "sliding_window": 4096, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
# Gemma-4-E2B's text config (the shapes that size the cache): 35 layers, four 512-key sliding
# layers to one full, one KV head of 256 (sliding) or 512 (full); the last 20 layers read
# the K/V of the last earlier layer of their kind, so 15 layers hold arrays.
GEMMA_4_E2B = {
    "architectures": ["Gemma4ForCausalLM"], "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
    "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "sliding_window": 512, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "max_position_embeddings": 131072,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7, "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
}
SHAPES_MEASURED = {"gemma-3-27b": SHAPES["gemma-3-27b"], "gpt-oss-20b": GPT_OSS_20B, "mistral-7b": MISTRAL_7B,
                   "gemma-4-e2b": GEMMA_4_E2B}


@contextlib.contextmanager
def one_pool():
    """Sizing as before the groups: every layer's arrays hold every block."""
    import ferrox_jax.engine_builder as builder

    real = builder.window_plan
    builder.window_plan = lambda *a, **k: None
    try:
        yield
    finally:
        builder.window_plan = real


@functools.cache
def model_config(folder: Path):
    from models.loader import open_checkpoint

    return open_checkpoint(str(folder), load_format="dummy").config


def kv_bytes(folder: Path, **settings) -> tuple[int, int]:
    """(the cache's bytes, its full-attention blocks with the null block) for `settings`:
    `size_kv`, what `plan_memory` and a loaded engine size the cache with (bfloat16)."""
    import jax.numpy as jnp

    from ferrox_jax.config import EngineConfig
    from ferrox_jax.engine_builder import size_kv

    config = EngineConfig(model=str(folder), load_format="dummy", dtype="bfloat16", **settings)
    sizing = size_kv(config, model_config(folder), jnp.bfloat16)
    return sizing.kv_bytes, sizing.num_blocks


def rows_that_fit(folder: Path, gib: float, context: int, block_size: int, prefill_chunk: int) -> int:
    """Most rows of a whole `context` a `gib` KV budget holds (every row's blocks admitted,
    and the cache within the budget: every layer sliding, the blocks are logical and the
    pool, which grows with the rows, is what the budget bounds)."""
    per_row = -(-context // block_size)
    rows = 0
    while True:
        size, blocks = kv_bytes(folder, kv_memory_gib=gib, max_context=context, max_seqs=rows + 1,
                                block_size=block_size, prefill_chunk=prefill_chunk)
        if blocks - 1 < (rows + 1) * per_row or size > gib * (1 << 30):
            return rows
        rows += 1


def measure(block_size: int = 16, prefill_chunk: int = 128, gib: float = 64.0) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in SHAPES_MEASURED.items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            row = {"shape": name}
            for context in (8192, 32768):
                # one row of a whole context: its blocks, and (grouped) its window's slots
                settings = dict(max_context=context, max_seqs=1, block_size=block_size, prefill_chunk=prefill_chunk,
                                kv_blocks=-(-context // block_size))
                with one_pool():
                    before, _ = kv_bytes(folder, **settings)
                after, _ = kv_bytes(folder, **settings)
                row[f"bytes_per_token_{context // 1024}k"] = (before / context, after / context)
            with one_pool():
                row["rows_before"] = rows_that_fit(folder, gib, 32768, block_size, prefill_chunk)
            row["rows_after"] = rows_that_fit(folder, gib, 32768, block_size, prefill_chunk)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--kv-memory-gib", type=float, default=64.0)
    args = parser.parse_args(argv)
    for row in measure(args.block_size, args.prefill_chunk, args.kv_memory_gib):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
