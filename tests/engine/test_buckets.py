"""The step shapes: which are compiled, and which one a step pads to."""

import pytest

from ferrox_jax.buckets import Buckets, StepShape


def test_the_default_shapes_are_decode_chunk_and_a_few_mixed_ones():
    buckets = Buckets.derive(max_rows=32, max_chunk_tokens=128)
    shapes = buckets.shapes()
    decode = [s for s in shapes if not s.chunk_rows]
    chunk_only = [s for s in shapes if not s.decode_rows]
    mixed = [s for s in shapes if s.decode_rows and s.chunk_rows]
    assert [s.decode_rows for s in decode] == [1, 2, 4, 8, 16, 32]
    assert [s.chunk_tokens for s in chunk_only] == [16, 32, 64, 128] and {s.chunk_rows for s in chunk_only} == {1}
    # decode rows padded to 4, 8, 16 or 32 next to each of the 4 chunk sizes: 4 x 4
    assert len(mixed) == 16 and {s.decode_rows for s in mixed} == {4, 8, 16, 32}
    assert len(set(shapes)) == len(shapes) == 26
    assert buckets.sampler_rows() == [1, 2, 4, 5, 8, 9, 16, 17, 32, 33], "one sampler per distinct row count"


@pytest.mark.parametrize("decode,chunks,expected", [
    (5, [], StepShape(8, 0, 0)),  # decode only: the row buckets
    (0, [20], StepShape(0, 1, 32)),  # one chunk: the token buckets
    (3, [100], StepShape(4, 1, 128)),  # mixed: decode rows to the set from 4
    (9, [16], StepShape(16, 1, 16)),
    (32, [128], StepShape(32, 1, 128)),
])
def test_a_step_pads_to_the_smallest_shape_holding_it(decode, chunks, expected):
    assert Buckets.derive(max_rows=32, max_chunk_tokens=128).shape_for(decode, chunks) == expected


def test_several_chunks_pad_to_the_largest_chunk_and_a_power_of_two_of_rows():
    buckets = Buckets.derive(max_rows=8, max_chunk_tokens=64, max_chunks=3)
    assert buckets.chunk_rows == (1, 2, 3)
    assert buckets.shape_for(2, [10, 64, 5]) == StepShape(4, 3, 64)
    assert buckets.shape_for(0, [10, 20]) == StepShape(0, 2, 64)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        buckets.shape_for(0, [10, 20, 30, 40])
