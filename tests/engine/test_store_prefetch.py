"""The executable store's prefetch (`ferrox_jax/executable_store.py`): a restart's entries are
read on a thread while the weights load, and the warm-up's `load` takes each from there.

What must hold, on a small jitted function stored under a few keys: each entry is read and
deserialized once (the warm-up does not read it again) and computes what was stored; `load`
waits for an entry the thread has not reached yet; an unusable entry is a miss logged once,
and one whose file name is not its key's is never served for that name (the control: without
that check the thread would hand the other key's program to the warm-up); a first start has
nothing to prefetch; an entry the thread never listed is read by `load` itself; and what no
step asked for is dropped once the warm-up is done (`end_prefetch`). The engine-level path
(`store_for` starts it, a restart traces nothing) is tests/engine/test_executable_store.py's.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import serialize_executable

from ferrox_jax.executable_store import ExecutableStore, entry_name

KEYS = [("forward", n) for n in (1, 2, 3, 4)]
Y = np.arange(16, dtype=np.float32).reshape(4, 4)


def x_for(key: tuple) -> np.ndarray:
    return np.linspace(-1, 1, key[1] * 4, dtype=np.float32).reshape(key[1], 4)


@pytest.fixture
def root(tmp_path):
    """A store folder holding KEYS, each compiled and stored as the warm-up stores a miss."""
    fn = jax.jit(lambda x, y: jnp.tanh(x) @ y - 2)
    writer = ExecutableStore(tmp_path, "fp")
    with writer.fresh_compiles():
        for key in KEYS:
            writer.compile(key, fn.lower(x_for(key), Y))
    assert writer.stored == len(KEYS)
    return tmp_path


@pytest.fixture
def deserialized(monkeypatch) -> list[int]:
    """Counts XLA deserializations (one per entry read, by the thread or by `load`)."""
    calls = []
    real = serialize_executable.deserialize_and_load

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(serialize_executable, "deserialize_and_load", counting)
    return calls


def expected(key: tuple) -> np.ndarray:
    return np.tanh(x_for(key)) @ Y - 2


def test_each_entry_is_read_once_on_the_thread_and_computes_what_was_stored(root, deserialized):
    store = ExecutableStore(root, "fp")
    store.prefetch()
    for key in KEYS[::-1]:  # the warm-up's order need not be the thread's (file names)
        exe = store.load(key)
        np.testing.assert_allclose(exe(x_for(key), Y), expected(key), rtol=1e-6)
    store.end_prefetch()
    assert len(deserialized) == len(KEYS) and store.loaded == len(KEYS), "read once each, by the thread"
    assert store.load(("forward", 9)) is None, "a key never stored is a miss"


def test_load_waits_for_an_entry_the_thread_has_not_reached(root, monkeypatch, deserialized):
    real = ExecutableStore._read
    reached = []

    def slow(self, path, key):
        time.sleep(0.15)
        reached.append(path.name)
        return real(self, path, key)

    monkeypatch.setattr(ExecutableStore, "_read", slow)
    store = ExecutableStore(root, "fp")
    store.prefetch()
    last = max(KEYS, key=entry_name)  # the thread reads it last
    assert store.load(last) is not None
    assert reached == sorted(map(entry_name, KEYS)), "taken from the thread, after the entries before it"
    store.end_prefetch()
    assert len(deserialized) == len(KEYS)


def test_unusable_entries_are_misses_logged_once_and_a_misnamed_one_is_not_served(root, deserialized, caplog):
    folder = ExecutableStore(root, "fp").folder
    corrupt = folder / entry_name(KEYS[0])
    corrupt.write_bytes(corrupt.read_bytes()[:100])
    # A whole, valid entry of KEYS[2] under KEYS[1]'s name: it holds another key.
    (folder / entry_name(KEYS[1])).write_bytes((folder / entry_name(KEYS[2])).read_bytes())
    store = ExecutableStore(root, "fp")
    with caplog.at_level(logging.WARNING, logger="ferrox_jax.executable_store"):
        store.prefetch()
        assert store.load(KEYS[0]) is None and store.load(KEYS[1]) is None
        np.testing.assert_allclose(store.load(KEYS[2])(x_for(KEYS[2]), Y), expected(KEYS[2]), rtol=1e-6)
        store.end_prefetch()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("corrupt" in m for m in messages) == 1 and sum("holds ('forward', 3)" in m for m in messages) == 1
    # Deserialized: KEYS[2] and KEYS[3] (dropped unused); the two refused before XLA saw them.
    assert store.loaded == 1 and len(deserialized) == 2


def test_a_first_start_has_nothing_to_prefetch_and_a_late_entry_is_read_by_load(root, tmp_path_factory):
    cold = ExecutableStore(tmp_path_factory.mktemp("cold"), "fp")
    cold.prefetch()
    assert cold.load(KEYS[0]) is None  # no folder, no thread: a miss, compiled by the warm-up
    cold.end_prefetch()

    store = ExecutableStore(root, "fp")
    late = store.folder / entry_name(KEYS[3])
    held = late.read_bytes()
    late.unlink()
    store.prefetch()
    store._prefetch.join()
    late.write_bytes(held)  # written after the thread listed the folder
    np.testing.assert_allclose(store.load(KEYS[3])(x_for(KEYS[3]), Y), expected(KEYS[3]), rtol=1e-6)


def test_what_no_step_asked_for_is_dropped_after_the_warm_up(root, caplog):
    store = ExecutableStore(root, "fp")
    store.prefetch()
    assert store.load(KEYS[0]) is not None
    with caplog.at_level(logging.INFO, logger="ferrox_jax.executable_store"):
        store.end_prefetch()
    assert not store._prefetched
    assert any("3 entries" in r.getMessage() and "not used" in r.getMessage() for r in caplog.records)
