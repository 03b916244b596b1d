"""TEST-ONLY fault injection for `ferrox serve` subprocess tests: `FERROX_FAULT_INJECT`.

Never set this in production. It is read in one place, once (`api/cli.py:load_engine`,
after warm-up, before the engine starts), and wraps the engine's runner so that the real
engine, batcher and server meet a fault the way a broken device would present it:

    FERROX_FAULT_INJECT=raise:after=N   every step after the first N raises RuntimeError
    FERROX_FAULT_INJECT=hang:after=N    step N + 1 never returns (the watchdog must act)
    FERROX_FAULT_INJECT=nan:after=N     every row's logits are NaN from step N + 1 on

In-process tests monkeypatch the runner instead (tests/test_engine_faults.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

ENV = "FERROX_FAULT_INJECT"
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


def install_from_env(runner: Any, environ: dict[str, str] | None = None) -> FaultSpec | None:
    """Wraps `runner` per `FERROX_FAULT_INJECT` (absent: nothing is touched)."""
    text = (os.environ if environ is None else environ).get(ENV)
    if not text:
        return None
    spec = FaultSpec.parse(text)
    log.warning("%s=%s: TEST-ONLY fault injection is active", ENV, text)
    _wrap(runner, spec)
    return spec


def _wrap(runner: Any, spec: FaultSpec) -> None:
    forward, sample = runner.forward, runner.sample
    steps = [0]
    never = threading.Event()

    def faulty_forward(batch):
        steps[0] += 1
        if steps[0] > spec.after:
            if spec.kind == "raise":
                raise RuntimeError(f"{ENV}: injected step failure (step {steps[0]})")
            if spec.kind == "hang":
                never.wait()
        return forward(batch)

    def nan_sample(pending, bitmask):
        if steps[0] > spec.after:
            import jax.numpy as jnp

            pending.result = pending.result.replace(logits=jnp.full_like(pending.result.logits, jnp.nan))
        return sample(pending, bitmask)

    runner.forward = faulty_forward
    if spec.kind == "nan":
        runner.sample = nan_sample
