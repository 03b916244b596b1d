"""Sleep and wake: give the device memory back while nothing runs, and take it again.

Run on the owner thread while the scheduler is idle (`ContinuousBatcher.run_when_idle`),
so no step holds the arrays being freed.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ferrox_jax.memory_bounds import check_host_room


@dataclasses.dataclass
class _Asleep:
    level: int
    kv_treedef: Any
    kv_specs: list[tuple[tuple[int, ...], Any, Any]]  # (shape, dtype, sharding) per array
    host_state: Any = None  # level 2: the weights, as host arrays
    state_shardings: Any = None


def put_to_sleep(runner: Any, level: int) -> int:
    """Frees the runner's KV cache (and, at level 2, its device weights); returns the level
    it sleeps at (an asleep runner keeps its own).

    Raises:
      MemoryBoundError: level 2 and the host has less memory available than the weights.
    """
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2; got {level}")
    if getattr(runner, "asleep", None) is not None:
        return runner.asleep.level
    leaves, treedef = jax.tree.flatten(runner.kv_cache)
    asleep = _Asleep(level, treedef, [(a.shape, a.dtype, a.sharding) for a in leaves])
    if level == 2:
        # Checked here, on the owner thread right before the copy, as well as by the route:
        # the host's memory may have gone while the requests in flight finished.
        check_host_room(sum(leaf.nbytes for leaf in jax.tree.leaves(runner.state)),
                        "moving the weights to host memory")
        state_leaves = jax.tree.leaves(runner.state)
        asleep.state_shardings = jax.tree.map(lambda a: a.sharding, runner.state)
        # Copied: on a CPU backend device_get may hand back views of the buffers deleted next.
        asleep.host_state = jax.tree.map(lambda a: np.array(a, copy=True), jax.device_get(runner.state))
        for leaf in state_leaves:
            leaf.delete()
        runner.state = None
    for leaf in leaves:
        leaf.delete()
    runner.kv_cache = None
    runner.asleep = asleep
    return level


def wake(runner: Any) -> None:
    """Reallocates what `put_to_sleep` freed, in the same shapes and shardings."""
    asleep = getattr(runner, "asleep", None)
    if asleep is None:
        return
    arrays = [jax.jit(lambda shape=shape, dtype=dtype: jnp.zeros(shape, dtype), out_shardings=sharding)()
              for shape, dtype, sharding in asleep.kv_specs]
    runner.kv_cache = jax.tree.unflatten(asleep.kv_treedef, arrays)
    if asleep.host_state is not None:
        runner.state = jax.device_put(asleep.host_state, asleep.state_shardings)
    runner.asleep = None
