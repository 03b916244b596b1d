"""The checks every model family passes, shared by the tests/models/test_family_*.py modules.

Each family module builds one tiny random checkpoint with transformers from a config
written in the test (no download), then `check_family(path)` runs, once per module:
- parity: a 48-token prefill and 32 greedy decode steps through the paged runner, against
  HF's logits for the whole sequence (float32 both sides, atol 1e-4: only the summation
  order differs), and the greedy tokens HF would pick;
- chunked prefill (3 chunks of 16) against the one-shot prefill (for longrope, whose
  table depends on the call's longest position, against HF prefilling the same chunks
  into its KV cache instead);
- two rows decoding in one batch against each row alone.
Block size 4 with an attention chunk of 8 blocks = 32 keys, so a sliding window of
12-16 keys crosses blocks, and decode positions past 43 start their block walk at the
second chunk (models/attention.py): the skip is exercised, not just the mask.
`serve(path)` answers a chat and a completion through a real server and the openai client.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

ATOL = 1e-4  # float32 both sides; differences come only from summation order
PROMPT_TOKENS = 48  # 3 prefill chunks of 16; longer than every test window
DECODE_STEPS = 32
CHUNK_TOKENS = 16
BLOCK_SIZE = 4
NUM_BLOCKS = 96  # 95 usable: four rows of <= 20 blocks (80 positions) each
MAX_CONTEXT = 128
# Engine limits for the served checks: 2 decode rows and one 16-token prefill bucket
# keep the warm-up to four small compiles.
SERVE_LIMITS = dict(block_size=BLOCK_SIZE, kv_blocks=NUM_BLOCKS, max_seqs=2, max_queue=8, prefill_chunk=CHUNK_TOKENS,
                    max_context=MAX_CONTEXT)


def make_checkpoint(folder: Path, config, seed: int = 0, chat_template: str | None = None) -> Path:
    """Save a tiny random HF model for `config` (its vocab_size set to the tokenizer's) plus
    the tests' byte-level BPE tokenizer; `chat_template` replaces the ChatML one."""
    from tests.support.tiny_model import make_tokenizer_files, save_random_weights

    folder.mkdir(parents=True, exist_ok=True)
    config.vocab_size = make_tokenizer_files(folder, vocab_size=384)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    config.eos_token_id = vocab["<|im_end|>"]
    config.pad_token_id = vocab["<|endoftext|>"]
    config.bos_token_id = None
    if chat_template is not None:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        tok_cfg["chat_template"] = chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return save_random_weights(config, folder, seed)



def make_tiny_qwen3_5(folder: Path) -> Path:
    """The tiny random Qwen3.5 text model (transformers 5.25) the recurrent-state tests share:
    4 layers, DeltaNet and gated full attention alternating, 2 k / 4 v DeltaNet heads of 16."""
    import transformers

    config = transformers.Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return make_checkpoint(folder, config)

def hf_model(path: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """HF logits f32[len(tokens), V] for the whole sequence in one forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


@dataclasses.dataclass
class FamilyReport:
    """What check_family measured (the test modules assert on it)."""

    config: object  # our ModelConfig
    prompt: list[int]
    tokens: list[int]  # prompt + our greedy continuation
    prefill_err: float  # max |ours - HF| over the prompt's logits
    decode_err: float  # ... over the decode steps' logits
    hf_greedy: list[int]  # HF's argmax after each position from the prompt's last on
    chunked_err: float  # 3 chunks of 16 vs one-shot prefill (ours), or vs HF's chunks (chunked_vs_hf)
    chunked_vs_hf: bool
    batched_err: float  # two rows in one decode batch vs each alone (ours)


def _row(tokens, start, blocks):
    from ferrox_jax.plan import RowPlan

    return RowPlan(row_id=0, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(blocks), sample=False)


def hf_chunked_logits(model, tokens: list[int], chunk: int) -> np.ndarray:
    """HF logits when `tokens` are fed `chunk` at a time into its KV cache."""
    import torch

    from models.reference import hf_cache_kwarg

    cache_kwarg, cache, out = hf_cache_kwarg(model), None, []
    with torch.no_grad():
        for s in range(0, len(tokens), chunk):
            kwargs = {cache_kwarg: cache} if cache is not None else {}
            res = model(torch.tensor([tokens[s:s + chunk]]), use_cache=True, **kwargs)
            cache = getattr(res, "cache", None) or res.past_key_values
            out.append(res.logits[0].float().numpy())
    return np.concatenate(out)


def check_family(path: Path, hf=None, seed: int = 0, chunked_vs_hf: bool = False) -> FamilyReport:
    """Run the shared checks on a checkpoint folder; `hf` reuses an HF model already loaded.
    `chunked_vs_hf`: compare the chunked prefill with HF's chunked prefill, not one-shot."""
    from tests.support.engine_helpers import make_runner, shuffled_blocks

    runner, ckpt = make_runner(path, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_context=MAX_CONTEXT)
    hf = hf if hf is not None else hf_model(path)
    rng = np.random.RandomState(seed)
    vocab = ckpt.config.vocab_size
    prompt = rng.randint(0, vocab, PROMPT_TOKENS).tolist()
    ids = shuffled_blocks(NUM_BLOCKS - 1, NUM_BLOCKS, seed=1)
    parity_blocks, chunk_blocks, a_blocks, b_blocks = ids[:20], ids[20:32], ids[32:46], ids[46:60]

    one_shot = runner.run_logits([_row(prompt, 0, parity_blocks)])[0]
    ours, tokens = [one_shot], list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(ours[-1][-1].argmax()))
        ours.append(runner.run_logits([_row(tokens[-1:], len(tokens) - 1, parity_blocks)])[0])
    ours = np.concatenate(ours)
    ref = hf_logits(hf, tokens)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)  # ours[i] predicts token i+1, as HF's
    n = len(prompt)

    chunked = np.concatenate([runner.run_logits([_row(prompt[s:s + CHUNK_TOKENS], s, chunk_blocks)])[0]
                              for s in range(0, n, CHUNK_TOKENS)])

    prompt_b = rng.randint(0, vocab, PROMPT_TOKENS).tolist()
    last = {"a": runner.run_logits([_row(prompt, 0, a_blocks)])[0][-1],
            "b": runner.run_logits([_row(prompt_b, 0, b_blocks)])[0][-1]}
    seqs, blocks = {"a": list(prompt), "b": prompt_b}, {"a": a_blocks, "b": b_blocks}
    batched_err = 0.0
    for _ in range(4):
        steps = {}
        for key in ("a", "b"):
            seqs[key].append(int(last[key].argmax()))
            steps[key] = _row(seqs[key][-1:], len(seqs[key]) - 1, blocks[key])
        together = runner.run_logits([steps["a"], steps["b"]])
        for i, key in enumerate(("a", "b")):
            alone = runner.run_logits([steps[key]])[0]  # rewrites the same K/V: idempotent
            batched_err = max(batched_err, float(np.abs(together[i] - alone).max()))
            last[key] = alone[-1]

    return FamilyReport(
        config=ckpt.config, prompt=prompt, tokens=tokens,
        prefill_err=float(np.abs(ours[:n] - ref[:n]).max()),
        decode_err=float(np.abs(ours[n:] - ref[n:]).max()),
        hf_greedy=ref[n - 1:-1].argmax(-1).tolist(),
        chunked_err=float(np.abs(chunked - (hf_chunked_logits(hf, prompt, CHUNK_TOKENS) if chunked_vs_hf
                                            else one_shot)).max()),
        chunked_vs_hf=chunked_vs_hf, batched_err=batched_err,
    )


def assert_report(report: FamilyReport, name: str) -> None:
    """The shared assertions, for a family module's one test of them."""
    print(f"{name}: max |Δlogit| vs HF prefill {report.prefill_err:.2e} decode {report.decode_err:.2e}; "
          f"chunked {report.chunked_err:.2e} batched {report.batched_err:.2e}")
    assert report.prefill_err < ATOL, f"{name}: prefill logits differ from HF by {report.prefill_err:.3g}"
    assert report.decode_err < ATOL, f"{name}: decode logits differ from HF by {report.decode_err:.3g}"
    assert report.tokens[len(report.prompt):] == report.hf_greedy, f"{name}: greedy tokens differ from HF's"
    # Same math in other shapes: only the summation order may differ (vs HF: as above).
    what, tol = ("HF's chunked prefill", ATOL) if report.chunked_vs_hf else ("one-shot", 1e-5)
    assert report.chunked_err < tol, f"{name}: chunked prefill differs from {what} by {report.chunked_err:.3g}"
    assert report.batched_err < 1e-5, f"{name}: a batched row differs from itself alone by {report.batched_err:.3g}"


def serve(path: Path, messages=None) -> dict:
    """A chat and a greedy completion through a real server (tests/support/server_harness.py) and the
    openai client; returns what the test asserts on."""
    import openai

    from api.app import create_app
    from tests.support.server_harness import ServerThread, tiny_engine

    engine = tiny_engine(path, **SERVE_LIMITS)
    with ServerThread(create_app(engine)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        card = client.models.list().data[0]
        chat = client.chat.completions.create(
            model=card.id, messages=messages or [{"role": "user", "content": "Hello world!"}],
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        completion = client.completions.create(model=card.id, prompt="The quick brown fox", max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
    prompt_ids = engine.tokenizer.encode("The quick brown fox")
    return {"architecture": card.model_extra.get("architecture"), "chat": chat, "completion": completion,
            "prompt_ids": prompt_ids, "tokenizer": engine.tokenizer,
            "recompiles": engine.stats().recompiles_after_warmup}


def hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of `prompt_ids` (n tokens, full forward each step)."""
    tokens = list(prompt_ids)
    for _ in range(n):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt_ids):]


def assert_served(served: dict, hf, architecture: str) -> None:
    """The served answers: the architecture on /v1/models, a 6-token chat, and a greedy
    completion whose text is HF's greedy continuation of the same prompt tokens."""
    assert served["architecture"] == architecture
    chat = served["chat"]
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
    want = served["tokenizer"].decode(hf_greedy(hf, served["prompt_ids"], 8))
    assert served["completion"].choices[0].text == want, "served greedy completion differs from HF's"
    assert served["recompiles"] == 0


def check_gguf(hf_dir: Path, out: Path, arch: str, hf, prompt: list[int]) -> dict:
    """Write the checkpoint as llama.cpp would (tests/support/gguf_from_hf.py), load it through the
    GGUF loader and compare its prompt logits with HF's; also the rebuilt tokenizer."""
    from models.loader import load_checkpoint
    from models.tokenizer import Tokenizer
    from tests.support.engine_helpers import make_runner, shuffled_blocks
    from tests.support.gguf_from_hf import write_gguf

    path = write_gguf(hf_dir, out, arch)
    runner, ckpt = make_runner(path, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_context=MAX_CONTEXT)
    ours = runner.run_logits([_row(prompt, 0, shuffled_blocks(20, NUM_BLOCKS, seed=2))])[0]
    text = "Hello world! The quick brown fox."
    err = float(np.abs(ours - hf_logits(hf, prompt)).max())
    print(f"{arch} GGUF: prompt max |Δlogit| vs HF {err:.2e}")
    return {"config": ckpt.config, "err": err,
            "same_tokens": ckpt.tokenizer.encode(text) == Tokenizer.from_hf_dir(hf_dir).encode(text),
            "reference_config": load_checkpoint(str(hf_dir)).config}


def experts_routed(hf, tokens: list[int]) -> list[set[int]]:
    """Per MoE layer, the experts HF's router picks for `tokens` (its router returns
    (logits, top-k weights, top-k indices))."""
    import torch

    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    seen: list[set[int]] = [set() for _ in routers]
    hooks = [r.register_forward_hook(lambda mod, args, out, i=i: seen[i].update(out[2].flatten().tolist()))
             for i, r in enumerate(routers)]
    try:
        hf_logits(hf, tokens)
    finally:
        for h in hooks:
            h.remove()
    return seen
