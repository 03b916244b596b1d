"""A row's life as states, and the transitions allowed between them. No jax here.

A row (`ferrox_jax/request.py:Row`) is WAITING until its job is admitted, PREFILLING while its
prompt is computed, DECODING while it samples, and then finished one of four ways; a
preempted row (the priority policy, `ferrox_jax/preemption.py`) goes back to WAITING. The
scheduler moves rows only through `transition`, which refuses a move the table does not
allow and counts each entry.
"""

from __future__ import annotations

import collections
import enum
from typing import Any


class RowState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED_STOP = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_CANCELLED = "cancelled"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason for a finished state ("stop", "length", ...), else None."""
        return self.value if self.is_finished else None


_FINISHED = frozenset({RowState.FINISHED_STOP, RowState.FINISHED_LENGTH,
                       RowState.FINISHED_CANCELLED, RowState.FINISHED_ERROR})
_ENDED_EARLY = frozenset({RowState.FINISHED_CANCELLED, RowState.FINISHED_ERROR})

_ALLOWED_TRANSITIONS: dict[RowState, frozenset[RowState]] = {
    RowState.WAITING: frozenset({RowState.PREFILLING, RowState.DECODING} | _ENDED_EARLY),
    RowState.PREFILLING: frozenset({RowState.DECODING, RowState.FINISHED_STOP, RowState.WAITING} | _ENDED_EARLY),
    RowState.DECODING: _FINISHED | {RowState.WAITING},  # -> WAITING: preempted (the priority policy)
    RowState.FINISHED_STOP: frozenset(),
    RowState.FINISHED_LENGTH: frozenset(),
    RowState.FINISHED_CANCELLED: frozenset(),
    RowState.FINISHED_ERROR: frozenset(),
}


def transition(row: Any, new_state: RowState,
                counts: collections.Counter[RowState]) -> None:
    """Moves a row to `new_state` if the table allows it, and counts the entry."""
    allowed = _ALLOWED_TRANSITIONS[row.state]
    assert new_state in allowed, (
        f"row {row.row_id} of {row.job.submitted.request_id}: "
        f"{row.state.name} -> {new_state.name} is not an allowed transition")
    row.state = new_state
    counts[new_state] += 1
