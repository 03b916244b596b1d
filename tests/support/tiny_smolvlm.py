"""A tiny random Idefics3 / SmolVLM vision-language checkpoint (transformers 5.25's
`Idefics3ForConditionalGeneration`, or `SmolVLMForConditionalGeneration` with `smolvlm=True`):
a 2-layer Llama text model, a 2-layer vision transformer over 32 x 32 tiles in 4 x 4 patches,
a pixel shuffle by 2 (16 image tokens per tile); images up to 64 pixels on their longest edge
(so a wide image is 2 x 1 tiles plus the global view). The tests' byte-level BPE tokenizer gets
the processor's tokens added last (`<fake_token_around_image>`, `<image>`, `<end_of_utterance>`,
`<global-img>` and the 36 `<row_r_col_c>`), and a ChatML template that places `<image>` where a
message's image item is, as SmolVLM's template does. `preprocessor_config.json` is what the
processor saves."""

from __future__ import annotations

import json
from pathlib import Path

TILE = 32  # pixels per tile side (the vision encoder's image_size and the processor's max_image_size)
LONGEST_EDGE = 64  # the processor's first resize
TOKENS_PER_TILE = 16  # (32 / 4)^2 patches / 2^2
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>") + tuple(
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<image>{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_smolvlm(folder: Path, seed: int = 0, smolvlm: bool = False,
                      longest_edge: int = LONGEST_EDGE) -> tuple[Path, dict[str, int]]:
    """The checkpoint in `folder` (`longest_edge` 32: every image is one tile, unsplit); returns
    (folder, the tokenizer's vocabulary)."""
    import transformers

    from tests.support.tiny_model import make_vision_tokenizer, save_random_weights

    folder = Path(folder)
    vocab = make_vision_tokenizer(folder, IMAGE_TOKENS, CHAT_TEMPLATE)
    eos, pad = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    text = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None)
    kind = "SmolVLM" if smolvlm else "Idefics3"
    vision = getattr(transformers, f"{kind}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
        patch_size=4)
    config = getattr(transformers, f"{kind}Config")(
        text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2,
        image_token_id=vocab["<image>"], eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)
    config.architectures = [f"{kind}ForConditionalGeneration"]
    save_random_weights(config, folder, seed, getattr(transformers, f"{kind}ForConditionalGeneration"))
    (folder / "preprocessor_config.json").write_text(json.dumps(image_processor(smolvlm, longest_edge).to_dict()))
    return folder, vocab


def image_processor(smolvlm: bool = False, longest_edge: int = LONGEST_EDGE):
    """HF's PIL image processor with the checkpoint's sizes (the reference the tests compare against)."""
    import transformers

    kind = "SmolVLM" if smolvlm else "Idefics3"
    cls = getattr(transformers, f"{kind}ImageProcessorPil")
    return cls(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": TILE})


def processor(folder: Path, longest_edge: int = LONGEST_EDGE):
    """HF's Idefics3 processor over the checkpoint's tokenizer (the prompt layout's reference)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.Idefics3Processor(image_processor(longest_edge=longest_edge), tok,
                                          image_seq_len=TOKENS_PER_TILE)
