"""A step's grammar bitmask: the constrained rows' masks, filled while the forward runs. No jax here.

The owner loop dispatches the forward, then asks `StepMasks.fill` for the bitmask of a batch
with constrained rows (`ferrox_jax/batcher.py`): each constrained row's allowed tokens
from its matcher (`GrammarCompiler.fill_bitmask`: llguidance's thread pool, GIL released),
every other row all ones. A row's mask depends on the token it sampled last step, so this
is the earliest it can be computed, and the forward is what it hides behind; the counters
say how long it took and whether the forward was still running when it finished.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ferrox_jax.host_batch import bitmask_words
from ferrox_jax.runner_protocol import PendingStep

# fill_bitmask(bitmask i32[B, W], matchers): constrained rows from their matcher, the rest
# all ones (`ferrox_jax.grammar.GrammarCompiler.fill_bitmask`).
BitmaskFiller = Callable[[np.ndarray, Sequence[Any]], None]


class StepMasks:
    """Fills steps' bitmasks and counts the work (the `grammar_mask_*` BatcherStats fields)."""

    def __init__(self, fill_bitmask: BitmaskFiller, vocab_size: int) -> None:
        self._fill_bitmask = fill_bitmask
        self._words = bitmask_words(vocab_size)
        self.counters: collections.Counter[str] = collections.Counter()

    def fill(self, pending: PendingStep, matcher_of: Callable[[int], Any]) -> np.ndarray:
        """The bitmask i32[R, W] of the pending step's batch (`matcher_of(row_id)`: a
        constrained row's matcher)."""
        start_s = time.perf_counter()
        batch = pending.batch
        matchers = [matcher_of(int(row_id)) if constrained else None
                    for row_id, constrained in zip(batch.row_ids, batch.constrained)]
        bitmask = np.empty((batch.num_rows, self._words), np.int32)
        self._fill_bitmask(bitmask, matchers)
        self.counters.update(grammar_mask_s=time.perf_counter() - start_s,
                             grammar_mask_rows=sum(m is not None for m in matchers), grammar_mask_fills=1,
                             grammar_mask_fills_hidden=int(not pending.is_done()))
        return bitmask
