"""Static shapes: the row, token and block-table buckets every step pads to.

Each distinct shape costs an XLA compile, so the engine compiles all buckets at start-up
and afterwards only pads to the nearest one. Buckets are derived from the config and
always include the maximum. A long prompt is chunked, never padded past the largest
token bucket.
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
    """decode_rows: rows per decode step; prefill_tokens: tokens per prefill chunk;
    decode_blocks / prefill_blocks: block-table widths (blocks a row may read)."""

    decode_rows: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    decode_blocks: tuple[int, ...]
    prefill_blocks: tuple[int, ...]

    @classmethod
    def derive(cls, max_rows: int, max_prefill_tokens: int, max_blocks_per_row: int,
               min_prefill_tokens: int = 16, min_blocks: int = 4) -> "Buckets":
        # Decode reads every block in the table for every row, so its widths are fine
        # grained (x2); a prefill is one row, where over-reading costs less (x4 steps).
        return cls(
            decode_rows=powers_of_two_up_to(max_rows),
            prefill_tokens=powers_of_two_up_to(max_prefill_tokens, start=min(min_prefill_tokens, max_prefill_tokens)),
            decode_blocks=powers_of_two_up_to(max_blocks_per_row, start=min(min_blocks, max_blocks_per_row)),
            prefill_blocks=powers_of_two_up_to(max_blocks_per_row, start=min(min_blocks, max_blocks_per_row), ratio=4),
        )

    def keys(self) -> list[tuple[str, int, int, int]]:
        """Every (kind, rows, tokens, blocks) shape compiled at warm-up."""
        keys = [("decode", b, 1, mb) for b in self.decode_rows for mb in self.decode_blocks]
        keys += [("prefill", 1, t, mb) for t in self.prefill_tokens for mb in self.prefill_blocks]
        return keys
