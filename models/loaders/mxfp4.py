"""MXFP4 expert tensors of HF checkpoints (gpt-oss's released ones): dequantized at load, or
kept as their blocks for the CPU kernel.

transformers packs each MXFP4 tensor as two: `NAME_blocks` u8[..., R, G, 16] (two FP4
(e2m1) codes a byte, the low nibble first, 32 values a group) and `NAME_scales`
u8[..., R, G] (one power of two per group, biased by 127). Dequantized (transformers'
`convert_moe_packed_tensors`, which this follows value for value) a group is
`FP4[code] * 2^(scale - 127)`, rows `[..., R, G * 32]`, and the tensor is those rows with
its last two axes swapped: gpt-oss's `gate_up_proj` [E, D, 2F] from blocks stored per
output row [E, 2F, D/32, 16], `down_proj` [E, F, D] from [E, D, F/32, 16].

`pair_mxfp4` turns a checkpoint's tensor loaders into ones where each blocks/scales pair
is one float tensor under NAME, so the family's weight table maps it like any other: the
float modes, and every backend but one x86 CPU device with ferrox's kernels, compute with
these float experts (the checkpoint's values exactly, at 4 bytes a weight).

`mxfp4_block_stacks` gives the same pairs as block stacks for quantization "gguf" (what
`auto` picks on one CPU device with the kernels): each expert stack of ours as
u8[E, out, in / 32 * 17] in llama.cpp's MXFP4 layout (`models/gguf_mxfp4.py:repack_hf`:
the nibbles reordered and each scale byte put before its codes, no float copy made), the
blocks' rows being output channels as the kernel wants them. gpt-oss's fused gate_up
interleaves gate and up by output channel, so each of the two takes every other row.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import numpy as np

from models.family import ExpertStack, WeightTable
from models.gguf_mxfp4 import repack_hf

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """u8[..., R, G, 16] blocks and u8[..., R, G] scales -> f32[..., G * 32, R] (module docstring)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair "
                         "(blocks must be [..., groups, 16] over scales [..., groups])")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    rows = values.reshape(*blocks.shape[:-2], -1)  # [..., R, G * 32]
    return np.ascontiguousarray(rows.swapaxes(-1, -2))


def pair_mxfp4(loads: dict[str, Callable[[], np.ndarray]]) -> dict[str, Callable[[], np.ndarray]]:
    """`loads` (checkpoint name -> loader) with each NAME_blocks / NAME_scales pair replaced by
    one loader of the dequantized NAME; a lone half is left as it is (and reported unexpected)."""
    out = dict(loads)
    for name in [n for n in loads if n.endswith(BLOCKS)]:
        base = name[:-len(BLOCKS)]
        if base + SCALES not in loads:
            continue
        blocks, scales = out.pop(name), out.pop(base + SCALES)
        out[base] = lambda blocks=blocks, scales=scales: dequantize_mxfp4(blocks(), scales())
    return out


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")  # as models/loaders/safetensors.py reads them
HostBlocks = tuple[np.ndarray, str]  # (u8[E, out, row bytes], "mxfp4"), as models/loaders/gguf_blocks.py


def mxfp4_block_stacks(loads: Mapping[str, Callable[[], np.ndarray]], table: WeightTable,
                       expected: Mapping[str, tuple[int, ...]]) -> dict[str, Callable[[], HostBlocks]]:
    """{our expert stack name: () -> (u8[E, out, row bytes], "mxfp4")} for every blocks /
    scales pair of `loads` (checkpoint name -> loader) that the family's `table` maps to
    expert stacks stored [E, in, out] (module docstring); other pairs are left to the float path."""
    out: dict[str, Callable[[], HostBlocks]] = {}
    for name in [n for n in loads if n.endswith(BLOCKS)]:
        base = name[:-len(BLOCKS)]
        m = _LAYER_RE.match(base)
        target = table.get(m.group(2)) if m else None
        if base + SCALES not in loads or not isinstance(target, ExpertStack) or target.transpose:
            continue
        for index, ours in enumerate(target.names):
            key = f"layers.{m.group(1)}.{ours}"
            if key in expected:
                out[key] = _stack(loads[name], loads[base + SCALES], index, len(target.names), target.halves)
    return out


def _stack(blocks: Callable, scales: Callable, index: int, count: int, halves: bool) -> Callable[[], HostBlocks]:
    """Our stack `index` of `count` sharing one checkpoint tensor: its rows (output channels)
    picked from the blocks and scales before repacking (`ExpertStack`'s column rule)."""
    def read() -> HostBlocks:
        b, s = np.asarray(blocks(), np.uint8), np.asarray(scales(), np.uint8)  # [E, R, G, 16], [E, R, G]
        if halves:
            width = b.shape[1] // count
            rows = slice(index * width, (index + 1) * width)
        else:
            rows = slice(index, None, count)
        return repack_hf(b[:, rows], s[:, rows]), "mxfp4"
    return read
