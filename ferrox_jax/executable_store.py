"""The executable store: the runner's compiled step executables, serialized under a key of
our own, so that a restart loads them without tracing or lowering a single step function.

JAX's persistent compilation cache (`--compile-cache-dir`) is keyed by the lowered module,
so a restart on it still traces and lowers every step shape before it can look one up
(for the 1B GGUF at 8 rows x 512: 4.1 s of a 10.3 s restart, docs/benchmarks.md). This
store is keyed by what the program is made from instead, all of it known before a trace:

  * the program fingerprint (`program_fingerprint`, one per engine): every engine setting
    that can reach the step functions (all of `EngineConfig` but the host-side fields of
    `HOST_SIDE_FIELDS`), the checkpoint's files (path, size and mtime of each: cheap at
    start-up and changed by any rewrite; the weights' bytes never reach the program, they
    are its arguments, so a content hash would buy nothing but seconds of reading), the
    mmproj file likewise, jax and jaxlib versions, the backend, its platform version and
    device kind, the device and process counts, the CPU's feature flags (XLA and our
    kernels pick instructions by them) and FERROX_CPU_ISA's cap on them, XLA_FLAGS, the x64
    and matmul-precision switches,
    a hash of the CPU kernels library and a hash of every Python source of ferrox_jax/
    and models/ (our own code version: any edit is a new program, which is safe);
  * the step's own key (`("forward", Bd, Pc, Tc)`, `("sample", rows)`, ...:
    `ferrox_jax/runner.py:compile_keys`).

Layout: `<compile_cache_dir>/executables/<fingerprint>/<step key>.exe`, each file a magic
line, the SHA-256 of its body, and the body: the pickled (step key, executable bytes from
`jax.experimental.serialize_executable.serialize`, input and output treedefs). A write is
atomic (a temporary file in the same folder, then a rename), so a reader never sees half a
file; an entry that is unreadable, truncated, fails its checksum or does not load is logged
and compiled again (and rewritten), never fatal. Loading unpickles: the folder must be
writable only by the server's user, as any cache that holds code.

Each folder also holds `.in-use`: its last use (the last start that loaded or wrote it) and
a shared lock held by every live engine on it. Once an engine's warm-up has settled its
folder, `ExecutableStore.apply_bound` keeps the whole store within
`EngineConfig.executable_store_max_gib`, removing other folders least recently used first,
never one a live server holds or one used within the last hour (`ferrox_jax/store_bound.py`).

Only freshly compiled executables can be stored: jax 0.10 on CPU serializes an executable
it read from its own persistent cache without its object code (the machine code XLA CPU
emitted for the program's kernels): it deserializes without complaint, and its first run
fails with "Function <kernel> not found" (`ferrox_jax/shared_compiles.py`). So the runner
compiles what the store misses with JAX's cache suspended (`fresh_compiles`): the first
start after a change of any key part (a new version, another model or setting) compiles
those shapes from scratch as a cold start does, and every later start loads them.

Suspending JAX's cache is not enough in a process that has compiled the same program
before (a pytest worker, a server that swaps models back, `ferrox run-batch` run beside a
server): JAX keeps each lowering and its executable in memory, so `lowered.compile()` of a
program this process already has returns that executable again, without a compile and
without a cache-hit event, and if it was read from JAX's persistent cache it carries no
object code. Stored, it failed every step of the engine that loaded it. So a payload is
checked for object code (`carries_object_code`, an object file's magic in the serialized
executable) before it is written and again when it is read: one without is never stored
(logged; a later start in a fresh process stores it) and an entry without is a miss,
compiled again.

A restart loads the entries on a thread of their own (`prefetch`, called by the engine's
build as soon as the fingerprint is known, before the weights are placed): XLA deserializes
with the GIL released, so on a second core the 23 entries of the 1B load while the main
thread places the weights, and the warm-up takes each from there (`load` waits for one the
thread has not reached). The thread reads the folder's files in name order and checks each
as `load` does; what it could not use is a miss, compiled again.

Used for one process on the CPU backend without a mesh (`store_for`); TPU and GPU, meshes
and multi-process groups stay on JAX's cache (and `shared_compiles.py`): their round trip
is not exercised by this project's CPU tests, and their executables are placed on several
devices, which a single-device load would not restore.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import jaxlib

from ferrox_jax import store_bound
from ferrox_jax.config import EngineConfig
from models import cpu_isa

log = logging.getLogger(__name__)

STORE_FOLDER = "executables"  # under the compile cache dir
MAGIC = b"ferrox-executable-v1\n"
DIGEST = hashlib.sha256().digest_size
# EngineConfig fields that never reach a step function: names, host-side limits, the
# grammar sandbox, timeouts, where the caches live, the group's secret (never hashed).
HOST_SIDE_FIELDS = frozenset({
    "served_model_name", "max_queue", "scheduling_policy", "grammar_sandbox", "grammar_workers",
    "grammar_timeout_s", "compile_cache_dir", "executable_store", "multihost_timeout_s", "multihost_secret",
    "step_timeout_s", "max_step_faults", "executable_store_max_gib"})
SOURCE_ROOTS = ("ferrox_jax", "models")  # our own code: every .py under them is hashed
# The object files XLA CPU emits for a program's kernels, embedded whole in its serialization:
# ELF on Linux, 64-bit Mach-O on macOS (the CPU backend's hosts).
OBJECT_FILE_MAGICS = (b"\x7fELF", b"\xcf\xfa\xed\xfe")

_thread = threading.local()  # was_cache_hit: this thread's last compile was a JAX persistent-cache read
_listening: list[bool] = []


def _note_cache_hit(event: str, **_kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # recorded in the compiling thread
        _thread.was_cache_hit = True


def _xla_flags() -> str:
    """XLA_FLAGS change what XLA compiles (JAX's own cache key hashes them too)."""
    return os.environ.get("XLA_FLAGS", "")


@functools.cache
def code_version() -> str:
    """SHA-256 over the path and bytes of every Python source under ferrox_jax/ and models/."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for top in SOURCE_ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _kernels_hash() -> str:
    from models.cpu_kernels import LIBRARY

    return hashlib.sha256(LIBRARY.read_bytes()).hexdigest() if LIBRARY.exists() else "absent"


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}|{flags.strip()}"


def carries_object_code(payload: bytes) -> bool:
    """Whether a serialized CPU executable holds its kernels' object code. One read back
    from JAX's persistent cache (or reused in memory after such a read) serializes without
    any: it loads, and its first run fails with "Function ... not found" (module docstring).
    A program with no compiled kernel at all would be refused too: it only costs a compile."""
    return any(magic in payload for magic in OBJECT_FILE_MAGICS)


def file_identity(path: str | None) -> list:
    """[(path, size, mtime_ns)] of a checkpoint file, or of each file of a checkpoint
    folder (sorted); [] for no path or a name that is not on disk (the embedded model's
    files are hashed with our code)."""
    if not path or not os.path.exists(path):
        return []
    paths = sorted(p for p in Path(path).rglob("*") if p.is_file()) if os.path.isdir(path) else [Path(path)]
    return [(str(p.resolve()), (s := p.stat()).st_size, s.st_mtime_ns) for p in paths]


def program_fingerprint(config: EngineConfig, model_path: str | None) -> str:
    """The key part shared by every step of one engine (module docstring), as hex."""
    device = jax.devices()[0]
    parts = {
        "config": {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)
                   if f.name not in HOST_SIDE_FIELDS},
        "model": file_identity(model_path),
        "mmproj": file_identity(config.mmproj),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "backend": [jax.default_backend(), device.client.platform_version, device.device_kind,
                    jax.device_count(), jax.process_count()],
        "cpu": _cpu_flags(), "cpu_isa": cpu_isa.requested(), "xla_flags": _xla_flags(),
        "jax_flags": [jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision)],
        "kernels": _kernels_hash(), "code": code_version(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def entry_name(key: tuple) -> str:
    """A step key as a file name: `("forward", 8, 0, 0)` -> "forward-8-0-0.exe"."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(map(str, key))) + ".exe"


class ExecutableStore:
    """One engine's folder of serialized executables (module docstring)."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, max_bytes: int = 0) -> None:
        """Args:
          root: the compile cache dir; entries go under `root/executables/<fingerprint>/`.
          fingerprint: `program_fingerprint` of the engine.
          max_bytes: the bound `apply_bound` keeps the whole store in; 0: unbounded.
        """
        self.folder = Path(root) / STORE_FOLDER / fingerprint
        self.max_bytes = max_bytes
        self.loaded = self.stored = 0  # executables this engine loaded from / wrote to the store
        self._lock = threading.Lock()  # the counters and the hold: warm-up loads and compiles from a thread pool
        # `prefetch`'s thread, and what it loaded by file name (None: unusable, logged); the
        # condition is notified after each entry and when the thread ends.
        self._prefetch: threading.Thread | None = None
        self._prefetched: dict[str, Any] = {}
        self._arrived = threading.Condition(self._lock)
        # This engine's claim on its folder (`ferrox_jax/store_bound.py`), from before its first
        # load: no other server's start removes it while this one lives. None until it exists.
        self._hold = store_bound.hold(self.folder)
        if not _listening:  # once a process
            jax.monitoring.register_event_listener(_note_cache_hit)
            _listening.append(True)

    def prefetch(self) -> None:
        """Starts loading every entry of the folder on a thread (module docstring); `load`
        takes from it. Nothing without a folder (a first start) or when started already."""
        if self._prefetch is not None or not self.folder.is_dir():
            return
        from models import cpu_kernels

        cpu_kernels.unavailable_reason()  # the kernels' custom calls registered here, before the thread
        # Not a daemon: a start that fails meanwhile exits once the thread has read the folder,
        # never while XLA is inside a deserialize.
        self._prefetch = threading.Thread(target=self._prefetch_all, name="ferrox-store-prefetch")
        self._prefetch.start()

    def _prefetch_all(self) -> None:
        t0 = time.perf_counter()
        try:
            paths = sorted(self.folder.glob("*.exe"))
            for path in paths:
                exe = self._read(path, None)
                with self._arrived:
                    self._prefetched[path.name] = exe
                    self._arrived.notify_all()
            log.info("executable store: %d entries read on a thread in %.1f s", len(paths), time.perf_counter() - t0)
        except OSError as e:  # the folder went away meanwhile (another server's bound): `load` reads itself
            log.warning("executable store: cannot list %s (%s)", self.folder, e)
        finally:
            with self._arrived:
                self._arrived.notify_all()  # `load` stops waiting for names the thread never reached

    def end_prefetch(self) -> None:
        """Once the warm-up has taken what it loads: waits for the thread, and drops what it
        loaded that no step of this engine asked for (nothing, unless files were added by hand)."""
        if self._prefetch is None:
            return
        self._prefetch.join()
        with self._arrived:
            if self._prefetched:
                log.info("executable store: %d entries of %s not used: %s", len(self._prefetched), self.folder,
                         ", ".join(sorted(self._prefetched)))
            self._prefetched.clear()

    def _take_prefetched(self, name: str) -> tuple[bool, Any]:
        """(True, what `prefetch` loaded for this file name) once the thread has it; (False,
        None) without a prefetch, or when its thread ended without reaching the name."""
        if self._prefetch is None:
            return False, None
        with self._arrived:
            while name not in self._prefetched and self._prefetch.is_alive():
                self._arrived.wait()
            if name not in self._prefetched:
                return False, None
            return True, self._prefetched.pop(name)

    def load(self, key: tuple) -> Any | None:
        """The executable stored for `key` as a `jax.stages.Compiled`, or None (none stored,
        or the entry is unusable: logged, and the caller compiles it again)."""
        path = self.folder / entry_name(key)
        found, exe = self._take_prefetched(path.name)
        if not found:
            exe = self._read(path, key)
        if exe is not None:
            with self._lock:
                self.loaded += 1
        return exe

    def _read(self, path: Path, key: tuple | None) -> Any | None:
        """The executable of one entry, checked (header, checksum, key, object code), or None:
        missing, or unusable (logged). `key` None (`prefetch`): the key the entry holds, which
        must be the one its file is named for."""
        from jax.experimental import serialize_executable

        from models import cpu_kernels

        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("executable store: cannot read %s (%s); compiling it", path, e)
            return None
        body = data[len(MAGIC) + DIGEST:]
        if not data.startswith(MAGIC) or data[len(MAGIC):len(MAGIC) + DIGEST] != hashlib.sha256(body).digest():
            log.warning("executable store: %s is corrupt (bad header or checksum); compiling it again", path)
            return None
        # Our CPU kernels are custom calls resolved by name when the executable loads.
        cpu_kernels.unavailable_reason()
        try:
            stored_key, payload, in_tree, out_tree = pickle.loads(body)
            stored_key = tuple(stored_key)
            if stored_key != (stored_key if key is None else tuple(key)) or entry_name(stored_key) != path.name:
                raise ValueError(f"it holds {stored_key}")
            if not carries_object_code(payload):  # it would load, then fail every run
                raise ValueError("it holds no object code")
            exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - any unusable entry (unpickling, XLA's loader) means compile again
            log.warning("executable store: %s did not load (%s); compiling it again", path, e)
            return None
        return exe

    def compile(self, key: tuple, lowered: Any) -> Any:
        """`lowered.compile()`, stored under `key` when it was compiled here (an executable
        read from JAX's cache cannot be serialized whole: module docstring)."""
        _thread.was_cache_hit = False
        compiled = lowered.compile()
        if _thread.was_cache_hit:
            log.info("executable store: %s came from JAX's compile cache and is not stored", key)
        else:
            self.save(key, compiled)
        return compiled

    def save(self, key: tuple, compiled: Any) -> None:
        """Serializes `compiled` under `key`, atomically; a failure is logged, never raised."""
        from jax.experimental import serialize_executable

        path = self.folder / entry_name(key)
        tmp = None
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            if not carries_object_code(payload):  # module docstring: served from memory after a cache read
                log.info("executable store: %s has no object code (this process had it from JAX's compile "
                         "cache); not stored, a later start compiles it", key)
                return
            body = pickle.dumps((tuple(key), payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            self.folder.mkdir(parents=True, exist_ok=True)
            with self._lock:
                if self._hold is None:  # the folder is new: claim it before it holds anything
                    self._hold = store_bound.hold(self.folder)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(tmp, path)
            tmp = None
        # A full disk or an executable that does not serialize costs the next start a compile, nothing more.
        except Exception as e:  # noqa: BLE001
            log.warning("executable store: could not store %s (%s); the next start compiles it", key, e)
            return
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        with self._lock:
            self.stored += 1

    def apply_bound(self) -> store_bound.BoundReport:
        """Once this engine's folder is settled (after its warm-up): removes other program
        folders, least recently used first, until the store fits in `max_bytes`; logs what
        it removed and kept (`ferrox_jax/store_bound.py`). Never raises."""
        with self._lock:
            if self._hold is None:
                self._hold = store_bound.hold(self.folder)
        report = store_bound.apply_bound(self.folder.parent, keep=self.folder, max_bytes=self.max_bytes)
        log.info("%s", report.describe())
        return report

    @contextlib.contextmanager
    def fresh_compiles(self) -> Iterator[None]:
        """JAX's persistent cache off for the compiles inside (process-wide: the warm-up's
        misses, when nothing else compiles), so each is compiled whole and can be stored."""
        from jax.experimental.compilation_cache import compilation_cache

        was = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX decides once whether its cache is used; ask again
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", was)
            compilation_cache.reset_cache()


def store_for(config: EngineConfig, model_path: str | None, single_device: bool) -> ExecutableStore | None:
    """The engine's store, or None where it is not used: no compile cache dir, the store
    turned off, a backend other than CPU, a mesh or a multi-process group (module docstring).
    Its entries start loading at once (`prefetch`): call it as soon as `config` is final."""
    if (not config.compile_cache_dir or not config.executable_store or jax.default_backend() != "cpu"
            or not single_device or jax.process_count() > 1):
        return None
    store = ExecutableStore(config.compile_cache_dir, program_fingerprint(config, model_path),
                            max_bytes=int(config.executable_store_max_gib * store_bound.GIB))
    store.prefetch()
    return store
