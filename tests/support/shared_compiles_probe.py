"""`shared_compiles.SharedCompiles` on the real `jax.distributed` key-value store, run by
tests/system/test_multihost.py in a subprocess (`jax.distributed.initialize` must come before any
other jax call, which the pytest process has long made).

A group of one process plays both roles on its one store: a leader instance (process id 0:
compiles, publishes, bumps the heartbeat) and a follower instance (process id 1: waits,
checks the digest, loads). Each case prints one JSON object on the last stdout line, or
exits as a follower does (`multihost.FOLLOWER_EXIT_CODE`) and says why in its log.

    python tests/support/shared_compiles_probe.py PORT roundtrip CACHE  # a slow leader's executable, loaded and
                                                            # run; then one the leader read from CACHE
    python tests/support/shared_compiles_probe.py PORT mismatch CACHE   # a different program under the same name
    python tests/support/shared_compiles_probe.py PORT hung CACHE       # no leader heartbeat: exit, bounded
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ferrox_jax import shared_compiles  # noqa: E402

TIMEOUT_S = 1.0  # the follower's --multihost-timeout-s
LEADER_DELAY_S = 3.0  # the leader "compiles" for 3 timeouts: slow but alive is no failure


def main(port: str, case: str, cache_dir: str) -> None:
    logging.basicConfig(level=logging.INFO)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=1, process_id=0)
    from jax._src import distributed

    client = distributed.global_state.client
    follower = shared_compiles.SharedCompiles(client, process_id=1, timeout_s=TIMEOUT_S)
    x = jnp.arange(8, dtype=jnp.float32)

    def step(v):  # fusions of their own (concatenate, broadcast): what a re-serialized cache read loses
        z = jnp.concatenate([v, v * 2 + 1])
        return z.sum() + jnp.broadcast_to(v[:1], (4, 8)).sum()

    lowered = jax.jit(step).lower(x)
    if case == "hung":  # no leader instance: nobody compiles, nothing beats; exits here
        follower.compile("step", lowered)
        return
    leader = shared_compiles.SharedCompiles(client, process_id=0, timeout_s=TIMEOUT_S)
    if case == "mismatch":
        leader.compile("step", jax.jit(lambda v: (v * 3).sum()).lower(x))
        follower.compile("step", lowered)
        return
    published: list = []
    timer = threading.Timer(LEADER_DELAY_S, lambda: published.append(leader.compile("step", lowered)))
    t0 = time.monotonic()
    timer.start()
    loaded = follower.compile("step", lowered)
    waited_s = time.monotonic() - t0
    timer.join()
    # The second compile of a name is a key of its own (a cache rebuild's warm-up); a fresh
    # lowering of the same program is a persistent-cache read on the leader.
    jax.clear_caches()  # else the in-memory caches answer before the persistent one is asked
    again = jax.jit(step).lower(x)
    second = leader.compile("step", again), follower.compile("step", again)
    # A third, without clearing: JAX hands the cache read back from memory, with no cache-hit
    # event; its payload has no object code, so it is not published either.
    third = leader.compile("step", jax.jit(step).lower(x)), follower.compile("step", jax.jit(step).lower(x))
    print(json.dumps({"waited_s": waited_s, "leader": float(published[0](x)), "follower": float(loaded(x)),
                      "second": [float(c(x)) for c in second], "third": [float(c(x)) for c in third],
                      "second_bytes": len(client.key_value_try_get_bytes(shared_compiles.COMPILES_PREFIX + "step#1")),
                      "third_bytes": len(client.key_value_try_get_bytes(shared_compiles.COMPILES_PREFIX + "step#2")),
                      "keys": sorted(k for k, _ in client.key_value_dir_get_bytes(shared_compiles.COMPILES_PREFIX))}),
          flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
