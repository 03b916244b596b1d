"""HF safetensors folders (single file or sharded with `model.safetensors.index.json`).

Names map through the table below (HF -> ours); projection weights are stored by HF as
`[out, in]` and transposed to our `[in, out]` (x @ W). HF q/k rows are already in the
rotate-half RoPE order our model uses, so nothing is permuted here (the GGUF loader,
by contrast, must undo llama.cpp's interleaving).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

from safetensors import safe_open

from models.config import ModelConfig

# HF per-layer suffix -> (our per-layer name, transpose?)
LAYER_TABLE: dict[str, tuple[str, bool]] = {
    "input_layernorm.weight": ("input_norm", False),
    "self_attn.q_proj.weight": ("q_proj", True),
    "self_attn.k_proj.weight": ("k_proj", True),
    "self_attn.v_proj.weight": ("v_proj", True),
    "self_attn.q_proj.bias": ("q_bias", False),
    "self_attn.k_proj.bias": ("k_bias", False),
    "self_attn.v_proj.bias": ("v_bias", False),
    "self_attn.o_proj.weight": ("o_proj", True),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
}
GLOBAL_TABLE: dict[str, tuple[str, bool]] = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return ModelConfig.from_hf_dict(json.loads(path.read_text()))


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def our_name(hf_name: str) -> tuple[str, bool] | None:
    """Map an HF tensor name to (our name, transpose); None for ignorable buffers."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name in GLOBAL_TABLE:
        return GLOBAL_TABLE[hf_name]
    m = _LAYER_RE.match(hf_name)
    if m and m.group(2) in LAYER_TABLE:
        name, transpose = LAYER_TABLE[m.group(2)]
        return f"layers.{m.group(1)}.{name}", transpose
    return hf_name, False  # reported as unexpected by build_model


def read_tensors(folder: Path, cfg: ModelConfig) -> dict[str, Callable]:
    """Lazy {our_name: () -> array} over every shard."""
    tensors: dict[str, Callable] = {}
    for shard in _shard_files(folder):
        with safe_open(str(shard), framework="flax") as f:
            for hf_name in f.keys():
                mapped = our_name(hf_name)
                if mapped is None:
                    continue
                name, transpose = mapped
                if name == "lm_head" and cfg.tie_word_embeddings:
                    continue  # tied checkpoints sometimes save the shared matrix twice
                tensors[name] = _lazy(shard, hf_name, transpose)
    return tensors


def _lazy(shard: Path, hf_name: str, transpose: bool) -> Callable:
    def load():
        with safe_open(str(shard), framework="flax") as f:
            arr = f.get_tensor(hf_name)
        return arr.T if transpose else arr

    return load
