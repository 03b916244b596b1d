"""A tiny random Gemma 3 vision-language checkpoint (transformers 5.25's `Gemma3ForConditionalGeneration`):
2 text layers (one sliding, one full), a 2-layer SigLIP encoder over 32 x 32 images in 4 x 4 patches,
16 soft tokens per image; the tests' byte-level BPE tokenizer with Gemma 3's three image tokens
added last (`<start_of_image>`, `<end_of_image>`, `<image_soft_token>`) and a ChatML template that
places `<start_of_image>` where a message's image item is, as Gemma 3's template does."""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_SIZE = 32
TOKENS_PER_IMAGE = 16
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_vlm(folder: Path, seed: int = 0) -> tuple[Path, int]:
    """The checkpoint in `folder`; returns (folder, vocab size): the image tokens are its last three ids."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from tests.support.tiny_model import make_tokenizer_files, save_random_weights

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer_files(folder, vocab_size=384)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in IMAGE_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    vocab = tok.get_vocab()
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    eos, pad = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    text = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=32,
        sliding_window=24, layer_types=["sliding_attention", "full_attention"], eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=4)
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=vocab["<start_of_image>"], eoi_token_index=vocab["<end_of_image>"],
        image_token_index=vocab["<image_soft_token>"], eos_token_id=eos, pad_token_id=pad)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    save_random_weights(config, folder, seed)
    return folder, vocab_size
