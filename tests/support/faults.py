"""Fault injection for tests: a runner wrapper that faults on cue, installed through the engine
builder's one runner-wrapping hook (`Engine.load(config, wrap_runner=FaultyRunner)`).

The real engine, batcher and server meet a fault the way a broken device presents it:

    fail_next = N        the next N forwards raise RuntimeError("injected step failure")
    before_forward = fn  fn(batch) runs before each forward (a test's hang: it blocks)
    nan_rows = fn        fn(pending) -> the padded rows whose logits turn NaN on the device,
                         between the forward and the sampler

A `ferrox serve` process gets one from `tests/support/fault_serve.py`, with a `FaultSpec` from
`FERROX_FAULT_INJECT` (the tests' variable; the server itself never reads it):

    raise:after=N   every step after the first N raises RuntimeError
    hang:after=N    step N + 1 never returns (the watchdog must act)
    nan:after=N     every row's logits are NaN from step N + 1 on

or, from `FERROX_TEST_DROP_STATE_COPIES=PATH`, a `StateCopyDropper`: while the file PATH exists,
every recurrent-state copy a step carries (`HostBatch.state_copies`: snapshot saves, prefix-hit
restores, n > 1 forks) becomes the null slot's 0 -> 0 no-op on this process. Run on a multi-host
follower it is the group's negative control (tests/system/test_multihost_state.py): the follower
computes its DeltaNet heads from states the copies never reached. The copy calls keep their
number and shape, so the group's processes still launch the same executables.

The wrapper implements the whole `Runner` protocol (`ferrox_jax/runner_protocol.py`); the
`nan` faults need the device runner's pending step (`ModelRunner.forward`'s `DevicePending`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ferrox_jax.runner_protocol import RunnerWrapper

log = logging.getLogger(__name__)

ENV = "FERROX_FAULT_INJECT"
DROP_STATE_COPIES_ENV = "FERROX_TEST_DROP_STATE_COPIES"
KINDS = ("raise", "hang", "nan")


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    kind: str  # one of KINDS
    after: int  # steps that run normally first

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        kind, _, rest = text.partition(":")
        key, _, value = rest.partition("=")
        if kind not in KINDS or key != "after" or not value.isdigit():
            raise ValueError(f"{ENV} must be one of {', '.join(k + ':after=N' for k in KINDS)}; got {text!r}")
        return cls(kind, int(value))


class FaultyRunner(RunnerWrapper):
    """A `Runner` that forwards every verb to `runner`, faulting on cue (module docstring)."""

    def __init__(self, runner: Any, spec: FaultSpec | None = None) -> None:
        super().__init__(runner)
        self.spec = spec
        self.steps = 0  # forwards so far
        self.fail_next = 0
        self.before_forward: Callable[[Any], None] | None = None
        self.nan_rows: Callable[[Any], np.ndarray] | None = None
        self._never = threading.Event()
        if spec is not None:
            log.warning("%s=%s:after=%d: TEST-ONLY fault injection is active", ENV, spec.kind, spec.after)

    def forward(self, batch: Any) -> Any:
        self.steps += 1
        if self.spec is not None and self.steps > self.spec.after:
            if self.spec.kind == "raise":
                raise RuntimeError(f"{ENV}: injected step failure (step {self.steps})")
            if self.spec.kind == "hang":
                self._never.wait()
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("injected step failure")
        if self.before_forward is not None:
            self.before_forward(batch)
        return self.runner.forward(batch)

    def sample(self, pending: Any, bitmask: np.ndarray | None) -> Any:
        rows = None
        if self.spec is not None and self.spec.kind == "nan" and self.steps > self.spec.after:
            rows = np.arange(len(pending.order))
        elif self.nan_rows is not None:
            rows = self.nan_rows(pending)
        if rows is not None and len(rows):
            import jax.numpy as jnp

            pending.result = pending.result.replace(logits=pending.result.logits.at[rows].set(jnp.nan))
        return self.runner.sample(pending, bitmask)



class StateCopyDropper(RunnerWrapper):
    """A `Runner` that runs every step with its recurrent-state copies made no-ops while the
    file `flag` exists (module docstring); `dropped` counts the copies it voided."""

    def __init__(self, runner: Any, flag: Path) -> None:
        super().__init__(runner)
        self.flag = Path(flag)
        self.dropped = 0
        log.warning("%s=%s: TEST-ONLY state copy dropping is armed", DROP_STATE_COPIES_ENV, self.flag)

    def forward(self, batch: Any) -> Any:
        copies = batch.state_copies
        if copies is not None and len(copies) and self.flag.exists():
            self.dropped += len(copies)
            log.warning("TEST-ONLY: dropped %d state copies of this step (%d so far)", len(copies), self.dropped)
            batch = dataclasses.replace(batch, state_copies=np.zeros_like(copies))  # slot 0 -> slot 0
        return self.runner.forward(batch)
