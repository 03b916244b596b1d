"""The seam between a Quart handler (event loop) and the batcher's owner thread.

One API request becomes one or more batcher jobs (`/v1/completions` with a list of
prompts submits one job per prompt; each job has `n` rows). The batcher calls
`on_event(RowEvent)` from its owner thread; `Generation` hops each event onto the
handler's loop with `loop.call_soon_threadsafe` into one `asyncio.Queue`, tagged with
the job's index, so the handler reads every row of every job from a single stream.

`abort(reason)` is the server's cancel (graceful drain): the handler then ends the
request with an error instead of `finish_reason: "cancelled"`.

Cancellation is idempotent and synchronous (`batcher.cancel` only enqueues), so calling
`Generation.cancel()` from a `finally` needs no shield: it cannot be interrupted
half-way by the task's own cancellation. It only cancels jobs with unfinished rows:
a cancel for a finished job would be remembered by the batcher as arriving early.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence


class Generation:
    """The batcher jobs of one API request and the queue their RowEvents arrive on."""

    def __init__(self, batcher: Any, job_ids: Sequence[str], n: int) -> None:
        self._batcher = batcher
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.job_ids = tuple(job_ids)
        self._rows_open = [n] * len(job_ids)  # rows per job still without a finish_reason
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.inter_token_s: list[float] = []
        self._num_submitted = 0
        self.abort_reason: str | None = None  # set by `abort`: the handler answers with an error


    def submit(self, requests: Sequence[Any]) -> None:
        """Submit one GenerationRequest per job; on a refusal cancel those already in.

        Raises:
          AdmissionError from the batcher, after cancelling the earlier jobs.
        """
        try:
            for job, req in enumerate(requests):
                self._batcher.submit(req, self._callback(job))
                self._num_submitted += 1
        except BaseException:
            self.cancel()
            raise
        self.submitted_at = time.monotonic()

    def _callback(self, job: int):
        loop, queue = self._loop, self._queue

        def on_event(event: Any) -> None:  # owner thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (job, event))
            except RuntimeError:  # the loop is closed: the server is gone, nobody reads
                pass

        return on_event

    @property
    def is_finished(self) -> bool:
        return not any(self._rows_open[: self._num_submitted]) and self._num_submitted == len(self.job_ids)

    async def next_event(self, timeout_s: float | None) -> tuple[int, Any] | None:
        """The next (job index, RowEvent), or None after `timeout_s` with nothing new."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # lands as the inner get completes, and a client disconnect would go unnoticed.
        try:
            async with asyncio.timeout(timeout_s):
                job, event = await self._queue.get()
        except TimeoutError:
            return None
        now = time.monotonic()
        if event.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.last_token_at is not None:
                # one gap per event, spread over its tokens (a tick may emit several)
                gap = (now - self.last_token_at) / len(event.token_ids)
                self.inter_token_s.extend([gap] * len(event.token_ids))
            self.last_token_at = now
        if event.finish_reason is not None:
            self._rows_open[job] -= 1
        return job, event

    def abort(self, reason: str) -> list[str]:
        """Cancel as the server (drain, shutdown), not the client: the rows still end with
        finish_reason "cancelled", and the handler, seeing `abort_reason`, answers with an
        error (a final SSE error event, or a 503) instead of a normal reply."""
        if self.abort_reason is None:
            self.abort_reason = reason
        return self.cancel()

    def cancel(self) -> list[str]:
        """Cancel every submitted job that still has open rows; safe to call repeatedly."""
        cancelled = []
        for job in range(self._num_submitted):
            if self._rows_open[job] > 0:
                self._batcher.cancel(self.job_ids[job])
                cancelled.append(self.job_ids[job])
        return cancelled
