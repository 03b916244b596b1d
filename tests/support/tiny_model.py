"""Tiny random Llama-family checkpoints written as real HF folders, for fast tests.

`make_tiny_checkpoint(dir)` saves config.json + model.safetensors (transformers,
fixed seed) plus a small byte-level BPE tokenizer.json with ChatML special tokens and
a chat template, so every loader, the tokenizer and the API run on real files.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests while others decode.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Unicode: café, naïve, 東京, 😀.",
] * 4


def make_vision_tokenizer(folder: Path, special_tokens, chat_template: str) -> dict[str, int]:
    """A 384-token tokenizer in `folder` with the image `special_tokens` added and `chat_template`
    in its config (the vision checkpoints' shared part); returns its vocabulary."""
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer_files(folder, vocab_size=384)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return tok.get_vocab()


def make_tokenizer_files(folder: Path, vocab_size: int) -> int:
    """Write tokenizer.json and tokenizer_config.json; return the vocab size used."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return tok.get_vocab_size()


def make_tiny_checkpoint(folder, variant: str = "llama", seed: int = 0, num_layers: int = 2,
                         max_position_embeddings: int = 512) -> Path:
    """Save a tiny random model of `variant` ("llama", "qwen2", "llama3_rope") under folder."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer_files(folder, vocab_size=384)
    with (folder / "tokenizer.json").open() as f:
        vocab_map = json.load(f)["model"]["vocab"]
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=vocab_map.get("<|im_end|>", 2),
        pad_token_id=0, tie_word_embeddings=False,
    )
    if variant == "llama":
        config = transformers.LlamaConfig(rope_theta=10000.0, **common)
    elif variant == "llama3_rope":
        config = transformers.LlamaConfig(
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common,
        )
    elif variant == "qwen2":
        config = transformers.Qwen2Config(rope_theta=1000000.0, **{**common, "tie_word_embeddings": True})
    else:
        raise ValueError(f"unknown tiny variant {variant!r}")
    return save_random_weights(config, folder, seed)


def save_random_weights(config, folder: Path, seed: int = 0, model_class=None) -> Path:
    """An HF model of `config` (an AutoModelForCausalLM, or `model_class`) with seeded random
    weights, saved as safetensors in `folder`. The default init is tiny; it is widened so the
    logits are not all ~0."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if model_class is None:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)
