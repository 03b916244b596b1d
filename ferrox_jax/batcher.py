"""ContinuousBatcher: the owner thread that drives the scheduler and the runner. No jax here.

API handlers call `submit`, `cancel`, `stats` and `health` from any thread; everything else
(jobs, rows, the block budget, the runner and its device arrays) belongs to one owner
thread, so none of it needs a lock. The owner loop, once per iteration:

 1. Drain the inbox (`ferrox_jax/inbox.py`: jobs, cancels, owner calls, stop). When the
    scheduler has no work it blocks on the inbox instead of spinning.
 2. Hand new jobs and cancels to the scheduler; cancels are applied first thing in the tick.
 3. `plan = scheduler.schedule()`: apply cancellations, flush finished rows, admit waiting
    jobs in strict FIFO while the row cap and the block ledger allow, plan one token for
    every decoding row and the prompt chunks the step's token budget allows (round robin;
    an unfinished prompt goes to the back), name the decoding rows that may verify drafts
    (speculation), measure the block peak from the rows.
 4. The step, in the order it happens (`_step`), through the runner's verbs
    (`ferrox_jax/runner_protocol.py`):
      drafts   = proposer.propose(plan)           n-gram lookup, draft model or MTP layer (draft.py, mtp.py)
      plan     = scheduler.add_drafts(plan, drafts)
      batch    = HostBatch.build(plan, geometry)  numpy arrays, nothing live (images encoded first)
      pending  = runner.forward(batch)            dispatched: the device runs
      replies.deliver_held()                      the last tick's events (step 7), while it runs
      draft.mirror(batch)                         the draft's K/V goes where the target's does
      bitmask  = the constrained rows' grammar masks, filled while the device runs
      arrays   = runner.sample(pending, bitmask)  one fetch; then draft.follow: the MTP layer's cache
      out      = step_output(plan, batch, arrays) one RowResult per row, verification included
    If the step raises, the jobs in it end with an error event and free their blocks, the
    traceback is logged, and the loop goes on.
 5. `scheduler.update(plan, out)`: advance progress, check stops, flush finished rows.
 6. Publish a `BatcherStats` snapshot; `stats()` only ever reads published snapshots.
 7. Hand this tick's `RowEvent`s to the jobs' reply channels (`ferrox_jax/replies.py`):
    held for the next step's dispatch while the scheduler has more work, else delivered at
    once (each job's `on_event`, on this thread); a step that fails before its dispatch
    delivers them after it. Publishing first means a client that saw its last event also
    sees it counted.

A crash in the loop itself is loud: the traceback is logged, every open job gets an
error event, `health()` turns "dead" and `submit` raises `AdmissionError("unavailable")`.
Step faults (a raising runner, a row's non-finite logits, a step that hangs past the
watchdog) are counted by kind and the engine gives up on repeated ones
(`ferrox_jax/step_faults.py`), except that a non-finite row with a LoRA adapter blames and
quarantines its adapter (`adapters`, the registry) and never counts toward giving up; a
dead batcher calls its fatal listeners once (`add_fatal_listener`), which is how
`ferrox serve` knows to exit non-zero.

Admission refusals happen in `submit`, on the caller's thread, before anything is queued:
context length, then too large (pure checks against immutable limits), then the queue cap,
checked and counted under one lock with the jobs still in the inbox, so racing submitters
never overshoot it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ferrox_jax.config import SchedulerLimits
from ferrox_jax.draft import DraftModel
from ferrox_jax.admission import AdapterSlots
from ferrox_jax.host_batch import HostBatch
from ferrox_jax.images import ImageStage
from ferrox_jax.inbox import AbortJob, AddJob, EventCallback, Fault, Inbox, OwnerCall, Stop
from ferrox_jax.plan import StepOutput, StepPlan
from ferrox_jax.replies import Delivered, Replies
from ferrox_jax.request import AdmissionError, Job, MatcherFactory
from ferrox_jax.runner_protocol import Runner, check_limits
from ferrox_jax.scheduler import Scheduler, check_admission
from ferrox_jax.speculative import NgramProposer
from ferrox_jax.stats import BatcherStats, scheduler_fields, state_pool_fields, window_fields
from ferrox_jax.step_masks import BitmaskFiller, StepMasks
from ferrox_jax.step_output import step_output
from ferrox_jax.step_faults import FatalSignal, FaultLedger, FaultPolicy, StepWatchdog, Unrecoverable, blame_nonfinite

log = logging.getLogger(__name__)

# AdmissionError.reason -> the BatcherStats field that counts it ("unsupported": none).
_REFUSAL_FIELDS = {"context_length": "kv_rejected_context_length", "too_large": "kv_rejected_too_large",
                   "queue_full": "queue_rejected"}


class _Abandoned(Exception):
    """The watchdog took over while the owner was in a step: the owner touches nothing more."""


class ContinuousBatcher:
    """Continuous batching over one runner; see the module docstring for the loop."""

    def __init__(self, runner: Runner, tokenizer: Any, limits: SchedulerLimits,
                 new_matcher: MatcherFactory | None = None, fill_bitmask: BitmaskFiller | None = None,
                 faults: FaultPolicy | None = None, adapters: AdapterSlots | None = None,
                 draft: DraftModel | None = None) -> None:
        """`new_matcher` and `fill_bitmask` come from the engine's grammar compiler
        (`GrammarCompiler.new_matcher` / `.fill_bitmask`); without them constrained jobs
        are refused at submit. `faults`: the step watchdog and the consecutive-fault limit.
        `adapters`: the LoRA registry: the scheduler holds a job's adapter slot from its
        admission to its end, and an adapter whose row went non-finite is quarantined.
        `draft`: `--speculative draft`'s model or `mtp`'s layer (ferrox_jax/mtp.py): follows each step, proposes."""
        check_limits(limits, runner, has_draft=draft is not None)
        if draft is not None:
            draft.check_compatible(runner)
        self.limits = limits
        self._runner = runner
        self._draft = draft
        self._max_queue = limits.max_queue
        self._scheduler = Scheduler(self.limits, tokenizer, new_matcher=new_matcher, adapters=adapters)
        spec = limits.speculative
        # Who answers a plan's draft requests: the draft model or MTP layer, or prompt lookup on the host.
        self._proposer = None if spec is None else draft if spec.method in ("draft", "mtp") else NgramProposer(spec)
        self._has_grammar = new_matcher is not None and fill_bitmask is not None
        self._masks = StepMasks(fill_bitmask, runner.geometry.vocab_size) if self._has_grammar else None
        self._images = ImageStage(runner.encode_images)  # the encoder cache (a model taking images)
        self._inbox = Inbox()
        self._idle_calls: list[OwnerCall] = []  # owner thread: run_when_idle calls still waiting
        self._thread: threading.Thread | None = None
        # Guarded by _lock (shared with submitters):
        self._lock = threading.Lock()
        self._health = "stopped"
        self._num_in_inbox = 0  # submitted jobs the owner has not taken yet
        self._num_waiting = 0  # the scheduler's waiting queue, as last published
        self._open_job_ids: set[str] = set()
        self._refusals: collections.Counter[str] = collections.Counter()
        self._faults = FaultLedger(faults or FaultPolicy())
        self._adapters = adapters
        self._watchdog = StepWatchdog(self._faults.policy.step_timeout_s, self._on_step_timeout)
        self._lost: tuple[str, str] | None = None  # (kind, reason) of a lost peer (`lose_peer`)
        self._fatal = FatalSignal()
        self._snapshot = BatcherStats(kv_blocks_total=self.limits.num_blocks, kv_blocks_free=self.limits.num_blocks,
                                      kv_block_size=self.limits.block_size, **window_fields(self._scheduler.blocks),
                                      **state_pool_fields(self._scheduler),
                                      kv_offload_blocks_total=self.limits.kv_offload_blocks)
        # Owner thread only:
        self._replies = Replies()  # each open job's on_event, and the events held for the next dispatch
        self._ticks = 0
        self._host_s = 0.0
        self._device_s = 0.0

    # -- the public API (any thread) ---------------------------------------------------

    def start(self) -> None:
        """Starts the owner thread."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("ContinuousBatcher.start() called twice")
            self._health = "ready"
            self._thread = threading.Thread(target=self._run, name="ferrox-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job, on_event: EventCallback) -> None:
        """Queues a job; `on_event` is then called from the owner thread for each RowEvent.

        Raises:
            AdmissionError: refused ("context_length", "unsupported", "too_large", "adapter_not_found" /
                "adapter_quarantined", "queue_full", "unavailable", checked in that order);
                nothing is held for it.
            ValueError: the request id is already open, or it has an output constraint and
                this batcher no grammar compiler.
        """
        if job.grammar is not None and not self._has_grammar:
            raise ValueError(f"job {job.request_id!r} has an output constraint but this batcher "
                             "has no grammar compiler")
        refusal = check_admission(job, self.limits)
        adapter_refusal = self._scheduler.adapter_refusal(job) if refusal is None else None
        with self._lock:
            if refusal is not None:
                reason, message = refusal
                self._refusals.update([_REFUSAL_FIELDS[reason]] if reason in _REFUSAL_FIELDS else [])
                raise AdmissionError(reason, message)
            if adapter_refusal is not None:  # checked again at admission: it may change meanwhile
                raise AdmissionError(*adapter_refusal)
            depth = self._num_in_inbox + self._num_waiting
            if depth >= self._max_queue:
                self._refusals["queue_rejected"] += 1
                raise AdmissionError("queue_full", f"waiting queue is full: {depth} jobs waiting, "
                                                   f"cap {self._max_queue}")
            if self._health != "ready":
                raise AdmissionError("unavailable", f"the batcher is {self._health}")
            if job.request_id in self._open_job_ids:
                raise ValueError(f"request id {job.request_id!r} is already open")
            self._num_in_inbox += 1
            self._open_job_ids.add(job.request_id)
            self._inbox.put(AddJob(job, on_event))

    def cancel(self, request_id: str) -> bool:
        """Cancels a job. Thread-safe; harmless twice or after it finished.

        Returns:
            True if the job was open (submitted and not yet finished).
        """
        with self._lock:
            is_open = request_id in self._open_job_ids
            if self._health == "ready":
                # Sent even when unknown: its submit may still be on the way.
                self._inbox.put(AbortJob(request_id))
        return is_open

    def stats(self) -> BatcherStats:
        """The latest snapshot published by the owner, with the submit-side refusal
        counters (kept under the admission lock, so they are current too)."""
        with self._lock:
            return dataclasses.replace(self._snapshot, **self._refusals, **self._faults.fields())

    def health(self) -> str:
        """"ready", "dead" (the loop crashed) or "stopped" (not started, or shut down)."""
        with self._lock:
            return self._health

    def fatal(self) -> tuple[str, str] | None:
        """(kind, reason) of what made the engine give up, or None while it has not."""
        return self._fatal.get()

    def add_fatal_listener(self, listener: Callable[[str, str], None]) -> None:
        """`listener(kind, reason)` is called once when the engine gives up (from the owner
        or the watchdog thread); at once when it already has. kind: "exception",
        "nonfinite" (repeated faulted steps), "timeout" (a hung step) or "loop" (a crash)."""
        self._fatal.add_listener(listener)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the loop; open requests end with an error event."""
        with self._lock:
            if self._health == "ready":
                self._health = "stopped"
            self._inbox.put(Stop())
        self._watchdog.stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the owner loop ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            is_idle = True
            while True:
                messages = self._inbox.drain(block=is_idle)  # step 1
                if not self._take_messages(messages):  # step 2 (a Fault raises Unrecoverable)
                    self._end_all("stopped", "the batcher was shut down")
                    return
                self._run_idle_calls()
                did_work = self._scheduler.has_work and self._tick()
                is_idle = not did_work
        except _Abandoned:  # the watchdog ended everything; this thread was stuck in a step
            log.error("a step that outlived the watchdog came back; the batcher stays dead")
        except Unrecoverable as fault:
            log.error("the engine gives up: %s", fault.reason)
            self._die(fault.kind, f"the engine is unrecoverable: {fault.reason}")
        except Exception as exc:  # the one catch-all: a dead loop must be loud, not silent
            log.exception("batcher owner loop crashed")
            self._die("loop", f"the batcher loop crashed ({exc}); the server log has the traceback")

    def _die(self, kind: str, reason: str) -> None:
        """Ends every open job with `reason`, turns health "dead", tells the listeners."""
        listeners = self._fatal.set(kind, reason)
        self._end_all("dead", reason)
        FatalSignal.tell(listeners, kind, reason)

    def _on_step_timeout(self, elapsed_s: float) -> None:
        """The watchdog's thread: the owner is stuck in a step (and will touch nothing if it
        ever comes back: `disarm` tells it so), so this thread ends the work."""
        reason = (f"a step ran {elapsed_s:.1f} s, past the step timeout of {self._watchdog.timeout_s:g} s "
                  "(the device is hung or gone)")
        log.error("step watchdog: %s", reason)
        self._faults.record_fatal("timeout", reason)
        self._die("timeout", f"the engine is unrecoverable: {reason}")

    def lose_peer(self, reason: str) -> None:
        """A process of the multi-host group died or hung (the step channel's thread): one
        more fault the engine cannot survive, on the watchdog's path. During a step (its
        collective may wait forever on the lost peer) this thread ends the work and the
        owner, if it ever comes back, touches nothing; otherwise the owner ends it."""
        reason = f"multi-host group failed: {reason}"
        self._faults.record_fatal("peer", reason)
        self._lost = ("peer", reason)  # before the trip: an owner the trip refuses reads it
        if self._watchdog.trip():
            self._die("peer", f"the engine is unrecoverable: {reason}")
        else:
            self._inbox.put(Fault("peer", reason))  # wakes an idle owner; a busy one meets `arm`

    def _take_messages(self, messages: list[Any]) -> bool:
        """Hands messages to the scheduler; False on a stop message."""
        keep_running = True
        num_added = 0
        for message in messages:
            if isinstance(message, AddJob):
                self._replies.open(message.job, message.on_event)
                self._scheduler.add_job(message.job)
                num_added += 1
            elif isinstance(message, AbortJob):
                self._scheduler.cancel(message.request_id)
            elif isinstance(message, OwnerCall) and message.when_idle:
                self._idle_calls.append(message)
            elif isinstance(message, OwnerCall):
                message.run()
            elif isinstance(message, Fault):
                raise Unrecoverable(message.kind, message.reason)
            else:
                keep_running = False
        with self._lock:
            self._num_in_inbox -= num_added
            self._num_waiting = self._scheduler.num_waiting
        return keep_running

    def run_when_idle(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs `fn` on the owner thread as soon as no job is waiting or running (the caller
        stops submitting first); the future carries its result or exception."""
        return self._call(fn, when_idle=True)

    def run_between_ticks(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs `fn` on the owner thread before its next tick (a device-state change: the
        tick before it ran wholly on the old state, the one after runs wholly on the new);
        the future carries its result or exception."""
        return self._call(fn, when_idle=False)

    def _call(self, fn: Callable[[], Any], *, when_idle: bool) -> concurrent.futures.Future:
        with self._lock:  # under the health lock: a call the owner will never take fails at once
            is_started, health = self._thread is not None, self._health
            if is_started and health == "ready":
                return self._inbox.call(fn, when_idle=when_idle)
        if not is_started:  # no owner thread yet: the caller's thread is the only one here
            return self._inbox.run_now(fn)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(RuntimeError(f"the engine is {health}"))
        return future

    def warmup(self, progress: Callable[[int, int, tuple], None] | None = None) -> float:
        """Before `start`: compiles every executable of the runner (`progress` follows it; a
        multi-host leader's then waits for its followers), then of the draft model's runner;
        returns seconds taken. The target's first: in a multi-host group its executables
        are shared (compiled by the leader, loaded by the followers), and XLA's CPU client
        cannot load one once it compiled the same functions itself (the draft may be the
        same model)."""
        return self._runner.warmup(progress) + (self._draft.warmup() if self._draft is not None else 0.0)

    def sleep(self, level: int) -> concurrent.futures.Future:
        """Once idle, on the owner thread: the prefix cache forgets every block and the
        runner releases its KV cache (level 2: its weights too); the future carries the
        level it sleeps at (`ferrox_jax/sleep.py`)."""

        def go() -> int:
            if not self._runner.sleep_level:  # its contents are about to go
                self._scheduler.budget.forget_cached_blocks()
            return self._runner.release(level)

        return self.run_when_idle(go)

    def wake(self) -> concurrent.futures.Future:
        """Once idle, on the owner thread: the runner takes back what `sleep` released."""
        return self.run_when_idle(self._runner.restore)

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level the runner sleeps at (any thread: one read)."""
        return self._runner.sleep_level

    def _run_idle_calls(self) -> None:
        if not self._idle_calls or self._scheduler.has_work:
            return
        calls, self._idle_calls = self._idle_calls, []
        for call in calls:
            call.run()

    def _tick(self) -> bool:
        """Steps 3-7. Returns False when there was nothing to do (the loop may block)."""
        start_s = time.perf_counter()
        plan = self._scheduler.schedule()
        with self._lock:  # admission freed queue slots: make them usable during the step
            self._num_waiting = self._scheduler.num_waiting
        device_s = 0.0
        if not plan.is_empty:
            device_s = self._run_step(plan)  # delivers the held events once its forward is dispatched
            self._ticks += 1
        self._settle(self._replies.deliver_held())  # no step ran, or it failed before its dispatch
        self._device_s += device_s
        self._host_s += time.perf_counter() - start_s - device_s
        # Published before delivery, so a client that saw its last event sees its counts.
        self._publish()
        events = self._scheduler.take_events()
        if self._scheduler.has_work:  # delivered while the next step's device work runs
            self._replies.hold(events)
        else:
            self._settle(self._replies.deliver(events))
        return not plan.is_empty or bool(events)

    def _run_step(self, plan: StepPlan) -> float:
        """Steps 4-5; returns the device seconds (the runner's call, grammar masks included).

        Raises:
          _Abandoned: the watchdog fired while the step ran (it ended everything).
          Unrecoverable: the fault policy gives up (too many faulted steps in a row).
        """
        if self._runner.is_warm and not self._watchdog.arm():  # warm-up's compiles never trip the watchdog
            raise Unrecoverable(*self._lost)  # tripped between steps (`lose_peer`)
        try:
            plan, out = self._step(plan)
            self._scheduler.check_output(plan, out)
        except Exception as exc:  # a failed step fails its jobs, not the server
            if not self._watchdog.disarm():
                raise _Abandoned() from exc
            log.exception("runner failed on a step with %d chunks and %d decode rows",
                          len(plan.chunks), len(plan.decode))
            reason = f"the model runner failed ({exc}); the server log has the traceback"
            self._scheduler.fail_step(plan, reason)
            self._faults.record("exception", reason)
            return 0.0
        if not self._watchdog.disarm():
            raise _Abandoned()
        if out.nonfinite_row_ids:  # an adapter's rows blame it (quarantined), the others the engine
            blame = blame_nonfinite(plan, out.nonfinite_row_ids, self._adapters)
            log.error("%s; their requests end with an error", blame.reason)
            kept = plan
            for row_ids, error, code in blame.failures:
                kept = self._scheduler.fail_rows(kept, row_ids, error, code)
            for slot, error in blame.quarantined:  # its jobs outside this step end too
                self._scheduler.fail_adapter_jobs(slot, error, "adapter_quarantined")
            self._scheduler.update(kept, out)
            self._faults.record("nonfinite", blame.reason, step_faulted=blame.step_faulted(kept))
        else:
            self._scheduler.update(plan, out)
            self._faults.ok_step()
        return out.device_s

    def _step(self, plan: StepPlan) -> tuple[StepPlan, StepOutput]:
        """Step 4, in the order it happens; returns the plan as run (its drafts added) and
        its output."""
        if plan.draft_requests:  # host n-gram lookup, or the draft model's proposal steps
            plan = self._scheduler.add_drafts(plan, self._proposer.propose(plan))
        plan = self._images.attach(plan)  # the chunks' new images encoded (or found in the encoder cache)
        batch = HostBatch.build(plan, self._runner.geometry)
        start_s = time.perf_counter()
        pending = self._runner.forward(batch)  # dispatched: the device runs
        self._settle(self._replies.deliver_held())  # the last tick's events: the loop's work runs beside the device
        if self._draft is not None:
            self._draft.mirror(batch)  # the draft's K/V goes where the target's does
        bitmask = self._masks.fill(pending, self._scheduler.matcher) if batch.has_constrained_rows else None
        arrays = self._runner.sample(pending, bitmask)  # one fetch
        if self._draft is not None:  # the MTP layer's cache over the step's tokens, its hidden states kept
            self._draft.follow(plan, batch, pending, arrays)
        return plan, step_output(plan, batch, arrays, device_s=time.perf_counter() - start_s)

    def _settle(self, delivered: Delivered) -> None:
        """After a delivery: a job whose reply channel broke is cancelled, closed ones forgotten."""
        for request_id in delivered.broken:
            self._scheduler.cancel(request_id)
        if delivered.closed:
            with self._lock:
                self._open_job_ids.difference_update(delivered.closed)

    def _publish(self) -> None:
        recompiles = self._runner.recompiles_after_warmup + (
            self._draft.recompiles_after_warmup if self._draft is not None else 0)
        snapshot = BatcherStats(**scheduler_fields(self._scheduler), kv_block_size=self.limits.block_size,
                                recompiles_after_warmup=recompiles, ticks=self._ticks, host_s=self._host_s,
                                device_s=self._device_s, max_loras=self._runner.max_loras, **self._images.counters,
                                **(self._masks.counters if self._masks is not None else {}))
        with self._lock:
            self._snapshot = snapshot
            self._num_waiting = self._scheduler.num_waiting

    def _end_all(self, health: str, error: str) -> None:
        """Ends every open job with an error event; nothing is accepted afterwards.

        Works from the owner's own records, not the scheduler's, which may be what broke.
        """
        with self._lock:
            if self._health != "dead":
                self._health = health
            self._num_in_inbox = 0
            self._num_waiting = 0
        # The health change above stops new submits and calls, so this drain sees the last of them.
        calls, self._idle_calls = self._idle_calls, []
        for message in self._inbox.drain(block=False):
            if isinstance(message, AddJob):
                self._replies.open(message.job, message.on_event)
            elif isinstance(message, OwnerCall):
                calls.append(message)
        for call in calls:  # never to run: their callers learn why
            call.future.set_exception(RuntimeError(error))
        self._replies.end_all(error)  # the held events first: what the rows said before the end
        with self._lock:
            self._open_job_ids.clear()
