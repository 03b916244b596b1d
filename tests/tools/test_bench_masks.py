"""tools/bench/bench_masks.py runs on the tiny model and reports what it says it does (not timings)."""

from __future__ import annotations

from ferrox_jax.config import EngineConfig
from ferrox_jax.engine import Engine
from tests.support.server_harness import api_checkpoint
from tools.bench.bench_masks import bench_rows


def test_bench_rows_walks_masked_documents_and_reports_every_field():
    engine = Engine.load(EngineConfig(model=str(api_checkpoint()), dtype="float32", block_size=16, kv_blocks=64,
                                      max_seqs=2, prefill_chunk=16, max_context=256))
    engine.warmup()  # never started: the tool drives the runner itself
    result = bench_rows(engine, rows=2, steps=3, prompt=engine.tokenizer.encode("Records:"))
    assert set(result) == {"rows", "steps", "step_ms_plain", "step_ms_masked", "mask_ms_per_step", "mask_us_per_row",
                           "fills_hidden", "overhead_pct"}
    assert result["fills_hidden"].endswith("/3"), "one fill per masked step"
    assert result["mask_ms_per_step"] > 0 and engine.runner.recompiles_after_warmup == 0
