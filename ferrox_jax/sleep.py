"""Sleep and wake: give the device memory back while nothing runs, and take it again.

The runner's state verbs (`ModelRunner.release` / `restore`, `ferrox_jax/runner_protocol.py`)
are built on `put_to_sleep` / `wake` here. `Engine.sleep` / `wake` send them to the owner
thread as messages run once the scheduler is idle (`ContinuousBatcher.run_when_idle`), so no
step holds the arrays being freed and nobody else touches the runner.

- Level 1 frees the KV cache: every layer's K and V arrays are deleted; their shapes,
  dtypes and shardings are kept. The prefix cache forgets every block (their contents are
  gone), so no later prompt is served stale keys.
- Level 2 also moves the weights to host memory (`jax.device_get`) and deletes them on
  the device, once the host has been checked to have that much memory available
  (`memory_bounds.check_host_room`: refused with `MemoryBoundError`, nothing freed).
- Waking reallocates the same shapes (zeros, with the same shardings) and puts the weights
  back with their shardings: the compiled steps see identical inputs, so nothing
  recompiles (`recompiles_after_warmup` stays 0).

Both are idempotent on the runner: sleeping while asleep keeps the level it sleeps at,
waking while awake does nothing. Callers that must answer what happened
(`api/sleep_routes.py`) serialize their calls and read the level afterwards.

A multi-host group does not sleep: its leader's runner would have to have every follower free
and rebuild its part of the cache in step, which the step channel does not carry; the
facade's check before a sleep refuses it (`SleepRefused`) before anything is freed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ferrox_jax.memory_bounds import check_host_room


class SleepRefused(ValueError):
    """A sleep this engine cannot take (nothing was freed); `code` is the API's error code."""

    def __init__(self, message: str, code: str = "unsupported") -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Asleep:
    """What a sleeping runner keeps to wake up in the same shapes."""

    level: int
    kv_treedef: Any
    kv_specs: list[tuple[tuple[int, ...], Any, Any]]  # (shape, dtype, sharding) per array
    host_state: Any = None  # level 2: the weights, as host arrays
    state_shardings: Any = None


def put_to_sleep(kv_cache: Any, state: Any, level: int) -> Asleep:
    """Frees `kv_cache` (and, at level 2, moves `state`, the weights, to host memory and
    frees them on the device); returns what `wake` needs.

    Raises:
      ValueError: a level other than 1 or 2 (nothing freed).
      MemoryBoundError: level 2 and the host has less memory available than the weights
        (nothing freed).
    """
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2; got {level}")
    leaves, treedef = jax.tree.flatten(kv_cache)
    asleep = Asleep(level, treedef, [(a.shape, a.dtype, a.sharding) for a in leaves])
    if level == 2:
        # Checked here, on the owner thread right before the copy, as well as by the route:
        # the host's memory may have gone while the requests in flight finished.
        check_host_room(sum(leaf.nbytes for leaf in jax.tree.leaves(state)), "moving the weights to host memory")
        state_leaves = jax.tree.leaves(state)
        asleep.state_shardings = jax.tree.map(lambda a: a.sharding, state)
        # Copied: on a CPU backend device_get may hand back views of the buffers deleted next.
        asleep.host_state = jax.tree.map(lambda a: np.array(a, copy=True), jax.device_get(state))
        for leaf in state_leaves:
            leaf.delete()
    for leaf in leaves:
        leaf.delete()
    return asleep


def wake(asleep: Asleep) -> tuple[Any, Any]:
    """(the KV cache, the weights or None at level 1), reallocated in the shapes and
    shardings `put_to_sleep` freed."""
    arrays = [jax.jit(lambda shape=shape, dtype=dtype: jnp.zeros(shape, dtype), out_shardings=sharding)()
              for shape, dtype, sharding in asleep.kv_specs]
    kv_cache = jax.tree.unflatten(asleep.kv_treedef, arrays)
    state = None
    if asleep.host_state is not None:
        state = jax.device_put(asleep.host_state, asleep.state_shardings)
    return kv_cache, state
