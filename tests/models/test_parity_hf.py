"""ferrox logits vs HF transformers on tiny random checkpoints (float32, atol 1e-4)."""

import numpy as np
import pytest
import torch
import transformers

from ferrox_jax.plan import RowPlan
from tests.support.engine_helpers import float32_matmuls, make_runner, shuffled_blocks  # noqa: F401 (autouse)

ATOL = 1e-4  # both float32; differences come only from summation order
DECODE_STEPS = 32


@pytest.mark.parametrize("variant", ["llama", "qwen2", "llama3_rope"])
def test_prefill_and_decode_logits_match_transformers(tiny_checkpoints, variant):
    path = tiny_checkpoints(variant)
    runner, ckpt = make_runner(path, num_blocks=64, block_size=8, max_context=256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = np.random.RandomState(0).randint(0, ckpt.config.vocab_size, 37).tolist()
    blocks = tuple(shuffled_blocks(12, 64, seed=1))  # 12 * 8 = 96 >= 37 + 32 positions
    ours = [runner.run_logits([RowPlan(row_id=0, token_ids=tuple(prompt), start_pos=0, block_ids=blocks,
                                       sample=False)])[0]]
    tokens = list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(ours[-1][-1].argmax()))
        step = RowPlan(row_id=0, token_ids=(tokens[-1],), start_pos=len(tokens) - 1, block_ids=blocks, sample=False)
        ours.append(runner.run_logits([step])[0])
    ours = np.concatenate(ours)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].numpy()
    # ours[i] predicts token i+1; the reference's last row predicts past the sequence too.
    assert ours.shape == ref.shape
    prefill_err = np.abs(ours[: len(prompt)] - ref[: len(prompt)]).max()
    decode_err = np.abs(ours[len(prompt):] - ref[len(prompt):]).max()
    assert prefill_err < ATOL, f"{variant} prefill logits differ by {prefill_err}"
    assert decode_err < ATOL, f"{variant} decode logits differ by {decode_err}"
