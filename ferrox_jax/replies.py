"""The owner thread's reply channels: each open job's `on_event`, which of its rows have
finished, and the events held for the next step's device time. No jax here.

`ContinuousBatcher` (ferrox_jax/batcher.py, step 7 of its loop) hands each tick's events
here: `hold` while the scheduler has more work, `deliver` at once when it has none. The
held ones go (`deliver_held`) as soon as the next step's forward is dispatched, so the
event loop's work for them (the HTTP side, which shares the GIL and the cores with the
owner) runs beside the device, not between one step's fetch and the next step's dispatch.
Each event is delivered once: deliveries run under one re-entrant lock, since the
watchdog's thread may end everything (`end_all`) while the owner is in a step (an
`on_event` only queues to the event loop, so the lock is never held for long).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from ferrox_jax.inbox import EventCallback
from ferrox_jax.request import Job, RowEvent

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _OpenJob:
    """A job whose rows have not all finished."""

    job: Job
    on_event: EventCallback
    finished_indices: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class Delivered:
    """What a delivery did: the jobs it closed (every row finished) and those whose reply
    channel raised on an event that was not their last (the caller cancels them)."""

    closed: tuple[str, ...] = ()
    broken: tuple[str, ...] = ()


class Replies:
    """The open jobs' reply channels (owner thread; `deliver_held` and `end_all` also from
    the watchdog's)."""

    def __init__(self) -> None:
        self._open: dict[str, _OpenJob] = {}
        self._held: list[RowEvent] = []
        self._lock = threading.RLock()

    def open(self, job: Job, on_event: EventCallback) -> None:
        with self._lock:
            self._open[job.request_id] = _OpenJob(job, on_event)

    def hold(self, events: list[RowEvent]) -> None:
        """Keeps `events` for `deliver_held` (after any still held)."""
        with self._lock:
            self._held = self._held + events

    def deliver_held(self) -> Delivered:
        with self._lock:
            held, self._held = self._held, []
            return self.deliver(held)

    def deliver(self, events: list[RowEvent]) -> Delivered:
        """Each event to its job's `on_event`, in order; a raising channel is logged."""
        closed, broken = [], []
        with self._lock:
            for event in events:
                self._deliver_one(event, closed, broken)
        return Delivered(tuple(closed), tuple(broken))

    def _deliver_one(self, event: RowEvent, closed: list[str], broken: list[str]) -> None:
        open_job = self._open.get(event.request_id)
        if open_job is None:  # ended already (end_all on the watchdog's thread)
            return
        try:
            open_job.on_event(event)
        except Exception:  # a broken reply channel cancels its job, not the loop
            log.exception("on_event failed for request %s; cancelling it", event.request_id)
            if event.finish_reason is None:
                broken.append(event.request_id)
        if event.finish_reason is not None:
            open_job.finished_indices.add(event.index)
            if len(open_job.finished_indices) == open_job.job.n:
                del self._open[event.request_id]
                closed.append(event.request_id)

    def end_all(self, error: str) -> None:
        """The held events, then an error event for every row not finished yet."""
        with self._lock:
            self.deliver_held()
            self.deliver([RowEvent(request_id=request_id, index=index, token_ids=(), text="", logprobs=None,
                                   finish_reason="error", error=error,
                                   num_prompt_tokens=len(open_job.job.prompt_token_ids))
                          for request_id, open_job in list(self._open.items())
                          for index in range(open_job.job.n)
                          if index not in open_job.finished_indices])
