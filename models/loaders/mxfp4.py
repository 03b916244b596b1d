"""MXFP4 expert tensors of HF checkpoints (gpt-oss's released ones), dequantized at load.

transformers packs each MXFP4 tensor as two: `NAME_blocks` u8[..., R, G, 16] (two FP4
(e2m1) codes a byte, the low nibble first, 32 values a group) and `NAME_scales`
u8[..., R, G] (one power of two per group, biased by 127). Dequantized (transformers'
`convert_moe_packed_tensors`, which this follows value for value) a group is
`FP4[code] * 2^(scale - 127)`, rows `[..., R, G * 32]`, and the tensor is those rows with
its last two axes swapped: gpt-oss's `gate_up_proj` [E, D, 2F] from blocks stored per
output row [E, 2F, D/32, 16], `down_proj` [E, F, D] from [E, D, F/32, 16].

`pair_mxfp4` turns a checkpoint's tensor loaders into ones where each blocks/scales pair
is one float tensor under NAME, so the family's weight table maps it like any other.
The engine computes with float experts, so MXFP4 costs host memory and load time, not
accuracy: the values are the checkpoint's exactly.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

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
