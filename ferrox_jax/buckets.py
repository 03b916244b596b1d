"""Static shapes: the step shapes every forward pads to. No jax here.

Each distinct shape costs an XLA compile, so the engine compiles all of them at start-up
and afterwards only pads to the nearest one. A step's forward holds two segments of rows:

    decode segment   Bd rows of one token (decoding rows; the one-query attention kernels)
    chunk segment    Pc rows of Tc tokens (prompt chunks; paged attention over [Pc, Tc])

so a shape is `StepShape(Bd, Pc, Tc)`, with N = Bd + Pc * Tc tokens and R = Bd + Pc rows
(the sampler's shape depends on R alone). The buckets:

    decode only      (b, 0, 0)        b in decode_rows   (powers of two up to max_rows)
    chunks only      (0, 1, t)        t in chunk_tokens  (16, 32, ... up to the largest chunk)
                     (0, p, Tmax)     p in chunk_rows    (several full chunks, when the token
                                                          budget holds more than one)
    mixed            (b, p, t)        b in mixed_rows (4, 8, 16, ...: the row buckets from 4,
                                      since 1-3 padded decode rows cost little next to a
                                      chunk), (p, t) as above

A mixed step is compute-bound on a CPU (the chunk), so its padding is paid in full: rows
are padded by at most 2x (a 4x grid cost 10 % of a 16-row + 128-token step, measured),
and each chunk size keeps its own mixed shapes (a short prompt arriving while rows decode
must not pay for a full chunk).

Buckets always include their maximum. A long prompt is chunked, never padded past the
largest token bucket. The block table has one fixed width (`runner.block_table_width`):
context length needs no bucket.
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


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """One compiled forward shape: Bd decode rows, then Pc chunk rows of Tc tokens."""

    decode_rows: int
    chunk_rows: int
    chunk_tokens: int

    @property
    def num_rows(self) -> int:
        return self.decode_rows + self.chunk_rows

    @property
    def key(self) -> tuple[int, int, int]:
        """(Bd, Pc, Tc), the runner's executable key after "forward"; read every step, so
        not `dataclasses.astuple` (which deep-copies each field)."""
        return (self.decode_rows, self.chunk_rows, self.chunk_tokens)

    @property
    def num_tokens(self) -> int:
        return self.decode_rows + self.chunk_rows * self.chunk_tokens


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The step shapes of one runner (see the module docstring)."""

    decode_rows: tuple[int, ...]  # rows of a decode-only step
    mixed_rows: tuple[int, ...]  # decode rows of a step that also has chunks
    chunk_tokens: tuple[int, ...]  # tokens of a step's one chunk row
    chunk_rows: tuple[int, ...]  # chunk rows of a step (several only at the largest chunk)

    @classmethod
    def derive(cls, max_rows: int, max_chunk_tokens: int, max_chunks: int = 1,
               min_chunk_tokens: int = 16) -> "Buckets":
        """Args:
          max_rows: rows one step holds (decode rows; a step with chunks holds the chunks' rows too).
          max_chunk_tokens: tokens of one chunk, at most.
          max_chunks: chunks one step holds, at most (the token budget over the chunk size).
        """
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1; got {max_chunks}")
        return cls(decode_rows=powers_of_two_up_to(max_rows),
                   mixed_rows=powers_of_two_up_to(max_rows, start=min(4, max_rows)),
                   chunk_tokens=powers_of_two_up_to(max_chunk_tokens, start=min(min_chunk_tokens, max_chunk_tokens)),
                   chunk_rows=powers_of_two_up_to(max_chunks))

    @property
    def max_chunk_tokens(self) -> int:
        return self.chunk_tokens[-1]

    def shapes(self) -> list[StepShape]:
        """Every forward shape compiled at warm-up."""
        chunk_parts = [(1, t) for t in self.chunk_tokens] + [(p, self.max_chunk_tokens) for p in self.chunk_rows[1:]]
        return ([StepShape(b, 0, 0) for b in self.decode_rows]
                + [StepShape(0, p, t) for p, t in chunk_parts]
                + [StepShape(b, p, t) for b in self.mixed_rows for p, t in chunk_parts])

    def sampler_rows(self) -> list[int]:
        """Every sampler shape: one per distinct row count of a forward shape."""
        return sorted({shape.num_rows for shape in self.shapes()})

    def shape_for(self, num_decode_rows: int, chunk_lengths: list[int]) -> StepShape:
        """The smallest shape holding `num_decode_rows` one-token rows and chunks of these lengths.

        Raises:
          ValueError: more rows or longer chunks than the largest bucket (a scheduling bug).
        """
        if not chunk_lengths:
            return StepShape(pick(self.decode_rows, num_decode_rows), 0, 0)
        longest = max(chunk_lengths)
        if len(chunk_lengths) == 1:
            rows, tokens = 1, pick(self.chunk_tokens, longest)
        else:
            rows, tokens = pick(self.chunk_rows, len(chunk_lengths)), self.max_chunk_tokens
            if longest > tokens:
                raise ValueError(f"chunk of {longest} tokens exceeds the largest bucket {tokens}")
        decode = pick(self.mixed_rows, num_decode_rows) if num_decode_rows else 0
        return StepShape(decode, rows, tokens)
