"""HF safetensors folders (single file or sharded with `model.safetensors.index.json`).

The family (`models/registry.py`, from config.json `architectures[0]`) names its
per-layer tensors in its module (`HF_LAYER_WEIGHTS`); the global ones are the same for
every family (table below) plus the family's own (`Family.hf_global_weights`). A
`*ForConditionalGeneration` checkpoint's text model is read under its text names, its
vision / audio towers skipped. Projection weights are stored by HF as `[out, in]` and
transposed to our `[in, out]` (x @ W); fused tensors (Phi-3) are split and per-expert
tensors (Mixtral, Qwen3-MoE) stacked by `models/loaders/common.py`; MXFP4 tensors
(gpt-oss's experts, stored as `NAME_blocks` + `NAME_scales`) dequantized to float at load
by `models/loaders/mxfp4.py`, which also gives them as MXFP4 block stacks
(`read_block_tensors`) for quantization "gguf" on the CPU kernel. HF q/k rows are
already in the rotate-half RoPE order our model uses, so nothing is permuted here (the
GGUF loader, by contrast, must undo llama.cpp's interleaving for `llama` files).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from safetensors import safe_open

from models.config import CheckpointFileError, ModelConfig, read_json_file
from models.loaders.common import expected_params, map_layer_tensors, stack_experts
from models.loaders.mxfp4 import mxfp4_block_stacks, pair_mxfp4
from models.loaders.shards import shard_files
from models.registry import config_from_hf, family_for

GLOBAL_TABLE: dict[str, tuple[str, bool]] = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A vision-language checkpoint's language model, under the text model's names: transformers 5
# saves `model.language_model.*`, the Hub's checkpoints `language_model.model.*`; Idefics3 /
# SmolVLM `model.text_model.*` (their vision side: `model.vision_model.*`, `model.connector.*`);
# Qwen2.5-VL's Hub checkpoints keep the text model's own names beside `visual.*`.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.")
_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                    "model.multi_modal_projector.", "model.vision_model.", "model.connector.",
                    "vision_model.",  # Llama 4's (served as a text model)
                    # Gemma 4's towers and their embedders (served as a text model)
                    "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                    "visual.", "model.visual.")  # Qwen2.5-VL's vision transformer (models/qwen_vision.py)
# Buffers some checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(folder: Path) -> ModelConfig:
    """The folder's `config.json` through its family's parser.

    Raises:
      FileNotFoundError: no config.json. CheckpointFileError naming the file: it does not
        parse (line and column), or lacks a field the family needs. UnsupportedModelError.
    """
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    cfg = read_json_file(path)
    try:
        return config_from_hf(cfg)
    except KeyError as e:  # the families index the fields every checkpoint of theirs has
        raise CheckpointFileError(f"{path} has no {e.args[0]!r}, which its architecture needs; "
                                  "copy the checkpoint's config.json again") from None


def read_tensors(folder: Path, cfg: ModelConfig) -> dict[str, Callable]:
    """Lazy {our_name: () -> array in our layout} over every shard.

    Names the family's table does not know pass through unchanged, so `build_model`
    reports them as unexpected together with anything missing.
    """
    family = family_for(cfg.architecture)
    table, global_table = family.hf_layer_weights, {**GLOBAL_TABLE, **family.hf_global_weights}
    expected = expected_params(cfg)
    loads = _checkpoint_loads(folder, cfg)
    tensors: dict[str, Callable] = {}
    experts: dict = {}
    for hf_name, load in pair_mxfp4(loads).items():  # MXFP4 blocks + scales -> one float tensor
        if hf_name in global_table:
            name, transpose = global_table[hf_name]
            if name == "lm_head" and cfg.tie_word_embeddings:
                continue  # tied checkpoints sometimes save the shared matrix twice
            tensors[name] = (lambda load=load: load().T) if transpose else load
            continue
        if hf_name.startswith(family.hf_skipped_prefixes):
            continue  # a side block its own reader loads (models/qwen3_5_mtp.py)
        m = _LAYER_RE.match(hf_name)
        if m and family.hf_skips_extra_layers and int(m.group(1)) >= cfg.num_layers:
            continue  # a multi-token-prediction layer (models/deepseek_v3.py)
        mapped = map_layer_tensors(int(m.group(1)), m.group(2), load, table, expected, experts) if m else None
        tensors.update({hf_name: load} if mapped is None else mapped)
    tensors.update(stack_experts(experts, getattr(cfg, "num_experts", None)))
    return tensors


def read_block_tensors(folder: Path, cfg: ModelConfig) -> dict[str, Callable]:
    """Lazy {our expert stack name: () -> (u8[E, out, row bytes], "mxfp4")} for the folder's
    MXFP4 expert stacks (`models/loaders/mxfp4.py:mxfp4_block_stacks`); {} when it has none."""
    loads = _checkpoint_loads(folder, cfg)
    if not any(name.endswith("_blocks") for name in loads):
        return {}
    return mxfp4_block_stacks(loads, family_for(cfg.architecture).hf_layer_weights, expected_params(cfg))


def _checkpoint_loads(folder: Path, cfg: ModelConfig) -> dict[str, Callable]:
    """{checkpoint name: lazy reader} over every shard; a multimodal wrapper's text model is
    read under its own names, even with no vision side (Gemma 4 is served as text)."""
    vision_language = getattr(cfg, "vision", None) is not None or cfg.architecture.endswith("ForConditionalGeneration")
    loads: dict[str, Callable] = {}
    for shard in shard_files(folder):
        with safe_open(str(shard), framework="flax") as f:
            for hf_name in f.keys():
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                name = _text_model_name(hf_name) if vision_language else hf_name
                if name is not None:  # None: the vision encoder's (models/siglip.py reads them)
                    loads[name] = _lazy(shard, hf_name)
    return loads


def _text_model_name(hf_name: str) -> str | None:
    """A vision-language checkpoint's tensor under the text model's name; None for the vision side."""
    for prefix in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return "model." + hf_name[len(prefix):]
    if hf_name == "language_model.lm_head.weight":
        return "lm_head.weight"
    return None if hf_name.startswith(_VISION_PREFIXES) else hf_name


def _lazy(shard: Path, hf_name: str) -> Callable:
    def load():
        with safe_open(str(shard), framework="flax") as f:
            return f.get_tensor(hf_name)

    return load
