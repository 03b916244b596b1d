"""Model configuration shared by every family, read from checkpoint metadata.

`ModelConfig` holds what every decoder has (shapes, norms, RoPE, which layers attend
through a sliding window); a family that needs more subclasses it in its own module
(`Gemma2Config`, `MoeConfig`, ...). Configs come from an HF `config.json` (each family's
`config_from_hf`, dispatched by `models/registry.py:config_from_hf`) or from GGUF metadata
(`models/loaders/gguf.py`), never from a file or directory name. This module knows no
family: the families import it, and the registry imports the families, so a config is
parsed through the registry, never through a method here. Anything this engine
cannot compute faithfully (another architecture, an unknown rope type, a vision tower)
fails at load with `UnsupportedModelError` naming it.

A checkpoint's JSON files (config.json, tokenizer_config.json, the shard index...) are
read through `read_json_file`, so a broken one is refused with its path and the line and
column where it breaks, not a bare JSONDecodeError.

The KV cache is sized from `kv_layout()`: one (kv heads, K width, V width) per K/V array
pair (`ferrox_jax/kv_cache.py`); by default every layer's own, of `kv_cache_dims()` (the KV
heads at `head_dim`, or a family's own geometry: DeepSeek-V3's one latent head, no V); a
family whose layers differ in head size or share another layer's cache (Gemma 4) overrides it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


class UnsupportedModelError(ValueError):
    """The checkpoint asks for an architecture or option this engine does not implement."""


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read as what it should be; the message names it."""


def read_json_file(path: str | os.PathLike, *, want_object: bool = True) -> Any:
    """A checkpoint's JSON file, parsed.

    Raises:
      CheckpointFileError naming `path`: not UTF-8 (with the byte offset), not JSON (with
        the line and column), nested too deeply, or (`want_object`) not a JSON object.
      OSError: it cannot be opened.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise CheckpointFileError(f"{os.fspath(path)} is not UTF-8 text (byte {e.start}); "
                                  "copy the checkpoint again") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointFileError(f"{os.fspath(path)} is not valid JSON: {e.msg} at line {e.lineno}, column "
                                  f"{e.colno}; fix the file or copy the checkpoint again") from None
    except (ValueError, RecursionError):  # a number past int's digit limit, nesting past Python's stack
        raise CheckpointFileError(f"{os.fspath(path)} cannot be read as JSON (a number too long or nesting "
                                  "too deep); copy the checkpoint again") from None
    if want_object and not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(type(value), "a number")
        raise CheckpointFileError(f"{os.fspath(path)} must hold a JSON object; it holds {kind}")
    return value


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0  # linear, llama3, yarn and longrope (longrope: only sets attention_factor)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, longrope, yarn (the pretraining context)
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the pretraining context
    long_factor: tuple[float, ...] = ()  # longrope: the divisors once a sequence grows past it
    attention_factor: float = 1.0  # longrope, yarn (its mscale): cos and sin are multiplied by this
    beta_fast: float = 32.0  # yarn: a frequency turning more often over the pretraining context is kept,
    beta_slow: float = 1.0  # ... one turning fewer times than this interpolated; a linear ramp between
    truncate: bool = True  # yarn: round the ramp's ends to whole dims (gpt-oss: false)

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling.rope_type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0; got {self.factor}")
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("rope_scaling longrope needs short_factor and long_factor lists of equal length; got "
                             f"{len(self.short_factor)} and {len(self.long_factor)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only LM; a family's subclass adds its own fields."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rotary_dim: int | None = None  # leading dims of each head RoPE rotates; None: all of head_dim
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # keys a sliding layer's query sees, its own included
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES; () means all full_attention
    architecture: str = "LlamaForCausalLM"  # the HF name; models/registry.py maps it to a family
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int; got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE; got {self.head_dim}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"ModelConfig.rotary_dim must be even and in (0, head_dim={self.head_dim}]; "
                             f"got {self.rotary_dim}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise UnsupportedModelError(f"layer_types {unknown} are not supported; supported: "
                                            f"{', '.join(LAYER_TYPES)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window is unset")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig.sliding_window must be > 0; got {self.sliding_window}")

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (keys its queries see, their own included), or None."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, K width, V width) of each layer's cache arrays (`ferrox_jax/kv_cache.py`):
        the KV heads at head_dim; a latent-attention family stores one latent head and no V
        (`models/deepseek_v3.py`)."""
        return self.num_kv_heads, self.head_dim, self.head_dim

    def kv_layout(self) -> tuple[tuple[int, int, int], ...]:
        """(kv heads, K width, V width) of each K/V array pair the cache holds, in order: one
        per layer here; a family with layers that read another layer's cache holds fewer."""
        return (self.kv_cache_dims(),) * self.num_layers

    def recurrent_specs(self) -> tuple:
        """One `models/deltanet.py:DeltaNetSpec` per layer that keeps a recurrent state per row
        instead of K/V (Qwen3.5's DeltaNet layers), in layer order; () for a pure attention model."""
        return ()

    def lora_widths(self) -> int:
        """in + out summed over every projection LoRA slots may sit beside (`models/lora.py`:
        A [in, S*r] and B [S*r, out] each): q, o, k, v and the dense MLP's gate, up, down on
        every layer (an upper bound for a family whose MLP is not a target)."""
        h, attn, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * (2 * (h + attn) + 2 * (h + kv) + 3 * (h + self.intermediate_size))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token position takes across all the cache's arrays."""
        return sum(heads * (k_dim + v_dim) for heads, k_dim, v_dim in self.kv_layout()) * dtype_bytes

    def sharded_sizes(self) -> dict[str, int]:
        """Sizes tensor parallelism splits besides the heads (`ferrox_jax/sharding.py`)."""
        return {"intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size}


# -- parsing helpers shared by the families' config_from_hf ---------------------------


def hf_common_fields(cfg: dict[str, Any], *, default_act: str = "silu", act_key: str = "hidden_act",
                     supported_acts: tuple[str, ...] = ("silu",)) -> dict[str, Any]:
    """The `ModelConfig` fields every family reads the same way from `config.json`.

    Refuses options no family implements (mlp_bias, another activation, a vision tower).
    """
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if cfg.get("vision_config") is not None:
        raise UnsupportedModelError(f"{arch}: the checkpoint has a vision tower (vision_config), which is not "
                                    "supported; serve a text-only checkpoint")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("config option mlp_bias=true is not supported")
    act = cfg.get(act_key) or default_act
    if act not in supported_acts:
        raise UnsupportedModelError(f"{act_key} {act!r} is not supported for {arch} (only {', '.join(supported_acts)})")
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta(rope_parameters(cfg)),
        rope_scaling=rope_scaling_from_dict(rope_parameters(cfg), cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        architecture=arch,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config.json: transformers 5 `rope_parameters` (with its
    `rope_theta`) or the older `rope_scaling` plus a top-level `rope_theta`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    return params


def rope_theta(params: dict[str, Any], default: float = 10000.0) -> float:
    return float(params.get("rope_theta", default))


def rope_scaling_from_dict(d: dict[str, Any] | None, cfg: dict[str, Any] | None = None) -> RopeScaling:
    """Parse HF `rope_scaling` / `rope_parameters` into a RopeScaling.

    `cfg` (the whole config.json) supplies `max_position_embeddings` and
    `original_max_position_embeddings` where longrope keeps them outside the dict (Phi-3).
    """
    cfg = cfg or {}
    if not d:
        return RopeScaling()
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type in ("su", "yarn") and "long_factor" in d:
        rope_type = "longrope"  # Phi-3's early names for the same scaling (transformers renames them too)
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "longrope":
        return _longrope(d, cfg)
    if rope_type == "yarn":
        return _yarn(d, cfg)
    return RopeScaling(
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0)),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
    )


def _longrope(d: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """As transformers' `_compute_longrope_parameters`: the attention factor comes from the
    context extension (max / original), unless the checkpoint states it."""
    original = int(cfg.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    factor = d.get("factor")
    factor = float(factor) if factor else cfg.get("max_position_embeddings", original) / original
    attention_factor = d.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor=float(factor), original_max_position_embeddings=original,
                       short_factor=tuple(float(x) for x in d["short_factor"]),
                       long_factor=tuple(float(x) for x in d["long_factor"]),
                       attention_factor=float(attention_factor))


def _yarn(d: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """As transformers' `_compute_yarn_parameters`: a missing factor is the context extension
    (max / original); a missing attention factor is YaRN's mscale, 0.1 * ln(factor) + 1, or
    the ratio mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given."""
    original = int(d.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    factor = d.get("factor")
    factor = float(factor) if factor else cfg.get("max_position_embeddings", original) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = d.get("attention_factor")
    if attention_factor is None:
        m, m_all = d.get("mscale"), d.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention_factor), beta_fast=float(d.get("beta_fast") or 32),
                       beta_slow=float(d.get("beta_slow") or 1), truncate=bool(d.get("truncate", True)))


def hf_layer_types(cfg: dict[str, Any], num_layers: int, *, window_applies: bool) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) for families whose windows come from `layer_types`.

    `window_applies` False (e.g. Qwen's use_sliding_window=false) means every layer is
    full whatever `layer_types` says, as transformers does by dropping the window.
    """
    window = cfg.get("sliding_window") if window_applies else None
    if not window:
        return None, ()
    types = cfg.get("layer_types")
    if types is None:
        return window, (SLIDING_ATTENTION,) * num_layers
    return window, tuple(types)
