"""The runner's half of the host KV tier: blocks and snapshots moved between the device cache and host memory.

The scheduler's half (`ferrox_jax/kv_offload.py`, `HostTier`) decides what moves; a step
carries it and `ModelRunner` runs it through this module, in the order the step needs:

    kv_saves       device block -> host slot, every one fetched (`gather_blocks`, one
                   `jax.device_get` per `OFFLOAD_BATCH`) before any restore is written
    kv_restores    host slot -> fresh device block (`scatter_blocks`, donated)
    state copies   in their order (`ferrox_jax/state_pool.py`): runs of device slot copies
                   (the runner's `copy_blocks`), snapshot saves (device snapshot slot -> host
                   state slot, `gather_states`) and snapshot restores (host state slot ->
                   a row's running slot, `scatter_states`); a host slot is written -1 - h
                   in the pairs (`state_pool.host_id`), so `state_runs` cuts the list where
                   the kind changes and every copy still runs after the ones before it

Each executable is compiled at warm-up when the tier is on (`keys`): four with snapshots,
two without; their shapes are fixed (`OFFLOAD_BATCH` block ids padded with the null block,
`STATE_BATCH` snapshot slots), so moving more costs calls, never compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ferrox_jax.kv_cache import gather_blocks, gather_states, scatter_blocks, scatter_states
from ferrox_jax.kv_offload import HostKVPool, HostStatePool

OFFLOAD_BATCH = 8  # host-tier block saves / restores are padded to this many blocks (0: the null block)
# ... snapshot saves / restores go one slot per call: a slot is every DeltaNet layer's state (50 MiB at
# Qwen3.5's default size), so padding would move the null slot's bytes too; they come one at a time
STATE_BATCH = 1
SAVE_KEY, RESTORE_KEY = ("offload_save",), ("offload_restore",)  # compiled only with a host tier
STATE_SAVE_KEY, STATE_RESTORE_KEY = ("offload_state_save",), ("offload_state_restore",)  # ... with snapshots


def state_runs(copies: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Ordered state copies (i32[C, 2]) cut into runs of one kind: "device" (slot -> slot),
    "save" (slot -> host slot -1 - dst) and "restore" (host slot -1 - src -> slot)."""
    runs: list[tuple[str, np.ndarray]] = []
    for pair in np.asarray(copies, np.int32).reshape(-1, 2):
        kind = "save" if pair[1] < 0 else "restore" if pair[0] < 0 else "device"
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, np.vstack([runs[-1][1], pair[None]]))
        else:
            runs.append((kind, pair[None]))
    return runs


def _padded_ids(ids: np.ndarray, width: int = OFFLOAD_BATCH) -> np.ndarray:
    padded = np.zeros(width, np.int32)
    padded[:len(ids)] = ids
    return padded


class HostCopies:
    """The host memory of a runner's tier (`HostKVPool`, and a `HostStatePool` for a model
    with recurrent layers) and the moves between it and the device cache."""

    def __init__(self, blocks: HostKVPool, states: HostStatePool | None = None) -> None:
        self.blocks = blocks
        self.states = states

    @property
    def keys(self) -> list[tuple]:
        """Its executables' compile keys (warm-up compiles them all)."""
        return [SAVE_KEY, RESTORE_KEY] + ([STATE_SAVE_KEY, STATE_RESTORE_KEY] if self.states is not None else [])

    def lower(self, key: tuple, kv_cache) -> jax.stages.Lowered:
        ids, state_ids = jnp.zeros(OFFLOAD_BATCH, jnp.int32), jnp.zeros(STATE_BATCH, jnp.int32)
        if key == SAVE_KEY:
            return gather_blocks.lower(kv_cache, ids)
        if key == RESTORE_KEY:
            return scatter_blocks.lower(kv_cache, ids, *self.blocks.get(np.zeros(0, np.int64), OFFLOAD_BATCH))
        if key == STATE_SAVE_KEY:
            return gather_states.lower(kv_cache, state_ids)
        conv, recurrent, positions = self.states.get(np.zeros(0, np.int64), STATE_BATCH)
        return scatter_states.lower(kv_cache, state_ids, tuple(conv), tuple(recurrent), positions)

    def move_blocks(self, kv_cache, executable, saves: np.ndarray, restores: np.ndarray):
        """Every save fetched before any restore is written; returns the new cache."""
        for i in range(0, len(saves), OFFLOAD_BATCH):
            part = saves[i:i + OFFLOAD_BATCH]
            k, v = jax.device_get(executable(SAVE_KEY)(kv_cache, _padded_ids(part[:, 0])))  # waits for them
            self.blocks.put(part[:, 1], np.asarray(k)[:, :, :len(part)], np.asarray(v)[:, :, :len(part)])
        for i in range(0, len(restores), OFFLOAD_BATCH):
            part = restores[i:i + OFFLOAD_BATCH]
            k, v = self.blocks.get(part[:, 0], OFFLOAD_BATCH)
            kv_cache = executable(RESTORE_KEY)(kv_cache, _padded_ids(part[:, 1]), k, v)
        return kv_cache

    def move_states(self, kv_cache, executable, kind: str, pairs: np.ndarray):
        """A run of snapshot saves ((slot, -1 - host slot) pairs) or restores ((-1 - host
        slot, slot)); returns the new cache."""
        if self.states is None:
            raise ValueError("this runner's host tier keeps no recurrent-state snapshots")
        for i in range(0, len(pairs), STATE_BATCH):
            part = pairs[i:i + STATE_BATCH]
            if kind == "save":
                conv, recurrent, positions = jax.device_get(
                    executable(STATE_SAVE_KEY)(kv_cache, _padded_ids(part[:, 0], STATE_BATCH)))
                self.states.put(-1 - part[:, 1], [np.asarray(a) for a in conv], [np.asarray(a) for a in recurrent],
                                np.asarray(positions))
            else:
                conv, recurrent, positions = self.states.get(-1 - part[:, 0], STATE_BATCH)
                kv_cache = executable(STATE_RESTORE_KEY)(kv_cache, _padded_ids(part[:, 1], STATE_BATCH), tuple(conv),
                                                         tuple(recurrent), positions)
        return kv_cache
