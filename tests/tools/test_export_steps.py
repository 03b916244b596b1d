"""tools/device/export_steps.py on small shapes: every compiled step lowers for TPU and CUDA.

The real shapes (Llama-3.1-8B / 70B, Qwen3-30B-A3B, Gemma-3-27B at TP 1 / 4 / 8) take the
tool about an hour on two cores; their report is docs/export-report.md. Here a tiny
Gemma 2 (a sliding-window and a full layer, both soft-capped) goes through the same
path in seconds: single device, a mesh of 2 (KV heads split) and of 4 (its 2 KV heads
do not divide 4, so the attention is replicated).
"""

from __future__ import annotations

import pytest

from tools.device import export_steps as es

SMALL = es.Settings(max_seqs=2, prefill_chunk=16, max_context=128, kv_memory_gib=0.01)
ARGS = ["--max-seqs", "2", "--prefill-chunk", "16", "--max-context", "128", "--kv-memory-gib", "0.01"]


@pytest.mark.parametrize("platform,tp", [("tpu", 1), ("tpu", 2), ("cuda", 1), ("cuda", 2), ("tpu", 4)])
def test_every_step_of_a_small_shape_lowers_with_the_ragged_kernel(platform, tp):
    r = es.export_target("tiny-gemma2", platform, tp, SMALL)
    assert not r.failures, f"{r.name}: {r.failures}"
    # Rows 1, 2; chunks of 16, up to 4 a step (an accelerator's default budget): forwards
    # 2 decode + 3 chunk (1, 2, 4 chunks) + 3 mixed (2 rows with each) = 8; samplers for
    # 1, 2, 3, 4, 6 rows = 5; the block copy: 14.
    assert (r.exported, r.executables) == (14, 14)
    label = "ragged, Pallas TPU" if platform == "tpu" else "ragged, Pallas GPU (Triton)"
    assert r.kernel_by_layer_kind == {"sliding window 64, soft-cap 50 (1 layers)": label,
                                      "full attention, soft-cap 50 (1 layers)": label}
    assert r.replicate_attention == (tp == 4)
    # Both layers' K and V: 2 KV heads x hd 16 x 2 bytes per position, split over the mesh
    # unless replicated (0.01 GiB of blocks of 16 positions: the sizing's block count).
    per_position = 2 * 2 * 2 * 16 * 2 // (tp if tp == 2 else 1)
    assert r.kv_bytes_per_device % per_position == 0 and r.kv_bytes_per_device == r.expected["kv_bytes_per_device"]


def test_a_sharding_that_does_not_divide_fails_naming_the_shape(capsys):
    rc = es.main(["--shapes", "tiny", "--platforms", "tpu", "--tp", "3", *ARGS])
    out = capsys.readouterr().out
    assert rc == 1, "a target that cannot be built must fail the run"
    assert "tiny on tpu at TP 3" in out and "does not divide" in out


def test_a_block_size_the_kernel_refuses_fails_naming_the_reason(capsys):
    rc = es.main(["--shapes", "tiny", "--platforms", "tpu", "--tp", "1", "--block-size", "8", *ARGS])
    out = capsys.readouterr().out
    assert rc == 1, "auto falling back to pure JAX on a TPU must fail the run"
    assert "auto did not pick the ragged kernel on tpu" in out and "block_size 8 is not a multiple of 16" in out
