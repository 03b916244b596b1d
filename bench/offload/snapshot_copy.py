"""What one recurrent-state snapshot costs to copy, at the default Qwen3.5 size: the decode snapshot's move on the device, and the host tier's save and restore.

    .venv/bin/python bench/offload/snapshot_copy.py > bench/offload/snapshot-copy.json

A snapshot is every DeltaNet layer's conv and recurrent state: for `Qwen3_5TextConfig()`'s
defaults (24 DeltaNet layers of its 32, 16 key heads and 32 value heads of 128, conv kernel
4) 24 x (3 x 8,192 + 32 x 128 x 128) f32 = 50.25 MiB. The pool holds, as
`--max-seqs 8` would, the null slot, 8 running slots and 16 snapshot slots (1.23 GiB).
Timed, each the best and the median of ROUNDS runs, blocking until the result is ready:

    device copy     running slot -> snapshot slot, as a row's decode snapshot moves, in the
                    runner's batch of 8 pairs (`COPY_BATCH`: 7 are 0 -> 0 padding):
                    `copy_state_slots` as it is (its loop stops where the padding starts)
                    against the same loop copying every pair (how it was before),
                    the two in alternating order each round (paired), and one pair alone
    host save       `gather_states` of one slot (`STATE_BATCH`) and `jax.device_get`, then
                    the numpy store into the host pool: a snapshot the device drops
    host restore    the host pool's slot scattered into a running slot

Every copy is checked: the destination equals the source afterwards (max |difference| 0).
The load average (1 minute) is recorded before and after: on a shared machine it moves a lot.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import transformers

from ferrox_jax.host_copies import STATE_BATCH
from ferrox_jax.runner import COPY_BATCH
from ferrox_jax.kv_cache import KVCache, copy_state_slots, gather_states, scatter_states
from ferrox_jax.kv_offload import HostStatePool
from models.deltanet import DeltaNetSpec, create_states, state_bytes_per_slot

ROUNDS = int(os.environ.get("SNAPSHOT_ROUNDS", 15))
ROWS, SNAPSHOTS = 8, 16


def specs():
    cfg = transformers.Qwen3_5TextConfig()
    spec = DeltaNetSpec(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                        k_head_dim=cfg.linear_key_head_dim, v_head_dim=cfg.linear_value_head_dim,
                        conv_kernel=cfg.linear_conv_kernel_dim)
    return (spec,) * cfg.layer_types.count("linear_attention")


@jax.jit
def _fill(states):
    """Every slot's state distinct (slot s holds s + its element index / 1e6)."""
    def fill(a):
        return jnp.arange(a.size, dtype=jnp.float32).reshape(a.shape) / 1e6 + jnp.arange(a.shape[0])[
            (...,) + (None,) * (a.ndim - 1)]
    return states.replace(conv=tuple(fill(a) for a in states.conv), recurrent=tuple(fill(a) for a in states.recurrent))


copy = jax.jit(copy_state_slots, donate_argnums=0)


def _copy_every_pair(states, src, dst):
    """`copy_state_slots` before it stopped at the padding (one entry per slot): the baseline."""
    def one(i, st):
        s, d = src[i], dst[i]
        return st.replace(conv=tuple(a.at[d].set(a[s]) for a in st.conv),
                          recurrent=tuple(a.at[d].set(a[s]) for a in st.recurrent))
    return jax.lax.fori_loop(0, src.shape[0], one, states)


copy_every_pair = jax.jit(_copy_every_pair, donate_argnums=0)


def timed(fn, rounds=ROUNDS):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"best_ms": round(1e3 * min(times), 2), "median_ms": round(1e3 * statistics.median(times), 2)}


def main() -> None:
    spec = specs()
    cache = KVCache(k=(), v=(), states=_fill(create_states(spec, 1 + ROWS + SNAPSHOTS)))
    src, dst = 3, 1 + ROWS + 5  # a running slot, a snapshot slot
    pairs = np.zeros((COPY_BATCH, 2), np.int32)
    pairs[0] = src, dst
    one = np.asarray([[src, dst]], np.int32)
    result = {"snapshot_bytes": state_bytes_per_slot(spec), "layers": len(spec), "pool_slots": 1 + ROWS + SNAPSHOTS,
              "load_before": os.getloadavg()[0], "rounds": ROUNDS, "backend": jax.default_backend()}

    def run(fn, p):
        nonlocal cache
        cache = cache.replace(states=fn(cache.states, jnp.asarray(p[:, 0]), jnp.asarray(p[:, 1])))
        jax.block_until_ready(cache.states.recurrent[-1])

    def once(fn, p):
        t0 = time.perf_counter()
        run(fn, p)
        return time.perf_counter() - t0

    for fn in (copy, copy_every_pair):
        run(fn, pairs)  # compile
    paired = {"skipping_padding": [], "copying_every_pair": []}
    for r in range(ROUNDS):  # alternating order
        order = [("skipping_padding", copy), ("copying_every_pair", copy_every_pair)][::1 if r % 2 else -1]
        for name, fn in order:
            paired[name].append(once(fn, pairs))
    for name, times in paired.items():
        result[f"device_copy_batch_of_{COPY_BATCH}_{name}"] = {
            "best_ms": round(1e3 * min(times), 2), "median_ms": round(1e3 * statistics.median(times), 2)}
    run(copy, one)  # compile
    result["device_copy_one_pair"] = timed(lambda: run(copy, one))
    assert float(jnp.abs(cache.states.recurrent[-1][dst] - cache.states.recurrent[-1][src]).max()) == 0
    host = HostStatePool(1, [a.shape[1:] for a in cache.states.conv], [a.shape[1:] for a in cache.states.recurrent], 1)
    ids = np.full(STATE_BATCH, dst, np.int32)

    def save():
        conv, recurrent, positions = jax.device_get(gather_states(cache, ids))
        host.put(np.asarray([0]), conv, recurrent, positions)

    save()  # compile
    result["host_save"] = timed(save)
    back = np.full(STATE_BATCH, 2, np.int32)  # another running slot

    def restore():
        nonlocal cache
        conv, recurrent, positions = host.get(np.asarray([0]), STATE_BATCH)
        cache = cache.replace(states=scatter_states(cache, back, tuple(conv), tuple(recurrent), positions).states)
        jax.block_until_ready(cache.states.recurrent[-1])

    restore()  # compile
    result["host_restore"] = timed(restore)
    assert float(jnp.abs(cache.states.recurrent[-1][2] - cache.states.recurrent[-1][src]).max()) == 0
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
