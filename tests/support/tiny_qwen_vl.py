"""A tiny random Qwen2.5-VL checkpoint (transformers 5.25's `Qwen2_5_VLForConditionalGeneration`):
a 2-layer Qwen2 text model (head_dim 16, `mrope_section` [2, 3, 3]) behind a 2-layer vision
transformer over 14 x 14 patches (temporal patch 2), windows of 56 pixels (2 x 2 merged units)
for block 0 and full attention for block 1, a 2 x 2 patch merger. The processor keeps images
between 28 x 28 x 4 and 28 x 28 x 16 pixels (4 to 16 image tokens). The tests' byte-level BPE
tokenizer gets Qwen's vision tokens added last (`<|vision_start|>`, `<|vision_end|>`,
`<|image_pad|>`, `<|video_pad|>`), and a ChatML template that writes
`<|vision_start|><|image_pad|><|vision_end|>` where a message's image item is, as Qwen's does."""

from __future__ import annotations

import json
from pathlib import Path

MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 16
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' or item['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_qwen_vl(folder: Path, seed: int = 0) -> tuple[Path, dict[str, int]]:
    """The checkpoint in `folder`; returns (folder, the tokenizer's vocabulary)."""
    import transformers

    from tests.support.tiny_model import make_vision_tokenizer, save_random_weights

    folder = Path(folder)
    vocab = make_vision_tokenizer(folder, VISION_TOKENS, CHAT_TEMPLATE)
    eos, pad = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    text = transformers.Qwen2_5_VLTextConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = transformers.Qwen2_5_VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"], tie_word_embeddings=False)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    save_random_weights(config, folder, seed, transformers.Qwen2_5_VLForConditionalGeneration)
    (folder / "preprocessor_config.json").write_text(json.dumps(image_processor().to_dict()))
    return folder, vocab


def image_processor():
    """HF's PIL image processor with the checkpoint's pixel bounds (the tests' reference)."""
    import transformers

    return transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def make_tiny_qwen3_vl(folder: Path, seed: int = 0) -> tuple[Path, dict[str, int]]:
    """A tiny random Qwen3-VL checkpoint (`Qwen3VLForConditionalGeneration`): a 2-layer Qwen3 text
    model (head_dim 16, interleaved `mrope_section` [4, 2, 2]) behind a 2-layer vision transformer
    over 16 x 16 patches with a 4 x 4 learned position grid, deepstack features from vision block 0
    added after text layer 0; images between 32 x 32 x 4 and 32 x 32 x 16 pixels."""
    import transformers

    from tests.support.tiny_model import make_vision_tokenizer, save_random_weights

    folder = Path(folder)
    vocab = make_vision_tokenizer(folder, VISION_TOKENS, CHAT_TEMPLATE)
    eos, pad = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    text = transformers.Qwen3VLTextConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True})
    vision = transformers.Qwen3VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = transformers.Qwen3VLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"], tie_word_embeddings=False)
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    save_random_weights(config, folder, seed, transformers.Qwen3VLForConditionalGeneration)
    (folder / "preprocessor_config.json").write_text(json.dumps(qwen3_image_processor().to_dict()))
    return folder, vocab


def qwen3_image_processor():
    """HF's PIL image processor as Qwen3-VL's (16-pixel patches, mean and std 0.5)."""
    import transformers

    return transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 16},
                                                 patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
