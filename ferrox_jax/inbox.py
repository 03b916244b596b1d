"""The owner thread's inbox: what every other thread sends the batcher. No jax here.

API handlers, the engine facade and the step channel never touch the owner's objects (the
scheduler, the rows, the runner and its device state); they put a message on the inbox, and
the owner takes every waiting message between two ticks (`ContinuousBatcher._take_messages`):

    AddJob(job, on_event)        a job that passed `submit`'s checks
    AbortJob(request_id)         a cancel (applied first thing in the next tick)
    OwnerCall(fn, future, ...)   a device-state change run on the owner thread: right away
                                 (`when_idle` False: a LoRA slot write, an adapter's unload)
                                 or once no job is waiting or running (sleep, wake); the
                                 future carries its result or exception
    Fault(kind, reason)          the engine is lost (a multi-host peer died or hung while no
                                 step ran): the owner gives up (`ferrox_jax/step_faults.py`)
    Stop()                       end the loop
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
from collections.abc import Callable
from typing import Any

from ferrox_jax.request import Job, RowEvent

EventCallback = Callable[[RowEvent], None]


@dataclasses.dataclass(frozen=True)
class AddJob:
    job: Job
    on_event: EventCallback


@dataclasses.dataclass(frozen=True)
class AbortJob:
    request_id: str


class Stop:
    pass


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # a `ferrox_jax/step_faults.py` kind the engine cannot survive ("peer")
    reason: str


@dataclasses.dataclass(frozen=True)
class OwnerCall:
    """`fn()` on the owner thread, between ticks (`when_idle`: once the scheduler has no work)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future
    when_idle: bool = False

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except Exception as e:  # reported to the caller, who asked for this call
            self.future.set_exception(e)


class Inbox:
    """A thread-safe queue of the messages above."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, message: Any) -> None:
        self._queue.put(message)

    def call(self, fn: Callable[[], Any], *, when_idle: bool = False) -> concurrent.futures.Future:
        """Sends `fn` to the owner thread; returns the future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(OwnerCall(fn, future, when_idle))
        return future

    @staticmethod
    def run_now(fn: Callable[[], Any]) -> concurrent.futures.Future:
        """`fn` on the calling thread (no owner thread runs yet), as a done future."""
        call = OwnerCall(fn, concurrent.futures.Future())
        call.run()
        return call.future

    def drain(self, *, block: bool) -> list[Any]:
        """Every waiting message (`block`: waits for the first one)."""
        messages = [self._queue.get()] if block else []
        while True:
            try:
                messages.append(self._queue.get_nowait())
            except queue.Empty:
                return messages
