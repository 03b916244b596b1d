"""Resumable streams (a ferrox extension): a stream that outlives its connection.

`stream_resumable: true` (with `stream: true`) on `/v1/chat/completions` and
`/v1/completions` runs the request detached from the connection: a pump task renders it
into a `ReplayBuffer`, and connections only follow that buffer. So:

- every SSE event carries `id: {request_id}:{n}` (n = 0, 1, ... per stream) and each
  connection's first event one `retry: 1000` line, as EventSource clients expect;
- a client disconnect does not cancel the request (`/v1/cancel` still does);
- `GET /v1/stream/{request_id}` with `Last-Event-ID: {request_id}:{n}` (or
  `?last_event_id=`) replays the events after n, then continues live; without it, from the
  start;
- `GET /v1/stream/{request_id}/poll` answers the same events as JSON batches
  (`{"events": [{"id", "event", "data"}], "last_event_id", "finished"}`), waiting up to
  `wait_ms` (default 5000, at most 30000) when nothing is new yet.

The replay window is bounded three ways (settings `--resumable-max-bytes`,
`--resumable-ttl`, `--resumable-max-streams`): a stream keeps at most that many bytes of
events (the oldest go first), a finished stream is kept that many seconds, and at most that
many streams are kept (the oldest finished one makes room; if all are live, a new resumable
request is a 503). Asking for events that are gone is a 410 `replay_window_lost`; an id
that is not `{request_id}:{n}` or is ahead of the stream a 400 `bad_last_event_id`; an
unknown stream a 404 `stream_not_found`. A live follower that falls behind the byte bound
is disconnected, so it reconnects and learns it lost events instead of missing them. The
request's own connection is the exception: it gets every event, as a plain stream does
(the events it has not taken yet are kept past the byte bound until it takes them or
leaves), so a pump that ran ahead while the connection was still starting (a busy event
loop hands it a burst of engine events at once) never costs the client events it never
had a chance to read.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import AsyncIterator

from quart import Blueprint, Response, current_app, request

from api.errors import APIError, unavailable
from api.generation import GenerationRun
from api.sse import KEEP_ALIVE_COMMENT, sse_response
from api.state import json_response, state_of

blueprint = Blueprint("resumable", __name__)

RETRY_MS = 1000  # the `retry:` clients wait before reconnecting
MAX_POLL_WAIT_MS = 30_000
MAX_EXPIRED_IDS = 4096  # ids remembered after eviction, to answer 410 instead of 404


class ReplayBuffer:
    """One resumable stream's recent events (event-loop only)."""

    def __init__(self, request_id: str, max_bytes: int) -> None:
        self.request_id = request_id
        self.max_bytes = max_bytes
        self.events: collections.deque[tuple[int, bytes]] = collections.deque()  # (n, frame)
        self.num_bytes = 0
        self.next_n = 0  # the number the next event gets
        self.finished_at: float | None = None  # monotonic s, once the run's last frame is in
        self.pump: asyncio.Task | None = None
        # The first event the request's own connection has not taken yet, while it is
        # attached: nothing from it on is dropped (see the module docstring).
        self.pinned_n: int | None = None
        self._changed = asyncio.Event()

    @property
    def first_n(self) -> int:
        """The oldest event still kept (next_n when none is)."""
        return self.events[0][0] if self.events else self.next_n

    def append(self, frame: bytes) -> None:
        self.events.append((self.next_n, frame))
        self.next_n += 1
        self.num_bytes += len(frame)
        self._trim()
        self._wake()

    def pin(self, n: int | None) -> None:
        """Keep events from `n` on (None: release them to the byte bound)."""
        self.pinned_n = n
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest events past the byte bound (keeping the newest, and what is pinned)."""
        while self.num_bytes > self.max_bytes and len(self.events) > 1 and (
                self.pinned_n is None or self.events[0][0] < self.pinned_n):
            self.num_bytes -= len(self.events.popleft()[1])

    def finish(self) -> None:
        self.finished_at = time.monotonic()
        self._wake()

    def after(self, n: int) -> list[tuple[int, bytes]]:
        return [(m, frame) for m, frame in self.events if m > n]

    async def wait(self, timeout_s: float) -> bool:
        """Until the next append or finish; False after `timeout_s` with neither."""
        changed = self._changed
        try:
            async with asyncio.timeout(timeout_s):
                await changed.wait()
        except TimeoutError:
            return False
        return True

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class ResumableStreams:
    """The app's replay buffers, bounded in bytes, age and number (see the module docstring)."""

    def __init__(self, max_streams: int, max_bytes: int, ttl_s: float) -> None:
        self.max_streams, self.max_bytes, self.ttl_s = max_streams, max_bytes, ttl_s
        self.streams: collections.OrderedDict[str, ReplayBuffer] = collections.OrderedDict()
        self._expired: collections.OrderedDict[str, None] = collections.OrderedDict()

    def open(self, request_id: str) -> ReplayBuffer:
        self.sweep(time.monotonic())
        if len(self.streams) >= self.max_streams:
            oldest = next((rid for rid, b in self.streams.items() if b.finished_at is not None), None)
            if oldest is None:
                raise unavailable(f"{len(self.streams)} resumable streams are live (--resumable-max-streams); "
                                  "retry shortly", code="too_many_resumable_streams")
            self._evict(oldest)
        buffer = self.streams[request_id] = ReplayBuffer(request_id, self.max_bytes)
        return buffer

    def get(self, request_id: str) -> ReplayBuffer:
        self.sweep(time.monotonic())
        buffer = self.streams.get(request_id)
        if buffer is not None:
            return buffer
        if request_id in self._expired:
            raise APIError(410, f"stream {request_id!r} is no longer kept (--resumable-ttl, "
                                "--resumable-max-streams)", code="replay_window_lost")
        raise APIError(404, f"no resumable stream {request_id!r}", code="stream_not_found")

    def sweep(self, now: float) -> None:
        """Forget finished streams older than the TTL."""
        for rid in [rid for rid, b in self.streams.items()
                    if b.finished_at is not None and now - b.finished_at > self.ttl_s]:
            self._evict(rid)

    def _evict(self, request_id: str) -> None:
        del self.streams[request_id]
        self._expired[request_id] = None
        while len(self._expired) > MAX_EXPIRED_IDS:
            self._expired.popitem(last=False)


def serve(run: GenerationRun, frames: AsyncIterator[bytes]) -> Response:
    """Submit `run` and stream `frames` (its adapter's SSE events) resumably."""
    streams: ResumableStreams = run.state.resumable
    buffer = streams.open(run.api_id)
    try:
        run.submit()
    except BaseException:
        del streams.streams[run.api_id]
        raise
    buffer.pin(0)  # the request's own connection, from its first event
    # Released when the connection's task ends, even if the body is never iterated (a
    # client gone before it started) and the follower's `finally` never runs.
    asyncio.current_task().add_done_callback(lambda _task: buffer.pin(None))
    buffer.pump = asyncio.get_running_loop().create_task(_pump(buffer, frames))
    return sse_response(_follow(buffer, -1, run.state.config.sse_keepalive_s, pinned=True), run.api_id)


async def _pump(buffer: ReplayBuffer, frames: AsyncIterator[bytes]) -> None:
    try:
        async for frame in frames:
            if not frame.startswith(b":"):  # keep-alive comments belong to each connection
                buffer.append(frame)
    finally:
        buffer.finish()


async def _follow(buffer: ReplayBuffer, after: int, keepalive_s: float, pinned: bool = False
                  ) -> AsyncIterator[bytes]:
    """The events after `after`, then live ones until the stream ends. `pinned`: the
    request's own connection, whose untaken events the buffer keeps (`ReplayBuffer.pin`)."""
    prefix = b"retry: %d\n" % RETRY_MS
    try:
        while True:
            events = buffer.after(after)
            if events and events[0][0] != after + 1:
                return  # fell behind the byte bound: the reconnect gets its 410
            for n, frame in events:
                yield prefix + f"id: {buffer.request_id}:{n}\n".encode() + frame
                prefix, after = b"", n
                if pinned:
                    buffer.pin(n + 1)
            if events:
                continue
            if buffer.finished_at is not None:
                return
            if not await buffer.wait(keepalive_s):
                yield KEEP_ALIVE_COMMENT
    finally:
        if pinned:
            buffer.pin(None)


def _last_seen(buffer: ReplayBuffer) -> int:
    """The n of the Last-Event-ID header (or `last_event_id` query); -1 without one."""
    value = request.headers.get("Last-Event-ID") or request.args.get("last_event_id")
    if value is None:
        value = f"{buffer.request_id}:-1"  # from the start
        rid, n = buffer.request_id, "-1"
    else:
        rid, _, n = value.rpartition(":")
    if rid != buffer.request_id or not (n.isdigit() or n == "-1"):
        raise APIError(400, f"Last-Event-ID must be '{buffer.request_id}:<n>'; got {value!r}",
                       param="Last-Event-ID", code="bad_last_event_id")
    seen = int(n)
    if seen >= buffer.next_n:
        raise APIError(400, f"Last-Event-ID {value!r} is ahead of the stream ({buffer.next_n} events so far)",
                       param="Last-Event-ID", code="bad_last_event_id")
    if seen + 1 < buffer.first_n:
        raise APIError(410, f"events {seen + 1}..{buffer.first_n - 1} of {buffer.request_id!r} are no longer "
                            "kept (--resumable-max-bytes)", code="replay_window_lost")
    return seen


@blueprint.get("/v1/stream/<request_id>")
async def resume(request_id: str) -> Response:
    state = state_of(current_app)
    buffer = state.resumable.get(request_id)
    return sse_response(_follow(buffer, _last_seen(buffer), state.config.sse_keepalive_s), request_id)


@blueprint.get("/v1/stream/<request_id>/poll")
async def poll(request_id: str) -> Response:
    state = state_of(current_app)
    buffer = state.resumable.get(request_id)
    seen = _last_seen(buffer)
    try:
        wait_ms = min(int(request.args.get("wait_ms", 5000)), MAX_POLL_WAIT_MS)
    except ValueError:
        raise APIError(400, "wait_ms must be an integer", param="wait_ms") from None
    if not buffer.after(seen) and buffer.finished_at is None and wait_ms > 0:
        await buffer.wait(wait_ms / 1000)
    events = [_as_json(request_id, n, frame) for n, frame in buffer.after(seen)]
    last = events[-1]["id"] if events else (f"{request_id}:{seen}" if seen >= 0 else None)
    return json_response({"request_id": request_id, "events": events, "last_event_id": last,
                          "finished": buffer.finished_at is not None and not buffer.after(seen + len(events))})


def _as_json(request_id: str, n: int, frame: bytes) -> dict:
    kind, data = None, None
    for line in frame.decode("utf-8").splitlines():
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            payload = line[len("data: "):]
            data = payload if payload == "[DONE]" else json.loads(payload)
    return {"id": f"{request_id}:{n}", "event": kind, "data": data}
