"""Compiles shared over a multi-host group (`ferrox_jax/multihost.py`): one process
compiles each step shape, every process runs it.

Compiles are shared (`SharedCompiles`, on unless `--no-share-compiles`): every process
must hold the same executables, and each compiling them itself costs the group its
slowest process's warm-up (on one CPU host the processes also compete for the same
cores: 4 processes of the default model took ~60 s a shape each on 2 cores; shared,
the 4-process group was ready in 77 s, docs/deploy-tpu.md). Process 0
compiles each shape, serializes the executable and puts the bytes into the
`jax.distributed` key-value store under the shape's name; the others lower the same
program (cheap: no XLA compile), check that its digest matches, and load the bytes. JAX's
own `jax_share_binary_between_hosts` does not work on a CPU group: it keys by the
persistent-cache key, which differs per process there, so followers wait on keys nobody
sets. A follower waiting for a shape exits non-zero as soon as process 0 stops showing
signs of life (a heartbeat key it bumps every second) for `timeout_s`.

An executable that process 0 read from the persistent compilation cache is not shared: its
serialization comes back incomplete (jax 0.10 on CPU: loaded elsewhere, it fails its first
run with "Function ... not found"), so process 0 publishes an empty executable for it and
the followers compile that shape themselves, from their own caches where they have it. The
same goes for one JAX hands back from memory without an event (a program this process
already ran from its cache: a second engine's warm-up): on CPU a payload without object
code (`executable_store.carries_object_code`) is never published.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from typing import Any

import jax

from ferrox_jax.executable_store import carries_object_code
from ferrox_jax.multihost import DEFAULT_TIMEOUT_S, heartbeat_period, leader_gone

log = logging.getLogger(__name__)

COMPILES_PREFIX = "ferrox/compiled/"  # key-value store names: a shape's executable, the leader's heartbeat

_compile_thread = threading.local()  # is_cache_hit: this thread's last compile was a persistent-cache read
_listening_for_cache_hits: list[bool] = []  # [True] once `_note_cache_hit` is registered


def _note_cache_hit(event: str, **_kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # recorded in the compiling thread
        _compile_thread.is_cache_hit = True


class SharedCompiles:
    """One process compiles, every process runs (module docstring).

    `compile(name, lowered)` on process 0 compiles and publishes; elsewhere it waits for
    process 0's executable of the same name and loads it. Names must come in the same
    order on every process, as the steps do; the n-th compile of a name is its own key,
    so a second engine's warm-up (a cache rebuild) never reads the first one's."""

    def __init__(self, client: Any, process_id: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Args:
          client: the `jax.distributed` client (`jax._src.distributed.global_state.client`).
          process_id: this process's index; 0 compiles.
          timeout_s: a follower gives up when process 0's heartbeat stands still this long.
        """
        self._client = client
        self.is_leader = process_id == 0
        self.process_id = process_id
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # warm-up compiles from a thread pool
        self._counts: dict[str, int] = {}
        if self.is_leader:
            if not _listening_for_cache_hits:  # once a process
                jax.monitoring.register_event_listener(_note_cache_hit)
                _listening_for_cache_hits.append(True)
            threading.Thread(target=self._beat, name="ferrox-compile-heartbeat", daemon=True).start()

    @classmethod
    def for_this_process(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> "SharedCompiles":
        from jax._src import distributed

        if distributed.global_state.client is None:
            raise RuntimeError("SharedCompiles needs jax.distributed.initialize first")
        return cls(distributed.global_state.client, jax.process_index(), timeout_s)

    def _beat(self) -> None:
        for count in itertools.count():
            try:
                self._client.key_value_set(COMPILES_PREFIX + "heartbeat", str(count), allow_overwrite=True)
            except jax.errors.JaxRuntimeError:  # the service is shutting down with the process
                return
            time.sleep(heartbeat_period(self.timeout_s))

    def _key(self, name: str) -> str:
        with self._lock:
            n = self._counts[name] = self._counts.get(name, -1) + 1
        return f"{COMPILES_PREFIX}{name}#{n}"

    def compile(self, name: str, lowered: Any) -> Any:
        """The executable of `lowered` (a `jax.stages.Lowered`) as `lowered.compile()` gives it."""
        from jax.experimental import serialize_executable

        key = self._key(name)
        digest = hashlib.sha256(lowered.as_text().encode()).digest()
        t0 = time.perf_counter()
        if self.is_leader:
            _compile_thread.is_cache_hit = False
            compiled = lowered.compile()
            if _compile_thread.is_cache_hit:  # module docstring: not shareable; each follower compiles it
                self._client.key_value_set_bytes(key, digest)
                log.info("read %s from the compilation cache: the other processes compile it themselves", key)
                return compiled
            payload, _, _ = serialize_executable.serialize(compiled)
            if jax.default_backend() == "cpu" and not carries_object_code(payload):  # a cache read, from memory
                self._client.key_value_set_bytes(key, digest)
                log.info("%s came from memory without object code: the other processes compile it themselves", key)
                return compiled
            self._client.key_value_set_bytes(key, digest + payload)
            log.info("compiled %s and shared it with the group (%.1f MB, %.1f s)", key, len(payload) / 2**20,
                     time.perf_counter() - t0)
            return compiled
        data = self._wait(key)
        if data[:len(digest)] != digest:
            leader_gone(f"follower {self.process_id}: process 0 compiled a different program for {name} "
                        "(the processes' configurations differ?); exiting")
        if len(data) == len(digest):
            log.info("compiling %s here: process 0 read it from its compilation cache", key)
            return lowered.compile()
        compiled = serialize_executable.deserialize_and_load(data[len(digest):], lowered.in_tree, lowered.out_tree)
        log.info("loaded %s from process 0 (%.1f MB, %.1f s waiting and loading)", key,
                 (len(data) - len(digest)) / 2**20, time.perf_counter() - t0)
        return compiled

    def _wait(self, key: str) -> bytes:
        """Process 0's bytes for `key`, in waits of `timeout_s`; between them its heartbeat
        must have moved, or it is hung (or gone) and this process exits non-zero."""
        beat = self._heartbeat()
        while True:
            try:
                return self._client.blocking_key_value_get_bytes(key, int(self.timeout_s * 1000))
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    leader_gone(f"follower {self.process_id}: waiting for process 0's {key} failed ({e}); exiting")
            now = self._heartbeat()
            if now is None or now == beat:
                leader_gone(f"follower {self.process_id}: no compile heartbeat from process 0 for "
                            f"{self.timeout_s:g} s while waiting for {key} (hung); exiting")
            beat = now

    def _heartbeat(self) -> str | None:
        try:
            return self._client.key_value_try_get(COMPILES_PREFIX + "heartbeat")
        except jax.errors.JaxRuntimeError:  # not set yet (NOT_FOUND)
            return None
