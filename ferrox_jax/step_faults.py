"""Step faults: what the owner loop counts when a step goes wrong, and the watchdog that
notices a step that never comes back. No jax here.

Kinds (`FAULT_KINDS`, the `kind` label of `ferrox_step_faults_total`):
  exception  the runner raised: the jobs with a row in that step end with an error, the
             loop goes on (`Scheduler.fail_step`).
  nonfinite  a row's logits held NaN or inf (found on the device: one `isfinite`
             reduction per row, fetched with the sampled tokens, never the logits): that
             row's job ends with an error; the step's other rows keep their outputs.
             A row with a LoRA adapter blames its adapter instead of the engine: the
             adapter is quarantined (`AdapterQuarantine`), every row of it in the step
             ends with an error naming it, and such rows never count toward the streak
             below: a tenant's adapter is the adapter's fault, not the engine's.
  timeout    a step ran past `FaultPolicy.step_timeout_s` (`StepWatchdog`, armed only once
             the runner is warm, so start-up compiles never trip it). The owner thread is
             stuck inside the device call and cannot be got back: the engine is dead.
  peer       a process of a multi-host group died or hung (its step channel said so:
             `ferrox_jax/multihost.py`). No step can run any more: the engine is dead. It
             takes the watchdog's path (`StepWatchdog.trip`): during a step, whose
             collective may wait forever on the lost peer, the work ends from the
             channel's thread and the owner is abandoned; between steps the owner ends it.

The engine is *unrecoverable* after a timeout or a lost peer, after `max_consecutive_faults` faulted
steps in a row (a step faults when it raised, or when every row in it was non-finite and
one of them had no adapter; a step with one good row resets the count, so one request
whose rows keep going NaN cannot take the engine down, and a step whose only non-finite
rows were adapters' leaves it as it was), or when the owner loop itself crashed. Then
every open request ends with an error, `health()` reads "dead", and the batcher's fatal
listeners are called once with (kind, reason): `ferrox serve` exits non-zero there
(docs/operations.md).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ferrox_jax.plan import StepPlan

log = logging.getLogger(__name__)

FAULT_KINDS = ("exception", "nonfinite", "timeout", "peer")
DEFAULT_STEP_TIMEOUT_S = 600.0  # a cold compile after warm-up (a new bucket) fits well inside
DEFAULT_MAX_CONSECUTIVE_FAULTS = 3


@dataclasses.dataclass(frozen=True)
class FaultPolicy:
    """When a faulting engine gives up. `step_timeout_s` 0 turns the watchdog off."""

    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    max_consecutive_faults: int = DEFAULT_MAX_CONSECUTIVE_FAULTS

    def __post_init__(self) -> None:
        if not self.step_timeout_s >= 0:
            raise ValueError(f"FaultPolicy.step_timeout_s must be >= 0 (0: no watchdog); got {self.step_timeout_s}")
        if isinstance(self.max_consecutive_faults, bool) or not isinstance(self.max_consecutive_faults, int) \
                or self.max_consecutive_faults < 1:
            raise ValueError(f"FaultPolicy.max_consecutive_faults must be a positive int; got "
                             f"{self.max_consecutive_faults!r}")


class AdapterQuarantine(Protocol):
    """Where a non-finite row's adapter is quarantined (`ferrox_jax/lora_registry.py`)."""

    def quarantine(self, slot: int, reason: str) -> str | None:
        """Quarantine the adapter in `slot`; its name, or None when no adapter holds it."""


@dataclasses.dataclass(frozen=True)
class NonfiniteBlame:
    """Whom a step's non-finite rows are blamed on (`blame_nonfinite`)."""

    # (row ids, the error their jobs end with, its code: "adapter_quarantined" for an
    # adapter's rows, None for the engine's)
    failures: tuple[tuple[tuple[int, ...], str, str | None], ...]
    has_base_rows: bool  # some non-finite row had no adapter: the engine's fault
    reason: str  # for the log and `last_step_fault`
    quarantined: tuple[tuple[int, str], ...] = ()  # (slot, error) of each adapter quarantined

    def step_faulted(self, kept: StepPlan) -> bool | None:
        """`FaultLedger.record`'s `step_faulted` once the failures are taken out of the plan
        (`kept`): a good row left resets the streak; else only a row without an adapter
        counts toward it."""
        if kept.rows:
            return False
        return True if self.has_base_rows else None


def blame_nonfinite(plan: StepPlan, nonfinite_row_ids: tuple[int, ...],
                    adapters: AdapterQuarantine | None) -> NonfiniteBlame:
    """Blames each non-finite row on its LoRA adapter when it has one (the adapter is
    quarantined, and every row of it in the step fails with an error naming it: its
    results came from the same weights; the owner then ends the adapter's other jobs
    too), else on the engine (the model's error, as for a step without adapters)."""
    slot_of = {row.row_id: row.adapter_slot for row in plan.rows}
    what = "non-finite logits (NaN or inf)"
    reason = f"{what} in {len(nonfinite_row_ids)} of the step's {len(plan.rows)} rows"
    failures, blamed, quarantined = [], [], []
    for slot in sorted({slot_of[row_id] for row_id in nonfinite_row_ids if slot_of.get(row_id)}):
        name = adapters.quarantine(slot, f"its weights produced {what}") if adapters is not None else None
        blamed.append(repr(name) if name is not None else f"in slot {slot}")
        error = (f"LoRA adapter {blamed[-1]} produced {what} and is quarantined; unload it and load it "
                 "again with fixed weights")
        failures.append((tuple(row.row_id for row in plan.rows if row.adapter_slot == slot), error,
                         "adapter_quarantined"))
        quarantined.append((slot, error))
    base_row_ids = tuple(row_id for row_id in nonfinite_row_ids if not slot_of.get(row_id))
    if base_row_ids:
        failures.append((base_row_ids, f"the model produced {reason}", None))
    if blamed:
        reason += f"; quarantined LoRA adapter {', '.join(blamed)}"
    return NonfiniteBlame(tuple(failures), bool(base_row_ids), reason, tuple(quarantined))


class Unrecoverable(Exception):
    """Raised inside the owner loop when the fault policy gives up; the loop ends all work."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


class FaultLedger:
    """Fault counters by kind and the last fault's reason; thread-safe (the watchdog
    records timeouts from its own thread, `stats()` reads from any)."""

    def __init__(self, policy: FaultPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._last: str | None = None
        self._consecutive = 0  # owner thread only

    def record(self, kind: str, reason: str, *, step_faulted: bool | None = True) -> None:
        """Counts one fault. Raises Unrecoverable once `step_faulted` steps reach the limit
        in a row (call it on the owner thread, after the good rows were applied).
        `step_faulted` False: the step had good rows (the streak resets); None: its faults
        were blamed on adapters (counted, the streak left as it was)."""
        with self._lock:
            self._counts[kind] += 1
            self._last = f"{kind}: {reason}"
        if step_faulted is None:
            return
        if not step_faulted:
            self._consecutive = 0
            return
        self._consecutive += 1
        if self._consecutive >= self.policy.max_consecutive_faults:
            raise Unrecoverable(kind, f"{self._consecutive} consecutive faulted steps; the last: {reason}")

    def record_fatal(self, kind: str, reason: str) -> None:
        """Counts a fault that ends the engine whatever the streak ("timeout", "peer"); any thread."""
        with self._lock:
            self._counts[kind] += 1
            self._last = f"{kind}: {reason}"

    def ok_step(self) -> None:
        self._consecutive = 0

    def fields(self) -> dict[str, object]:
        """The BatcherStats fields: `step_faults_<kind>` and `last_step_fault`."""
        with self._lock:
            return {**{f"step_faults_{kind}": self._counts[kind] for kind in FAULT_KINDS},
                    "last_step_fault": self._last}


class StepWatchdog:
    """Calls `on_timeout(elapsed_s)` from its own thread when one armed step outlives
    `timeout_s`. `arm()` before the step, `disarm()` after: False means the watchdog took
    over meanwhile (the owner must then touch nothing). `trip()` is the same path for a
    fault from outside the step (a lost multi-host peer): during a step it takes over as a
    timeout would; between steps the next `arm()` refuses."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[float], None]) -> None:
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._cond = threading.Condition()
        self._armed_at: float | None = None  # tracked even when the timeout is off: `trip` reads it
        self._fired = False  # the owner was abandoned in a step (timed out or tripped)
        self._tripped = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def arm(self) -> bool:
        """Before a step. False: tripped already, the step must not start."""
        with self._cond:
            if self._tripped:
                return False
            if self.enabled and self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="ferrox-step-watchdog", daemon=True)
                self._thread.start()
            self._armed_at = time.monotonic()
            self._cond.notify()
            return True

    def disarm(self) -> bool:
        """True: the step came back in time and nothing tripped meanwhile."""
        with self._cond:
            self._armed_at = None
            return not self._fired

    def trip(self) -> bool:
        """A fault from outside any step (any thread). True: a step is running, and the
        owner is abandoned in it (the caller ends the work); False: no step is, and the
        next `arm()` refuses (the owner ends the work)."""
        with self._cond:
            self._tripped = True
            if self._armed_at is None or self._fired:
                return False
            self._fired = True
            self._cond.notify()
            return True

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _watch(self) -> None:
        timed_out = False
        with self._cond:
            while not self._stopped and not self._fired:
                if self._armed_at is None:
                    self._cond.wait()
                    continue
                elapsed_s = time.monotonic() - self._armed_at
                if elapsed_s < self.timeout_s:
                    self._cond.wait(self.timeout_s - elapsed_s)
                    continue
                self._fired = timed_out = True
        if timed_out:
            try:
                self._on_timeout(elapsed_s)
            except Exception:  # the watchdog's one job is to be loud
                log.exception("the step watchdog's handler failed")


class FatalSignal:
    """What made the engine give up, once, and the listeners told of it (any thread: the
    owner on a crash or repeated faults, the watchdog's on a hung step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fatal: tuple[str, str] | None = None  # (kind, reason) once the engine gave up
        self._listeners: list[Callable[[str, str], None]] = []

    def get(self) -> tuple[str, str] | None:
        with self._lock:
            return self._fatal

    def add_listener(self, listener: Callable[[str, str], None]) -> None:
        """`listener(kind, reason)` is called once when the engine gives up; at once when it
        already has."""
        with self._lock:
            fatal = self._fatal
            if fatal is None:
                self._listeners.append(listener)
        if fatal is not None:
            listener(*fatal)

    def set(self, kind: str, reason: str) -> list[Callable[[str, str], None]]:
        """Records the fault; returns the listeners to `tell` (after the open work has ended)."""
        with self._lock:
            self._fatal = (kind, reason)
            listeners, self._listeners = self._listeners, []
        return listeners

    @staticmethod
    def tell(listeners: list[Callable[[str, str], None]], kind: str, reason: str) -> None:
        for listener in listeners:
            try:
                listener(kind, reason)
            except Exception:  # one broken listener must not silence the others
                log.exception("a fatal listener failed")

