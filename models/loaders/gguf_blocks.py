"""A GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 projections as raw block rows,
for `--quantization gguf`.

`gguf_block_tensors(path, cfg)` gives `{our name: () -> (u8[out, row bytes], fmt)}` for
every 2-D tensor in one of those formats that is a projection or the LM head
(`models/gguf_blocks.py` has the layout). The numpy view of a GGUF weight is already
[out, in] with each output channel's blocks contiguous, so reading is a slice of the
memory-mapped file; what `models/loaders/gguf.py` does to float rows is done to block rows:
llama's q/k rows are un-permuted (whole rows move, so it is exact), fused tensors
(Phi-3's attn_qkv, ffn_up) split by rows. A MoE file's expert stacks (`ffn_{gate,up,down}_exps`,
u8[E, out, row bytes]: each expert's rows as a projection's) are kept whole under our stack
names, each expert computed from its own slice (`models/quant.py:select_expert`) instead of
dequantized to float at load; gpt-oss's MXFP4 stacks too (their own kernel,
`models/kernels/block_matmul_mxfp4.cc`). The embedding's blocks are kept under "embed":
the model keeps its table as these block rows (a lookup dequantizes the rows it gathers),
and a tied LM head is the same array.
"""

from __future__ import annotations

import os
import re
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType

from models.config import ModelConfig
from models.family import ExpertStack, Family
from models.gguf_reader import GGUFFile
from models.loaders.common import expected_params
from models.loaders.gguf import open_gguf, our_row_ranges, unpermute_rope_rows
from models.registry import family_for

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")  # as models/loaders/gguf.py reads per-layer names
HostBlocks = tuple[np.ndarray, str]  # (u8[out, row bytes], block format name)
BlockProducer = Callable[[], HostBlocks]

GGML_BLOCK_FORMATS = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1",
                      GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_K: "q4_k",
                      GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k",
                      GGMLQuantizationType.MXFP4: "mxfp4"}


def _rows(tensor, cfg: ModelConfig, unpermute_qk: bool) -> np.ndarray:
    """u8[out, row bytes] of a block tensor; q/k rows un-permuted when llama.cpp permuted them."""
    rows = np.asarray(tensor.data)
    suffix = tensor.name.split(".", 2)[-1]
    if unpermute_qk and suffix == "attn_q.weight":
        rows = unpermute_rope_rows(rows, cfg.num_heads)
    elif unpermute_qk and suffix == "attn_k.weight":
        rows = unpermute_rope_rows(rows, cfg.num_kv_heads)
    return rows


def _producer(tensor, cfg: ModelConfig, unpermute_qk: bool, start: int = 0, width: int | None = None) -> BlockProducer:
    fmt = GGML_BLOCK_FORMATS[tensor.tensor_type]

    def read() -> HostBlocks:
        rows = _rows(tensor, cfg, unpermute_qk)
        stop = rows.shape[0] if width is None else start + width
        return np.ascontiguousarray(rows[start:stop]), fmt
    return read


def gguf_block_tensors(path: str | os.PathLike | GGUFFile, cfg: ModelConfig) -> dict[str, BlockProducer]:
    """The block producers of `path` (a GGUF file, or its open reader) by our parameter name
    (module docstring)."""
    reader = path if isinstance(path, GGUFFile) else open_gguf(path)
    family: Family = family_for(cfg.architecture)
    arch = reader.fields["general.architecture"].contents()
    unpermute_qk = arch in family.gguf_qk_permuted
    expected = expected_params(cfg)
    out: dict[str, BlockProducer] = {}
    for t in reader.tensors:
        if t.tensor_type not in GGML_BLOCK_FORMATS:
            continue
        if len(t.shape) == 3:  # an expert stack, u8[E, out, row bytes]: already each expert's rows
            name = _expert_stack_name(t.name, family)
            if name is not None:
                out[name] = _producer(t, cfg, False)
            continue
        if len(t.shape) != 2:
            continue
        for name, start, width in our_row_ranges(t.name, family, expected):
            out[name] = _producer(t, cfg, unpermute_qk, start, width)
    return {name: load for name, load in out.items() if name in expected}


def _expert_stack_name(gguf_name: str, family: Family) -> str | None:
    """Our name of a llama.cpp expert stack (`blk.N.ffn_gate_exps.weight`: one of our stacks,
    each expert stored [out, in], as the blocks keep it), else None. A stack fused from two
    of ours (gpt-oss's HF gate_up) or not transposed is not a GGUF block stack."""
    m = _LAYER_NAME.match(gguf_name)
    target = family.gguf_layer_weights.get(m.group(2)) if m else None
    if not isinstance(target, ExpertStack) or len(target.names) != 1 or not target.transpose:
        return None
    return f"layers.{m.group(1)}.{target.names[0]}"
