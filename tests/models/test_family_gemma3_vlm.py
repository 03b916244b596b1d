"""Gemma 3's vision-language checkpoints (`Gemma3ForConditionalGeneration`, the 4B and larger
releases) served as their text model, against HF transformers running the whole wrapper.

The wrapper's config nests the text model's (`text_config`) beside the vision encoder's, and its
safetensors name the language model `model.language_model.*` (transformers 5) or
`language_model.model.*` (the Hub's files): the loader reads those and leaves the vision tower's
to models/siglip.py. Text prompts through the wrapper equal the text model's, so the family
checks (48-token prefill + 32 greedy steps within 1e-4 of HF, chunked == one-shot, batched ==
alone, a real server) run against HF's `Gemma3ForConditionalGeneration` itself.
"""

from __future__ import annotations

import json

import pytest
import transformers

from models.config import UnsupportedModelError
from models.loaders.safetensors import _text_model_name
from models.registry import config_from_hf
from tests.support import family_checks as fc


def _vlm_config(vocab_size: int, eos: int, pad: int) -> transformers.Gemma3Config:
    text = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=32,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], eos_token_id=eos,
        pad_token_id=pad, bos_token_id=None)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=32, patch_size=4)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=16, image_token_index=vocab_size - 1,
                                       boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
                                       eos_token_id=eos, pad_token_id=pad)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory):
    from tests.support.tiny_model import make_tokenizer_files, save_random_weights

    folder = tmp_path_factory.mktemp("gemma3-vlm") / "tiny-gemma3-vlm"
    folder.mkdir(parents=True)
    vocab_size = make_tokenizer_files(folder, vocab_size=384)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    save_random_weights(_vlm_config(vocab_size, vocab["<|im_end|>"], vocab["<|endoftext|>"]), folder)
    hf = fc.hf_model(folder)
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    return folder, hf, fc.check_family(folder, hf)


def test_config_is_the_text_model_with_the_encoder_beside(gemma3_vlm):
    cfg = gemma3_vlm[2].config
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    assert (cfg.hidden_size, cfg.num_layers, cfg.layer_types) == (64, 2, ("sliding_attention", "full_attention"))
    assert cfg.vision is not None
    assert (cfg.vision.hidden, cfg.vision.tokens_per_image, cfg.vision.text_hidden) == (32, 16, 64)
    assert cfg.vision.image_token_id == cfg.vocab_size - 1


def test_matches_transformers(gemma3_vlm):
    fc.assert_report(gemma3_vlm[2], "gemma3-vlm")


def test_served_end_to_end(gemma3_vlm):
    path, hf, _ = gemma3_vlm
    fc.assert_served(fc.serve(path), hf, "Gemma3ForConditionalGeneration")


def test_tensor_names_of_both_layouts():
    assert _text_model_name("model.language_model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert _text_model_name("language_model.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert _text_model_name("language_model.lm_head.weight") == "lm_head.weight"
    for vision in ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
                   "model.vision_tower.embeddings.patch_embedding.weight",
                   "model.multi_modal_projector.mm_input_projection_weight"):
        assert _text_model_name(vision) is None


def test_other_vision_checkpoints_are_still_refused():
    with pytest.raises(UnsupportedModelError, match="vision tower"):
        config_from_hf({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {},
                        "vision_config": {}})
