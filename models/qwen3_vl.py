"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): a Qwen3 text model with interleaved M-RoPE and
deepstack behind Qwen3-VL's vision transformer (`models/qwen3_vl_vision.py`).

The checkpoint loads as its text model, a Qwen3 (`models/qwen3.py`: q/k norms; the loader reads
`model.language_model.*` and leaves `model.visual.*`). Two things differ from Qwen3:

- **Interleaved M-RoPE.** Each token has three positions (temporal, height, width), as in
  Qwen2.5-VL (`models/qwen2_5_vl.py`; the same positions, `ferrox_jax/images.py:mrope_positions`),
  but the frequencies take their axis interleaved: frequency j turns with the height position when
  j % 3 == 1 and j < 3 * sections[1], with the width position when j % 3 == 2 and
  j < 3 * sections[2], with the temporal one otherwise (HF's `recomposition_frequencies`).
- **Deepstack.** The encoder gives each image token, beside its embedding, one more row per
  `deepstack_visual_indexes` block; after text layer i (i < that count) the i-th row is added to
  the hidden state of the image's tokens. An image token's embedding column is the rows side by
  side (width hidden * (1 + count)), so the engine's image columns and encoder cache carry them
  unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import qwen3
from models.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_parameters
from models.family import Family
from models.layers import ForwardContext
from models.qwen3_vl_vision import Qwen3VisionConfig, qwen3_vision_config
from models.rope import rope_inv_freq

ARCHITECTURES = ("Qwen3VLForConditionalGeneration",)


@dataclasses.dataclass(frozen=True)
class Qwen3VLConfig(ModelConfig):
    mrope_section: tuple[int, ...] = (24, 20, 20)
    deepstack_layers: int = 0  # text layers that add a deepstack row to image tokens
    vision: Qwen3VisionConfig | None = None

    @property
    def image_width(self) -> int:
        """Floats per image token in the step's image column."""
        return self.hidden_size * (1 + self.deepstack_layers)


def interleaved_axes(section: tuple[int, ...], half: int) -> np.ndarray:
    """The position axis (0 temporal, 1 height, 2 width) each of the `half` frequencies turns with."""
    axes = np.zeros(half, np.int64)
    for axis in (1, 2):
        axes[axis:section[axis] * 3:3] = axis
    return axes


class Qwen3VLModel(qwen3.Qwen3Model):
    def rope(self, positions: jax.Array, valid: jax.Array):
        """positions i32[B, T, 3] (the M-RoPE column) or i32[B, T] (three equal positions)."""
        cfg = self.cfg
        if positions.ndim == 2:
            positions = positions[..., None].repeat(3, axis=-1)
        inv_freq = jnp.asarray(rope_inv_freq(cfg.rope_dim, cfg.rope_theta, RopeScaling()))
        freqs = positions[..., interleaved_axes(cfg.mrope_section, cfg.rope_dim // 2)].astype(jnp.float32) * inv_freq
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return {"global": (jnp.cos(emb), jnp.sin(emb))}

    def __call__(self, tokens, positions, valid, k_caches, v_caches, block_tables, segment_tokens, images=None):
        """As `CausalLM.__call__`, with the deepstack rows of image tokens added after the first layers."""
        if images is None:
            return super().__call__(tokens, positions, valid, k_caches, v_caches, block_tables, segment_tokens)
        embeds, mask, limits, *rope_positions = images
        d = self.cfg.hidden_size
        fwd = ForwardContext.build(positions, valid, block_tables, segment_tokens, k_caches[0].shape[2], self.rope,
                                   self.decode_attention, limits, rope_positions[0] if rope_positions else None)
        x = self.embed_tokens(tokens)
        x = jnp.where(mask[:, None], embeds[:, :d].astype(x.dtype), x)
        new_k, new_v = [], []
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            x, k_cache, v_cache = layer(x, fwd, k_cache, v_cache)
            if i < self.cfg.deepstack_layers:
                x = x + jnp.where(mask[:, None], embeds[:, (i + 1) * d:(i + 2) * d].astype(x.dtype), 0)
            new_k.append(k_cache)
            new_v.append(v_cache)
        return self.norm(x, self.final_norm[...]), tuple(new_k), tuple(new_v)


def config_from_hf(cfg: dict[str, Any]) -> Qwen3VLConfig:
    """A `Qwen3VLForConditionalGeneration` config.json: the Qwen3 text model, its interleaved
    `mrope_section`, its deepstack count and the vision config."""
    arch = (cfg.get("architectures") or [ARCHITECTURES[0]])[0]
    text = dict(cfg.get("text_config") or {})
    text["architectures"] = ["Qwen3ForCausalLM"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    params = rope_parameters(text)
    if params.get("rope_type", params.get("type", "default")) not in ("default", "mrope"):
        raise UnsupportedModelError(f"Qwen3-VL rope_type {params.get('rope_type')!r} is not supported")
    if params.get("mrope_interleaved") is False:
        raise UnsupportedModelError("Qwen3-VL without interleaved M-RoPE is not supported")
    section = tuple(int(s) for s in params.get("mrope_section") or (24, 20, 20))
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": params.get("rope_theta", 5_000_000.0)}
    text.pop("rope_scaling", None)
    text_cfg = qwen3.config_from_hf(text)
    if sum(section) * 2 != text_cfg.rope_dim:
        raise UnsupportedModelError(f"mrope_section {list(section)} sums to {sum(section)}; the head's rotary "
                                    f"dimension {text_cfg.rope_dim} needs {text_cfg.rope_dim // 2}")
    fields = {f.name: getattr(text_cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    fields["architecture"] = arch
    vision = qwen3_vision_config(cfg) if cfg.get("vision_config") is not None else None
    deepstack = len(vision.deepstack) if vision is not None else 0
    if deepstack > fields["num_layers"]:
        raise UnsupportedModelError(f"{deepstack} deepstack features for {fields['num_layers']} text layers")
    return Qwen3VLConfig(**fields, mrope_section=section, deepstack_layers=deepstack, vision=vision)


FAMILY = Family(
    name="qwen3_vl",
    model=Qwen3VLModel,
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    hf_layer_weights={**qwen3.FAMILY.hf_layer_weights},
)
