"""The K-quant kernel at 9 to 15 rows: the 16-bit weights path in two passes of rows.

A c8 decode step mixed with a few prompt tokens multiplies 9 to 15 activation rows by every
weight. With wide_rows 1 on AVX-512 VNNI block_matmul_k.cc runs them on
block_matmul_k_rows16.inc (16-bit activations, one int16 each, S = amax / 32767 per row and
256-wide super-block), the first 8 rows then the rest over each block of columns. Checked
against float64 x @ dequantize(w)^T within the integer paths' bound (amax / 64000 of each
super-block times sum |w|, plus float32's few ulps: tests/models/test_block_matmul_k.py's
int_bound); every row off float32's tighter bound somewhere (so the integer path ran for the
rows of both passes); each row quantized with its own scale (a 1000x row in the first pass, a
zero and a one-spike row in the second); the fused q/k/v call giving each weight's own bits.
"""

from __future__ import annotations

from tests.models.test_block_matmul_k import check_fused_equals_one_call, needs_vnni


# 9, 12 and 15 rows against float64 within their bound, every row off float32's: in
# tests/models/test_block_matmul_k.py's test_integer_path_rows_within_their_16_bit_bound


# each row on its own scale at 13 rows: in test_block_matmul_k.py's
# test_integer_path_rows_are_quantized_each_on_its_own


@needs_vnni
def test_split_rows_fused_equals_one_call_per_weight():
    # both passes per weight, at 12 rows
    check_fused_equals_one_call((12,), seed=60)
