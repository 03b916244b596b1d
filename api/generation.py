"""The generation core every wire protocol shares: one API request in, a stream of row events out.

An adapter (`api/openai_routes.py`, and one module per other protocol) parses its own
request shape, builds one `Job` per prompt (each with `n` rows) and hands
them to a `GenerationRun`. The run:

 1. submits them through the engine facade (`submit`); an `AdmissionError` becomes an
    `APIError` (400 `context_length_exceeded` / `device_memory_budget_exceeded`, 503
    `queue_full` / `unavailable`) that the adapter's envelope renders;
 2. yields `RowOutput(choice, job, event)` for every `RowEvent` the engine's owner
    thread delivers (hopped onto the handler's loop with `call_soon_threadsafe`), and
    `KEEPALIVE` while a stream is idle, until every row has finished;
 3. ends with an `APIError` instead when the request cannot finish: its LoRA adapter was
    quarantined or unloaded (409 `adapter_quarantined` / 404 `model_not_found`: the engine
    ends the job with that error's code), a row failed (500 `engine_error`), the engine
    stopped (500), the server is draining (503 `draining`), or a whole (non-streamed)
    request outlived `--request-timeout` (504);
 4. on `close()` — whatever ended the handler: the last event, a client disconnect, an
    exception — cancels the jobs still open (their KV blocks return to the budget) and
    records the request: TTFT, inter-token and end-to-end latency, queue time, usage, a
    line in `/admin/stats`'s `recent` ring, and with tracing on its spans (`api/tracing.py`,
    built from these same timestamps).

Choice indices are `job * n + row index`, as OpenAI numbers the choices of a list prompt.
Usage counts every sampled token, a final stop token included (the engine's count), and
the prompt tokens each job took from the prefix cache (`num_cached_tokens`, OpenAI's
`usage.prompt_tokens_details.cached_tokens`), read from the job's first event.

A run is pinned to the engine it was built with (the one whose tokenizer made its prompt):
it submits, cancels and checks health there, so a model swap (`api/model_admin.py`) lets
requests in flight finish on the model they started on.

Adapters drive a run with `start` (submit, and cancel when the connection's task ends)
and then `collect` (a whole reply) or `stream` (frames in their wire format, with the
close-on-disconnect and mid-stream-error rules every protocol shares).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable, Sequence

from quart import g, has_request_context, request

from api.errors import APIError, unavailable
from api.telemetry import RequestRecord
from ferrox_jax.request import AdmissionError, Job, RowEvent

if TYPE_CHECKING:
    from api.state import AppState
    from ferrox_jax.engine import Engine

HEALTH_POLL_S = 5.0  # a whole request's wait re-checks the engine this often


@dataclasses.dataclass(frozen=True)
class RowOutput:
    """One RowEvent, with the choice it belongs to."""

    choice: int  # job * n + event.index
    job: int  # index of the Job in the run
    event: RowEvent


KEEPALIVE = object()  # yielded by `events()` when a stream has been idle for a keep-alive period


def admission_error(e: AdmissionError) -> APIError:
    """The HTTP refusal for an engine refusal (the contract's codes)."""
    if e.reason == "context_length":
        return APIError(400, e.message, param="max_tokens", code="context_length_exceeded")
    if e.reason == "too_large":
        return APIError(400, e.message, param="max_tokens", code="device_memory_budget_exceeded")
    if e.reason == "queue_full":
        return unavailable(e.message, code="queue_full")
    if e.reason in ADAPTER_ERRORS:
        return adapter_error(e.reason, e.message)
    return unavailable(e.message, code="unavailable")


# The engine's adapter refusals (at submit, or at admission as an error event's code) -> (status, code).
ADAPTER_ERRORS = {"adapter_not_found": (404, "model_not_found"), "adapter_quarantined": (409, "adapter_quarantined")}


def adapter_error(reason: str, message: str) -> APIError:
    """The request's `model` named a LoRA adapter the engine refuses: not loaded (404, as an
    unknown model) or quarantined (409, the message says how to clear it)."""
    status, code = ADAPTER_ERRORS[reason]
    return APIError(status, message, param="model", code=code)


def event_error(event: RowEvent) -> APIError:
    """The error a row's failed event ends its request with: its adapter's refusal, or an
    engine error (500)."""
    if event.error_code in ADAPTER_ERRORS:
        return adapter_error(event.error_code, event.error or event.error_code)
    return APIError(500, f"generation failed: {event.error or 'engine error'}", type="server_error",
                    code="engine_error")


class GenerationRun:
    """One API generation request in flight (see the module docstring)."""

    def __init__(self, state: AppState, route: str, api_id: str, jobs: Sequence[Job], *,
                 stream: bool, drop_output: bool = False, engine: Engine | None = None,
                 model: str | None = None) -> None:
        """Args:
          state: the app's shared state (engine, metrics, in-flight table).
          route: recorded in `/admin/stats` (e.g. "/v1/chat/completions").
          api_id: the request id clients see (and cancel by); jobs are named after it.
          jobs: one engine job per prompt; all have the same `n`.
          stream: the response is streamed (keep-alives, no request timeout).
          drop_output: score the prompt only (OpenAI `max_tokens: 0`): every job samples one
            token, which is dropped, and its rows end with "length" and 0 tokens.
          engine: the engine whose tokenizer made the prompts (default: the app's current one);
            the run stays on it even if the app swaps models meanwhile.
          model: the request's `model`; a LoRA adapter's name runs the jobs with it (the
            engine holds its slot while they run).
        """
        self.state = state
        self.engine = engine if engine is not None else state.engine
        self.route = route
        self.api_id = api_id
        self.jobs = tuple(jobs)
        self.n = self.jobs[0].n
        self.stream = stream
        self.drop_output = drop_output
        self.num_prompt_tokens = sum(len(job.prompt_token_ids) for job in self.jobs)
        self.num_output_tokens = [0] * (len(self.jobs) * self.n)  # per choice
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache, summed over jobs
        self.status = 200  # what the request is recorded with
        self.started_at = time.monotonic()
        self.submitted_at = self.started_at
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.inter_token_s: list[float] = []
        self.queue_s = 0.0  # the longest admission wait among its jobs
        self.abort_reason: str | None = None  # set by `abort` (drain): the run ends with a 503
        # The whole-response cache (api/response_cache.py): `seeded` when every job names its
        # seed (an adapter passes the client's, or None for the engine to draw one at submit);
        # `cache_status` is hit, miss or skip once submitted.
        self.seeded = all(job.sampling.seed is not None for job in self.jobs)
        self.cache_status: str | None = None
        self._cache_key: str | None = None
        self._recorded: list[RowOutput] | None = None  # a miss's raw outputs, stored when it ends well
        self._queue: asyncio.Queue[RowOutput] = asyncio.Queue()
        self._num_submitted = 0
        self._rows_open = [self.n] * len(self.jobs)
        self._jobs_seen: set[int] = set()
        self._closed = False
        self.model = model
        self.finish_reasons: list[str | None] = [None] * self.num_choices  # per choice, as its last event said
        # Tracing (api/tracing.py), only when it is on: the caller's trace context and the
        # output constraint's compile (`check_grammar` notes it on the request).
        self.trace_parent = self.grammar_compile_s = None
        if state.tracing is not None and has_request_context():
            self.trace_parent = state.tracing.parent(request.headers)
            self.grammar_compile_s = g.get("ferrox_grammar_compile")

    @property
    def num_submitted(self) -> int:
        """Jobs handed to the engine so far."""
        return self._num_submitted

    @property
    def model_label(self) -> str:
        """The served model's name, the `model_name` label of the vLLM-named histograms."""
        return self.engine.model_name if self.engine is not None else ""

    @property
    def num_choices(self) -> int:
        return len(self.num_output_tokens)

    @property
    def is_finished(self) -> bool:
        return self._num_submitted == len(self.jobs) and not any(self._rows_open)

    # -- submission -------------------------------------------------------------------

    def submit(self) -> None:
        """Submits every job; on a refusal cancels those already in and raises its APIError."""
        self.state.require_engine()  # loading, draining, unloaded: refused before anything is sent
        engine = self.engine
        if engine is None:
            raise unavailable("no model is loaded", code="model_not_loaded")
        loop = asyncio.get_running_loop()
        self.jobs = self._name_adapter(engine)
        if self._answer_from_cache():  # after the adapter is named in the jobs: it is part of the key
            return
        queued = []
        try:
            for index, job in enumerate(self.jobs):
                queued.append(engine.submit(job, self._callback(loop, index)))
                self._num_submitted += 1
        except AdmissionError as e:
            self._cancel_open()
            raise admission_error(e) from None
        except BaseException:
            self._cancel_open()
            raise
        self.jobs = tuple(queued)  # as the engine runs them: each with the seed it samples with
        self.submitted_at = time.monotonic()
        self.state.inflight[self.api_id] = self
        self.state.stats.generating_now += 1

    def _name_adapter(self, engine: Engine) -> tuple[Job, ...]:
        """The jobs, naming the LoRA adapter the request's `model` names (and the version of
        its weights: the response cache's key and the engine's check at admission); the
        engine holds its slot from each job's admission to its end."""
        if self.model is None or self.model == engine.model_name or not engine.max_loras:
            return self.jobs
        try:
            key = engine.resolve_adapter(self.model)
        except AdmissionError as e:
            raise admission_error(e) from None
        return tuple(dataclasses.replace(job, adapter_name=self.model, adapter_key=key) for job in self.jobs)

    def _answer_from_cache(self) -> bool:
        """Looks the run up in the response cache; a hit queues the recorded outputs as the
        engine's would be, and nothing is submitted."""
        cache = self.state.response_cache
        if cache is None:
            return False
        self.cache_status, self._cache_key, recorded = cache.lookup(self)
        if recorded is None:
            self._recorded = [] if self._cache_key is not None else None
            return False
        for output in recorded:
            self._queue.put_nowait(output)
        self._num_submitted = len(self.jobs)
        self.submitted_at = time.monotonic()
        self.state.inflight[self.api_id] = self
        self.state.stats.generating_now += 1
        return True

    def _store_in_cache(self) -> None:
        """A miss that ended well (every row stop or length, nothing aborted) is stored."""
        recorded, self._recorded = self._recorded, None
        if recorded is None or self._cache_key is None or self.abort_reason is not None or not self.is_finished:
            return
        if all(o.event.finish_reason in (None, "stop", "length") for o in recorded):
            self.state.response_cache.store(self._cache_key, recorded)

    def _callback(self, loop: asyncio.AbstractEventLoop, index: int):
        """The event callback of job `index` of this run."""
        queue, n = self._queue, self.n

        def on_event(event: RowEvent) -> None:  # the engine's owner thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, RowOutput(index * n + event.index, index, event))
            except RuntimeError:  # the loop is closed: the server is gone, nobody reads
                pass

        return on_event

    # -- the event stream ---------------------------------------------------------------

    async def events(self) -> AsyncIterator[RowOutput | object]:
        """RowOutputs until every row finished (KEEPALIVE between them when streaming).

        Raises:
          APIError: a row failed, the engine stopped, the server is draining, or (whole
            requests) the request timeout passed; `status` is set to its status.
        """
        timeout_s = self.state.config.request_timeout_s
        deadline = self.started_at + timeout_s
        while not self.is_finished:
            if self.stream:
                wait_s = self.state.config.sse_keepalive_s
            else:
                wait_s = min(HEALTH_POLL_S, deadline - time.monotonic())
                if wait_s <= 0:  # the jobs are cancelled by close()
                    self._fail(APIError(504, f"the request did not finish within {timeout_s:g} s "
                                             "(--request-timeout); it was cancelled", type="server_error",
                                        code="request_timeout"))
            output = await self._next(wait_s)
            if output is None:
                if self.engine is None or self.engine.health() != "ready":
                    self._fail(APIError(500, "the engine stopped while generating", type="server_error",
                                        code="engine_error"))
                if self.stream:
                    yield KEEPALIVE
                continue
            event = output.event
            if event.finish_reason == "error":
                self._fail(event_error(event))
            if event.finish_reason == "cancelled" and self.abort_reason is not None:
                self._fail(unavailable(self.abort_reason, code="draining"))
            yield output
        if self.abort_reason is not None:
            self._fail(unavailable(self.abort_reason, code="draining"))

    def _fail(self, error: APIError) -> None:
        self.status = error.status
        raise error

    async def _next(self, timeout_s: float) -> RowOutput | None:
        """The next output, or None after `timeout_s` with nothing new."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # lands as the inner get completes, and a client disconnect would go unnoticed.
        try:
            async with asyncio.timeout(timeout_s):
                output = await self._queue.get()
        except TimeoutError:
            return None
        if self._recorded is not None:
            self._recorded.append(output)
        return self._observe(output)

    def _observe(self, output: RowOutput) -> RowOutput:
        """Timing, usage and queue-time bookkeeping for one event; applies `drop_output`."""
        event = output.event
        if self.drop_output:
            reason = "length" if event.finish_reason in ("stop", "length") else event.finish_reason
            event = dataclasses.replace(event, token_ids=(), text="", logprobs=None, num_generated_tokens=0,
                                        finish_reason=reason, stop_token=None)
            output = dataclasses.replace(output, event=event)
        now = time.monotonic()
        if event.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.last_token_at is not None:
                # one gap per event, spread over its tokens (a tick may emit several)
                gap = (now - self.last_token_at) / len(event.token_ids)
                self.inter_token_s.extend([gap] * len(event.token_ids))
            self.last_token_at = now
        count = self.num_output_tokens[output.choice] + len(event.token_ids)
        # num_generated_tokens also counts a final stop token, which never appears in
        # token_ids; OpenAI bills it, so usage follows the engine's count.
        self.num_output_tokens[output.choice] = max(count, event.num_generated_tokens)
        if output.job not in self._jobs_seen:  # a job's first event carries its admission wait
            self._jobs_seen.add(output.job)
            self.num_cached_tokens += event.num_cached_tokens
            if event.queue_s is not None:
                self.state.metrics.observe("queue", event.queue_s, self.model_label)
                self.queue_s = max(self.queue_s, event.queue_s)
        if event.finish_reason is not None:
            self._rows_open[output.job] -= 1
            self.finish_reasons[output.choice] = event.finish_reason
        return output

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.num_output_tokens)

    @property
    def prefill_s(self) -> float:
        """Submit to first token, less the wait for admission: the prompt's own time."""
        if self.first_token_at is None:
            return 0.0
        return max(0.0, self.first_token_at - self.submitted_at - self.queue_s)

    @property
    def decode_s(self) -> float:
        """First token to last token."""
        if self.first_token_at is None or self.last_token_at is None:
            return 0.0
        return self.last_token_at - self.first_token_at

    # -- ending -------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Cancel as the server (drain, shutdown), not the client: the run then ends with a
        503 (a final SSE error event, or the whole request's status) instead of a reply."""
        if self.abort_reason is None:
            self.abort_reason = reason
        self._cancel_open()

    def cancel(self) -> None:
        """Cancel as the client (`/v1/cancel`): rows end with finish_reason "cancelled"."""
        self._cancel_open()

    def _cancel_open(self) -> None:
        """Cancels every submitted job that still has open rows; idempotent. Synchronous
        (the engine only enqueues), so a `finally` can call it without a shield; a cancel for
        a finished job is skipped (the engine would remember it as arriving early)."""
        engine = self.engine
        if engine is None or self.cache_status == "hit":  # a hit has no job in the engine
            return
        for job in range(self._num_submitted):
            if self._rows_open[job] > 0:
                engine.cancel(self.jobs[job].request_id)

    def close(self, client_gone: bool = False) -> None:
        """Cancel what is still open and record the request; idempotent.

        `client_gone`: the handler ended because the client went away (recorded as 499
        unless an error status was already set)."""
        if self._closed:
            return
        self._closed = True
        if self.status == 200 and (client_gone or (self._num_submitted and not self.is_finished)):
            self.status = 499  # left before its last event: the client went away
        if self.status == 200:
            self._store_in_cache()
        if self._num_submitted:
            self._cancel_open()
            if self.state.inflight.get(self.api_id) is self:
                del self.state.inflight[self.api_id]
                self.state.stats.generating_now -= 1
        if self.status >= 500 and self.stream:
            self.state.stats.on_error()  # a stream's status line said 200; count its failure here
        self._record()

    def _record(self) -> None:
        now = time.monotonic()
        metrics = self.state.metrics
        ttft = None
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.submitted_at
            metrics.observe("ttft", ttft, self.model_label)
        for gap in self.inter_token_s:
            metrics.observe("itl", gap, self.model_label)
        if self.status == 200 and self._num_submitted:
            metrics.observe("e2e", now - self.submitted_at, self.model_label)
        self.state.stats.record(RequestRecord(
            id=self.api_id, route=self.route, status=self.status, prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_completion_tokens, cached_tokens=self.num_cached_tokens,
            ttft_ms=None if ttft is None else round(ttft * 1e3, 3),
            duration_ms=round((now - self.started_at) * 1e3, 3), stream=self.stream))
        if self.state.tracing is not None:
            self.state.tracing.record(self, now)


def job_ids(api_id: str, num_jobs: int) -> list[str]:
    """Engine request ids for an API request's jobs: the API id itself for one job."""
    return [api_id] if num_jobs == 1 else [f"{api_id}-{j}" for j in range(num_jobs)]


# ---------------------------------------------------------------- driving a run (every adapter)


def start(run: GenerationRun) -> None:
    """Submit the run's jobs and tie its end to the connection's task.

    Belt and braces for a streamed body: if the client leaves after the handler returns but
    before the server starts iterating the body, the generator never runs its `finally`.
    The connection's task ends either way, so its done-callback closes the run."""
    run.submit()
    if run.cache_status is not None and has_request_context():  # the ferrox-cache header (api/app.py)
        g.ferrox_cache = run.cache_status
    asyncio.current_task().add_done_callback(lambda _task: run.close(client_gone=True))


async def collect(run: GenerationRun, fold: Callable[[RowOutput], None]) -> None:
    """Feed every RowOutput to `fold` (a whole reply); raises the run's APIError, if any."""
    try:
        async for output in run.events():
            fold(output)
    except asyncio.CancelledError:
        run.close(client_gone=True)
        raise
    finally:
        run.close()


async def stream(run: GenerationRun, frames: Callable[[RowOutput], Iterable[bytes]], *, keepalive: bytes,
                 end: Callable[[], Iterable[bytes]], error: Callable[[APIError], bytes]) -> AsyncIterator[bytes]:
    """A run's events as wire frames: `frames(output)` per event, `keepalive` while idle,
    `end()` after the last event; a failure mid-stream is one `error(e)` frame, then the end.
    A disconnect (the body generator closed or cancelled) cancels the run's jobs."""
    try:
        async for output in run.events():
            if output is KEEPALIVE:
                yield keepalive
                continue
            for frame in frames(output):
                yield frame
        for frame in end():
            yield frame
    except APIError as e:
        yield error(e)
    except BaseException:
        run.close(client_gone=True)
        raise
    finally:
        run.close()
