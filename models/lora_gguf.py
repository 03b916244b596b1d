"""GGUF LoRA adapters (llama.cpp's format) read into the slots' layout of `models/lora.py`.

llama.cpp's `convert_lora_to_gguf.py` writes a PEFT adapter as a GGUF file whose
metadata says what it is and whose tensors sit beside the base tensors they modify:

    general.type          "adapter"
    adapter.type          "lora"
    general.architecture  the base model's GGUF architecture ("llama", "qwen3", ...)
    adapter.lora.alpha    f32, PEFT's lora_alpha (0 or absent: no scaling)
    blk.{i}.{base}.lora_a   ggml ne [in, r]   (numpy [r, in]: PEFT's lora_A as it was)
    blk.{i}.{base}.lora_b   ggml ne [r, out]  (numpy [out, r]: PEFT's lora_B)

`{base}` is the base tensor's GGUF name (`attn_q.weight`, `ffn_down.weight`, Phi-3's
fused `attn_qkv.weight`), so the family's GGUF table maps it to our projection as it
maps the base model's weights; where the converter changed a tensor's layout as it changes
the base weight's (Qwen3.5's DeltaNet tensors: value heads tiled in B's rows or A's columns;
Qwen3-Next's in_proj_qkvz split in two), the family's `gguf_adapter_merge` takes those
pairs first and puts them back (`models/qwen3_5_gguf.py:merge_adapter`). Two of the
converter's rules are undone here:

- the converter runs the base model's own tensor edits on the (A, B) pair; for `llama`
  files that is the q/k row permutation to interleaved RoPE order, which touches only
  B's rows (the output axis), so B's attn_q / attn_k rows are unpermuted exactly as the
  GGUF loader unpermutes the base weights (`unpermute_rope_rows`);
- the scale is llama.cpp's (`llama_adapter_lora_weight::get_scale`):
  alpha / r with r = B's ne[0] (the rank), or 1 when alpha is 0. The converter copies
  lora_alpha and drops PEFT's use_rslora, so an rsLoRA adapter converted to GGUF is
  served at alpha / r, as llama.cpp serves it.

The per-request scale of llama.cpp's server (`/lora-adapters`) is not offered: an adapter
is in a slot with its scale folded into B, as a PEFT one is.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from models.gguf_metadata import GGUFMetadata
from models.lora import LoraError, PeftAdapter, split_fused

_LORA_NAME = re.compile(r"^blk\.(\d+)\.(.+)\.lora_([ab])$")


def _check_header(meta: GGUFMetadata, name: str, family) -> str:
    """The file's GGUF architecture, after checking it is a LoRA adapter for `family`."""
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoraError("invalid_adapter", f"{name}: not a GGUF LoRA adapter (general.type "
                                           f"{meta.get('general.type')!r}, adapter.type "
                                           f"{meta.get('adapter.type')!r}; want 'adapter' and 'lora')")
    arch = meta.arch
    if arch not in family.gguf_architectures:
        raise LoraError("unsupported_architecture", f"{name}: an adapter for GGUF architecture {arch!r}; the model "
                                                    f"is {family.name} ({', '.join(family.gguf_architectures)})")
    return arch


def read_gguf_adapter(path: str | Path, family, cfg, targets: dict[tuple[int, str], tuple[int, int]],
                      max_rank: int) -> PeftAdapter:
    """Read a GGUF LoRA adapter file (see the module docstring).

    Args:
      family: the served model's `Family` (its GGUF table, q/k permutation rule and adapter merge).
      cfg: the served model's ModelConfig (head counts for the q/k unpermutation and the merge).
      targets: {(layer, name): (in, out)} the model can adapt (`attach_lora`).
      max_rank: `--max-lora-rank`.
    Raises:
      LoraError: "invalid_adapter" (not an adapter, a lone lora_a/b, mixed ranks, a
        tensor type we cannot read), "unsupported_architecture" (another family's
        adapter), "rank_too_large", "missing_target_module".
    """
    from gguf import GGUFReader

    from models.config import UnsupportedModelError
    from models.loaders.gguf import dequantize_tensor, unpermute_rope_rows

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise LoraError("invalid_adapter", f"{path.name}: not a readable GGUF file ({e})") from None
    meta = GGUFMetadata(reader)
    arch = _check_header(meta, path.name, family)
    unpermute = arch in family.gguf_qk_permuted
    read: dict[tuple[int, str], dict[str, np.ndarray]] = {}  # (layer, GGUF suffix) -> {"A", "B"}
    for t in reader.tensors:
        m = _LORA_NAME.match(t.name)
        if m is None:
            raise LoraError("missing_target_module", f"{path.name}: tensor {t.name!r} is not a layer's lora_a or "
                                                     "lora_b")
        try:
            w = dequantize_tensor(t)
        except UnsupportedModelError as e:
            raise LoraError("invalid_adapter", f"{path.name}: {e}") from None
        if m.group(3) == "b" and unpermute and m.group(2) in ("attn_q.weight", "attn_k.weight"):
            w = unpermute_rope_rows(w, cfg.num_heads if m.group(2) == "attn_q.weight" else cfg.num_kv_heads)
        read.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3).upper()] = w
    if not read:
        raise LoraError("invalid_adapter", f"{path.name}: holds no LoRA tensors")
    try:  # the family's own layouts (Qwen3.5's DeltaNet tensors), taken out of `read`
        pairs: dict[tuple[int, str | tuple[str, ...]], dict[str, np.ndarray]] = (
            family.gguf_adapter_merge(read, cfg) if family.gguf_adapter_merge is not None else {})
    except LoraError as e:
        raise LoraError(e.code, f"{path.name}: {e}") from None
    for key in pairs:
        if key not in targets:
            raise LoraError("missing_target_module", f"{path.name}: layer {key[0]} {key[1]} is not a projection the "
                                                     "model has")
    for (layer, suffix), ab in read.items():  # the rest by the family's GGUF name table
        ours = family.gguf_layer_weights.get(suffix)
        if ours is None or any((layer, name) not in targets for name in (ours if isinstance(ours, tuple) else (ours,))):
            raise LoraError("missing_target_module", f"{path.name}: tensor 'blk.{layer}.{suffix}.lora_*' targets a "
                                                     "module the model lacks")
        pairs[(layer, ours)] = ab
    ranks = {ab["B"].shape[1] for ab in pairs.values() if "B" in ab}
    if len(ranks) > 1:
        raise LoraError("invalid_adapter", f"{path.name}: tensors of different ranks {sorted(ranks)} are not supported")
    rank = ranks.pop() if ranks else 0
    if rank > max_rank:
        raise LoraError("rank_too_large", f"adapter rank {rank} is larger than --max-lora-rank {max_rank}")
    alpha = float(meta.get("adapter.lora.alpha", 0.0) or 0.0)
    scale = alpha / rank if alpha else 1.0  # llama.cpp's get_scale at adapter_scale 1
    return PeftAdapter(rank=rank, scale=scale, weights=split_fused(pairs, targets, rank, scale),
                       base_model=meta.get("general.name"))
