"""Static shapes: the row and token buckets every step pads to.

Each distinct shape costs an XLA compile, so the engine compiles all buckets at start-up
and afterwards only pads to the nearest one. Buckets are derived from the config and
always include the maximum. A long prompt is chunked, never padded past the largest
token bucket. The block table has one fixed width (`runner.block_table_width`): context
length needs no bucket.
"""

from __future__ import annotations

import bisect
import dataclasses


def powers_of_two_up_to(limit: int, start: int = 1, ratio: int = 2) -> tuple[int, ...]:
    """start, start*ratio, ... below limit, then limit itself."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1; got {limit}")
    out, b = [], max(1, start)
    while b < limit:
        out.append(b)
        b *= ratio
    out.append(limit)
    return tuple(out)


def pick(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n. Raises if n exceeds the largest (a scheduling bug)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """decode_rows: rows per decode step; prefill_tokens: tokens per prefill chunk.

    Context length needs no bucket: attention walks the block table with a traced trip
    count (`models/attention.py`), so the block-table width is one fixed size.
    """

    decode_rows: tuple[int, ...]
    prefill_tokens: tuple[int, ...]

    @classmethod
    def derive(cls, max_rows: int, max_prefill_tokens: int, min_prefill_tokens: int = 16) -> "Buckets":
        return cls(
            decode_rows=powers_of_two_up_to(max_rows),
            prefill_tokens=powers_of_two_up_to(max_prefill_tokens, start=min(min_prefill_tokens, max_prefill_tokens)),
        )

    def keys(self) -> list[tuple[str, int, int]]:
        """Every (kind, rows, tokens) shape compiled at warm-up. The sampler's shapes
        depend on the rows only, and a prefill chunk is one row (`decode_rows` starts at 1)."""
        return ([("decode", b, 1) for b in self.decode_rows]
                + [("prefill", 1, t) for t in self.prefill_tokens]
                + [("sample", b, 1) for b in self.decode_rows])
