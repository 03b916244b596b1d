"""The leader's runners in a multi-process group: each verb sent to the followers, then run here.

`ferrox_jax/multihost.py` describes the group and its step channel; a follower replays what
these send (`multihost.follow`). Both wrappers implement the `Runner` protocol
(`ferrox_jax/runner_protocol.py`) explicitly: the queries and the warm-up are the wrapped
runner's, `forward` / `sample` send a frame first where the followers need one, and the
state verbs are refused (a group carries no LoRA slots and does not sleep).

    BroadcastRunner   the target's: `B` (the batch) before every forward, `M` (the bitmask)
                      before a sample with constrained rows
    DraftSender       the draft model's proposal steps: `D` (the batch) before the forward;
                      the draft's mirror of a target step needs no frame (each process's
                      draft mirrors the `B` batch it runs)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ferrox_jax.host_batch import HostBatch
from ferrox_jax.multihost import StepChannel
from ferrox_jax.runner_protocol import RunnerWrapper
from ferrox_jax.step_frames import BATCH, DRAFT, MASK

if TYPE_CHECKING:
    from ferrox_jax.runner_protocol import Runner


class _Forwarding(RunnerWrapper):
    """The Runner protocol's queries and between-tick verbs, answered by the wrapped runner;
    what a wrapper adds is in its own `forward` / `sample` (`ferrox_jax/runner_protocol.py`).
    What a group cannot do across processes is refused."""

    def __init__(self, runner: Runner, channel: StepChannel) -> None:
        super().__init__(runner)  # this process's part of every step
        self.channel = channel

    def copy_blocks(self, copies: np.ndarray) -> None:
        raise NotImplementedError("multi-host: block copies travel in a step's batch (`forward`)")

    def swap_state(self, update: Callable[[Any], Any]) -> None:
        raise NotImplementedError("multi-host: the weights are not swapped across processes (no LoRA slots)")

    def release(self, level: int) -> int:
        raise NotImplementedError("multi-host: a group does not sleep")

    def restore(self) -> None:
        raise NotImplementedError("multi-host: a group does not sleep")


class BroadcastRunner(_Forwarding):
    """The leader's runner: sends each step's verbs to the followers, then runs them itself
    (module docstring: `B` before the forward, `M` before a masked sample)."""

    def warmup(self, progress: Callable | None = None, num_threads: int | None = None) -> float:
        """Compiles every shape, then waits until every follower (which compiled the same
        shapes) is connected: no step is served before the whole group can run it."""
        seconds = self.runner.warmup(progress, num_threads)
        self.channel.wait_followers()
        return seconds

    def forward(self, batch: HostBatch) -> Any:
        self.channel.send(BATCH, batch.to_bytes())
        with self.channel.naming_failures():
            return self.runner.forward(batch)

    def sample(self, pending: Any, bitmask: np.ndarray | None) -> Any:
        if bitmask is not None:
            self.channel.send(MASK, np.ascontiguousarray(bitmask, np.int32).tobytes())
        with self.channel.naming_failures():
            return self.runner.sample(pending, bitmask)


class DraftSender(_Forwarding):
    """The leader's draft runner for proposal steps (`ferrox_jax/draft.py`): sends each to
    the followers (a `D` frame: the batch, which carries its block copies), then runs it.
    The draft's mirror of a target step needs no frame: each process's draft mirrors the
    `B` batch it runs. Proposal rows are never constrained (no bitmask)."""

    def forward(self, batch: HostBatch) -> Any:
        if batch.has_constrained_rows:
            raise ValueError("a draft proposal step has no grammar-constrained rows")
        self.channel.send(DRAFT, batch.to_bytes())
        with self.channel.naming_failures():
            return self.runner.forward(batch)

    def sample(self, pending: Any, bitmask: np.ndarray | None) -> Any:
        with self.channel.naming_failures():
            return self.runner.sample(pending, bitmask)
