"""A prefix hit across the prefix cache's two tiers and the KV groups: which of a prompt's
cached blocks a job can start after. No jax here.

A prompt's chain of block names (`ferrox_jax/prefix_cache.py`) is looked up on the device
first (the longest run of cached names from block 0), then in the host tier where that run
ends (`--kv-offload-gib`, `ferrox_jax/kv_offload.py`). Each group beside the full one may
cut the hit back, never extend it:

    sliding window   the device run is cut to the blocks whose window slots are still
                     there (`ferrox_jax/kv_groups.py`, `WindowPool.usable_hits`); a host
                     block brings every layer's K/V with it, sliding ones included (with
                     the tier on, the sliding arrays hold every block: `window_plan`)
    recurrent state  the whole hit, device and host blocks together, is cut to its last
                     block with a state snapshot, on the device or in the host tier
                     (`ferrox_jax/state_snapshots.py`, `RecurrentGroup.usable_hits`); the
                     row's state is restored from that snapshot, the host's when the
                     device no longer holds it (`Hit.snapshot`)

The host slots a hit reads (blocks and snapshot) are pinned at once, before admission's
budget evicts anything: the evicted blocks' saves must not take them (`unpin` undoes it when
the job is not admitted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class Hit:
    """A job's prefix hit: `blocks` (device, from block 0), then `host_slots` (the host
    tier's, each restored into a fresh block), and the host snapshot slot its row's state
    comes from (None: the device's snapshot, or a model without recurrent layers)."""

    blocks: list[int] = dataclasses.field(default_factory=list)
    host_slots: list[int] = dataclasses.field(default_factory=list)
    snapshot: int | None = None


def usable_device_hits(window, recurrent, hits: list[int], names: Sequence[bytes]) -> list[int]:
    """A device hit cut back to what every group can use: the blocks whose window slots are
    still there (`window`: the sliding pool, None without one), and up to the last block with
    a state snapshot, on the device or in the host tier (`recurrent`: the recurrent group)."""
    if window is not None:
        hits = hits[:window.usable_hits(hits)]
    return hits[:recurrent.usable_hits(hits, names)]


def find_hit(cache, tier, window, recurrent, names: Sequence[bytes]) -> Hit:
    """The hit of a prompt whose looked-up chain is `names` (its blocks wholly before its
    last token), its host slots pinned (module docstring)."""
    if tier is None:
        return Hit(usable_device_hits(window, recurrent, cache.lookup(names), names))
    hits = cache.lookup(names)
    if window is not None:
        hits = hits[:window.usable_hits(hits)]
    host_slots = tier.lookup(names[len(hits):])
    usable = recurrent.usable_hits(hits, names, len(host_slots))
    hits, host_slots = hits[:usable], host_slots[:max(0, usable - len(hits))]
    tier.pin(host_slots)
    snapshot = recurrent.host_snapshot(hits, names, len(host_slots))
    if snapshot is not None:
        tier.pin_snapshot(snapshot)
    return Hit(hits, host_slots, snapshot)


def unpin(tier, hit: Hit) -> None:
    """The job was not admitted: the hit's host slots may be overwritten again."""
    if hit.host_slots:
        tier.unpin(hit.host_slots)
    if hit.snapshot is not None:
        tier.unpin_snapshot(hit.snapshot)
