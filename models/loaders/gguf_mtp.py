"""A GGUF file's multi-token-prediction block (llama.cpp's `nextn` layers), read for
`--speculative mtp` (`models/qwen3_5_mtp.py`, `models/deepseek_mtp.py` run it).

llama.cpp's converter appends the block after the main layers (unless run with `--no-mtp`):
`{arch}.block_count` counts it, `{arch}.nextn_predict_layers` says how many blocks it holds,
and block n (n = the main model's layer count, which our config already excludes it from)
holds an ordinary decoder layer's tensors under the family's names (`blk.{n}.attn_q.weight`,
the expert stacks ...) beside the block's own:

    blk.{n}.nextn.eh_proj            [D, 2D] in the reader's [out, in] order (HF's fc / eh_proj)
    blk.{n}.nextn.enorm / hnorm      the embedding's / the hidden state's norm
    blk.{n}.nextn.shared_head_norm   the head's norm
    blk.{n}.nextn.shared_head_head   [V, D], and blk.{n}.nextn.embed_tokens [V, D]: DeepSeek's
                                     own copies (absent: the main model's)

`gguf_mtp_tensors` reads block n's decoder layer exactly as the main layers are read: the
block's tensors are renamed to block 0 and passed through the main loader
(`models/loaders/gguf.py:gguf_tensors`) with a one-layer config the caller gives (the
block's layer kind), so the family's names, its merges (DeepSeek's attn_k_b / attn_v_b
joined into kv_b_proj; Qwen3.5's norms stored as 1 + w, less 1) and the file's tensor types
(F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / K-quants, dequantized) are the main model's. The
`nextn.*` tensors map through the caller's table (GGUF suffix -> our name, transposed),
less `norm_offset` for the norms where the family's converter stored 1 + w.

Refused with NoMtpLayerError, naming what is missing: a file without the block (converted
with `--no-mtp`, or by a converter that drops it, as llama.cpp's does for DeepSeek-V3), and a
`nextn.*` tensor the table does not know.
"""

from __future__ import annotations

import os
import re
from typing import Callable

import numpy as np

from models.config import ModelConfig
from models.gguf_metadata import GGUFMetadata
from models.gguf_reader import GGUFFile
from models.loaders.gguf import gguf_tensors, open_gguf
from models.mtp_weights import NoMtpLayerError

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


class _BlockView:
    """The reader as `gguf_tensors` sees it: the file's metadata, and only block n's tensors,
    renamed to block 0."""

    def __init__(self, reader: GGUFFile, n: int):
        self.fields = reader.fields
        self.tensors = [t._replace(name=f"blk.0.{m.group(2)}") for t in reader.tensors
                        if (m := _LAYER.match(t.name)) and int(m.group(1)) == n]


def mtp_block_count(reader: GGUFFile) -> int:
    """`{arch}.nextn_predict_layers`: how many MTP blocks the converter appended (0: none)."""
    meta = GGUFMetadata(reader)
    return int(meta.get(f"{meta.arch}.nextn_predict_layers", 0) or 0)


def gguf_mtp_tensors(path: str | os.PathLike | GGUFFile, cfg: ModelConfig, layer_cfg: ModelConfig,
                     nextn_weights: dict[str, tuple[str, bool]], norm_offset: float = 0.0,
                     max_blocks: int | None = None) -> dict[str, Callable[[], np.ndarray]]:
    """{our name (relative to the MTP module: `layer.*` for the decoder layer): lazy array in
    our layout} of the first MTP block of the GGUF file `path` (module docstring). `cfg` is
    the main model's config (its `num_layers` excludes the MTP blocks), `layer_cfg` the
    one-layer config the block's decoder layer is built from; `nextn_weights` maps a
    `nextn.*` suffix to (our name, transposed). `max_blocks`: refuse a file with more blocks."""
    reader = path if isinstance(path, GGUFFile) else open_gguf(path)
    name = os.path.basename(reader.path)
    n, blocks = cfg.num_layers, mtp_block_count(reader)
    view = _BlockView(reader, n)
    if not blocks or not any(t.name == "blk.0.nextn.eh_proj.weight" for t in view.tensors):
        raise NoMtpLayerError(
            f"{name} has no multi-token-prediction layer (no blk.{n}.nextn.eh_proj.weight; "
            f"{GGUFMetadata(reader).arch}.nextn_predict_layers is {blocks}: converted with --no-mtp, or by a "
            "converter that drops it): --speculative mtp needs one; convert the checkpoint again without "
            "--no-mtp, or use --speculative ngram or --speculative draft")
    if max_blocks is not None and blocks > max_blocks:
        raise NoMtpLayerError(f"{name} holds {blocks} multi-token-prediction blocks (nextn_predict_layers); more "
                              f"than {max_blocks} is not supported: use --speculative ngram")
    out: dict[str, Callable[[], np.ndarray]] = {}
    for ours, load in gguf_tensors(view, layer_cfg).items():
        if ours.startswith("layers.0."):
            out["layer." + ours[len("layers.0."):]] = load
            continue
        suffix = ours.removeprefix("gguf:blk.0.")
        if suffix not in nextn_weights:
            raise NoMtpLayerError(f"MTP tensor blk.{n}.{suffix} of {name} is not one we know")
        target, transpose = nextn_weights[suffix]
        shift = np.float32(norm_offset if target.endswith("norm") else 0.0)
        out[target] = lambda load=load, transpose=transpose, shift=shift: (
            np.asarray(load(), np.float32).T if transpose else np.asarray(load(), np.float32) - shift)
    return out
