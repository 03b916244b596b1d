"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 text model with M-RoPE behind
Qwen's vision transformer (`models/qwen_vision.py`).

The checkpoint loads as its text model, a Qwen2 (`models/llama.py`: q/k/v biases; the loader
reads `model.layers.*` or transformers 5's `model.language_model.*` and leaves `visual.*`), and
`Qwen25VLConfig.vision` keeps the encoder's shape, the image tokens and the processor's settings.

What differs from Qwen2 is the rotary embedding, M-RoPE: each token has three positions
(temporal, height, width), and the head's rotary_dim / 2 frequencies are split into
`mrope_section`'s three runs ([16, 24, 24] on the released models), run i turning with axis i
(`models/rope.py:mrope_cos_sin`). A text token's three positions are equal (plain RoPE); an
image's tokens sit on its grid of merged patches: (s, s + row, s + column) for a still image,
s the position the image starts at, and the text after it continues from s + max(rows, columns),
not from its token index. The positions are a function of the prompt and its images' grids
(`ferrox_jax/images.py:mrope_positions`), computed on the host for every token the step holds
(prompt chunks and decoding rows alike) and handed to the forward as an i32[N, 3] column; the
KV cache stays indexed by token index, so paging, the prefix cache and chunking are unchanged.

The text model attends causally over image tokens, as over text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from models import llama
from models.config import ModelConfig, UnsupportedModelError, rope_parameters
from models.family import Family
from models.qwen_vision import QwenVisionConfig, vision_config
from models.rope import mrope_cos_sin

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


@dataclasses.dataclass(frozen=True)
class Qwen25VLConfig(ModelConfig):
    mrope_section: tuple[int, ...] = (16, 24, 24)
    vision: QwenVisionConfig | None = None


class Qwen25VLModel(llama.LlamaModel):
    def rope(self, positions: jax.Array, valid: jax.Array):
        """positions i32[B, T, 3] (the M-RoPE column) or i32[B, T] (three equal positions)."""
        cfg = self.cfg
        if positions.ndim == 2:
            positions = positions[..., None].repeat(3, axis=-1)
        return {"global": mrope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta, cfg.mrope_section)}


def config_from_hf(cfg: dict[str, Any]) -> Qwen25VLConfig:
    """A `Qwen2_5_VLForConditionalGeneration` config.json: the Qwen2 text model, its
    `mrope_section`, and the vision config (the processor's defaults: the encoder reads the
    folder's own settings, `models/qwen_vision.py:read_qwen_vision`)."""
    arch = (cfg.get("architectures") or [ARCHITECTURES[0]])[0]
    # the Hub's configs keep the text fields at the top, beside vision_config
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k not in ("vision_config", "text_config")})
    text["architectures"] = ["Qwen2ForCausalLM"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "vocab_size"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    params = rope_parameters(text) or rope_parameters(cfg) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise UnsupportedModelError(f"Qwen2.5-VL rope_type {rope_type!r} is not supported (M-RoPE without scaling)")
    section = tuple(int(s) for s in params.get("mrope_section") or (16, 24, 24))
    plain = {k: v for k, v in params.items() if k not in ("mrope_section", "type", "rope_type")}
    text["rope_parameters"] = {**plain, "rope_type": "default"}
    text.pop("rope_scaling", None)
    text_cfg = llama.config_from_hf(text)
    if sum(section) * 2 != text_cfg.rope_dim:
        raise UnsupportedModelError(f"mrope_section {list(section)} sums to {sum(section)}; the head's rotary "
                                    f"dimension {text_cfg.rope_dim} needs {text_cfg.rope_dim // 2}")
    fields = {f.name: getattr(text_cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    fields["architecture"] = arch
    vision = vision_config(cfg) if cfg.get("vision_config") is not None else None
    return Qwen25VLConfig(**fields, mrope_section=section, vision=vision)


FAMILY = Family(
    name="qwen2_5_vl",
    model=Qwen25VLModel,
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    hf_layer_weights=llama.HF_LAYER_WEIGHTS,
)
