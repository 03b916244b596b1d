"""Start-up's pause of the garbage collector (api/offload.py): `ferrox serve` turns automatic
collections off before its imports and `load_engine` turns them back on once the weights are
placed, freezing start-up's heap until `freeze_heap` collects it before serving.

What must hold: the collector is on again after a load, failed or not; garbage made during
the pause is collected in the end, with `--gc-freeze` and without it (a freeze nobody undoes
would keep it forever: the control); and no pause, no change (a model swap, `run-batch`).
"""

from __future__ import annotations

import gc
import weakref

import pytest

from api import cli, offload
from ferrox_jax.config import EngineConfig


class Node:
    """A cycle's member that only the cyclic collector can free."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def collector():
    """Each test starts and ends with the collector on, nothing frozen, default settings."""
    gc.enable()
    gc.unfreeze()
    yield
    offload.resume_collector(freeze=False)
    offload.configure()
    gc.enable()
    gc.unfreeze()


def garbage_cycle() -> weakref.ref:
    return weakref.ref(Node())


def test_garbage_made_while_paused_survives_the_warm_up_then_freeze_heap_collects_it():
    offload.pause_collector()
    assert not gc.isenabled()
    ref = garbage_cycle()
    offload.resume_collector()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.collect()  # a collection during the warm-up walks only what came after the freeze
    assert ref() is not None, "start-up's heap is frozen until freeze_heap"
    assert offload.freeze_heap() > 0
    assert ref() is None, "freeze_heap unfreezes and collects start-up's garbage before serving"


def test_without_gc_freeze_the_start_ups_freeze_is_undone():
    offload.configure(gc_freeze=False)  # --no-gc-freeze
    offload.pause_collector()
    ref = garbage_cycle()
    offload.resume_collector()
    assert offload.freeze_heap() == 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None
    # The control: a freeze left in place keeps the garbage from every collection.
    ref = garbage_cycle()
    gc.freeze()
    gc.collect()
    assert ref() is not None


def test_resuming_without_a_pause_changes_nothing():
    offload.resume_collector()  # a model swap's load_engine, run-batch's: the collector was never paused
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()  # off by someone else: not ours to turn on
    try:
        offload.pause_collector()
        offload.resume_collector()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_load_turns_the_collector_back_on_unfrozen(tmp_path):
    offload.pause_collector()
    with pytest.raises(FileNotFoundError):
        cli.load_engine(EngineConfig(model=str(tmp_path / "missing.gguf")), url=None)
    assert gc.isenabled(), "a failed load must not leave the process without automatic collections"
    assert gc.get_freeze_count() == 0, "nor frozen: the half-built model must stay collectable"
