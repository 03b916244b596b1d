"""The executable store's disk bound: least recently used program folders go first.

Every change of the program fingerprint (a new ferrox or jax version, another model file,
another setting: `ferrox_jax/executable_store.py`) starts a new folder under
`<compile_cache_dir>/executables/`, and the old ones are never read again. Without a bound
a server upgraded weekly, or a user trying many models, grows the folder forever. So at
start, once the engine's own folder is settled (the warm-up loaded or stored every step),
`apply_bound` removes whole folders, least recently used first, until the store fits in
`EngineConfig.executable_store_max_gib` (0: unbounded), as ccache or JAX's own cache
(`jax_compilation_cache_max_size`) bound theirs.

A folder's use is its `.in-use` file, which is two things at once:

  * its mtime is the folder's last use: the last start that loaded from the folder or
    wrote to it touches it (`hold`). A folder without one (written before the bound
    existed, or just created by a start that has not held it yet) counts its newest file;
  * a live engine holds a shared `flock` on it for as long as it lives (released by the
    kernel when the process dies, however it dies: no stale lock to clear). Removal takes
    the exclusive lock without waiting; a folder another live server (or another engine of
    this process) uses is busy, so it is skipped.

Besides the lock, a folder used within `GRACE_S` is never removed: it covers a start that
created its folder and has not taken the lock yet, and a file system where `flock` does not
work (then only the grace protects a long-running server's folder: logged). The folder of
the engine applying the bound is never removed either. A folder is removed by renaming it
to a `.removing-*` name under the exclusive lock (readers see it whole or not at all), then
deleting that; a starting engine that waited for the lock finds its folder gone and starts
a new one. A removal that fails is logged and skipped, never raised: the bound is a
housekeeping chore, a start never fails on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import sys
import time
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

USE_FILE = ".in-use"  # in each program folder: its last use (mtime) and its live engines' shared lock
TRASH_PREFIX = ".removing-"  # a folder being deleted, out of every reader's way
GRACE_S = 3600.0  # a folder used this recently is never removed (module docstring)
GIB = 1 << 30


class FolderHold:
    """A live engine's claim on its program folder: the `.in-use` file touched and held
    under a shared lock until `release` (or until this object is collected, or the process
    ends)."""

    def __init__(self, fd: int) -> None:
        self._finalizer = weakref.finalize(self, os.close, fd)  # closing the file drops the lock

    def release(self) -> None:
        self._finalizer()


def hold(folder: Path) -> FolderHold | None:
    """Marks `folder` used now and holds it for this engine; None where the folder does not
    exist (nothing to protect yet) or cannot be held (logged: the grace period still covers it).

    A removal may rename the folder away while this waits for the lock: then the file we
    locked is no longer the folder's, and we try again on whatever is there now."""
    for _ in range(3):
        try:
            fd = os.open(folder / USE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except (FileNotFoundError, NotADirectoryError):
            return None  # no folder (yet, or any more): the first store creates it and holds it then
        except OSError as e:
            log.warning("executable store: cannot mark %s in use (%s); it is kept for %.0f min after this start "
                        "only", folder, e, GRACE_S / 60)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a removal renames this folder away
            with contextlib.suppress(FileNotFoundError):
                if os.stat(folder / USE_FILE).st_ino == os.fstat(fd).st_ino:
                    os.utime(fd)  # this start is the folder's last use
                    return FolderHold(fd)
        except OSError as e:  # e.g. a file system without locks: the grace period still holds
            log.warning("executable store: cannot lock %s (%s); another server's start may remove it %.0f min "
                        "after this one", folder, e, GRACE_S / 60)
            with contextlib.suppress(OSError):
                os.utime(fd)
            os.close(fd)
            return None
        os.close(fd)  # removed under us: look again
    return None


def folder_bytes(folder: Path) -> int:
    """The bytes of the files in one program folder (the store does not nest folders)."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(folder) as it:
        for entry in it:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def last_use(folder: Path) -> float:
    """When the folder was last used (module docstring): its `.in-use` file's mtime, else
    its newest file's (or the folder's own)."""
    try:
        return os.stat(folder / USE_FILE).st_mtime
    except OSError:
        pass
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = os.stat(folder).st_mtime
        with os.scandir(folder) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _remove(folder: Path) -> bool:
    """Removes one folder unless a live engine holds it: True when it is gone."""
    try:
        fd = os.open(folder / USE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:
        return False  # another start removed it meanwhile
    except OSError as e:
        log.warning("executable store: cannot remove %s (%s); kept", folder, e)
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live engine uses it
        except OSError as e:
            log.warning("executable store: cannot lock %s to remove it (%s); kept", folder, e)
            return False
        trash = folder.with_name(f"{TRASH_PREFIX}{folder.name}-{os.getpid()}")
        try:
            os.rename(folder, trash)  # under the lock: a start waiting for it sees the folder gone
        except OSError as e:
            log.warning("executable store: cannot remove %s (%s); kept", folder, e)
            return False
    finally:
        os.close(fd)
    _delete(trash)
    return True


def _delete(trash: Path) -> None:
    """Deletes a renamed-away folder; what cannot be deleted is logged (a later start retries)."""
    def failed(path: str, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):  # another start deleting the same leftovers
            return
        log.warning("executable store: cannot delete %s (%s); a later start tries again", path, exc)

    if sys.version_info >= (3, 12):  # `onerror` is deprecated there
        shutil.rmtree(trash, onexc=lambda _fn, path, exc: failed(path, exc))
    else:
        shutil.rmtree(trash, onerror=lambda _fn, path, info: failed(path, info[1]))


@dataclasses.dataclass(frozen=True)
class BoundReport:
    """What `apply_bound` did: the folders it removed and their bytes, and what the store
    holds after it (folders and bytes, this engine's included)."""
    removed: tuple[str, ...]
    removed_bytes: int
    kept: int
    kept_bytes: int
    max_bytes: int

    def describe(self) -> str:
        bound = f"the {self.max_bytes / GIB:g} GiB bound" if self.max_bytes else "no bound"
        kept = f"{self.kept} folder{'s' * (self.kept != 1)}, {self.kept_bytes / 2**20:.1f} MiB of {bound}"
        if not self.removed:
            return f"executable store: {kept}"
        return (f"executable store: removed {len(self.removed)} folder{'s' * (len(self.removed) != 1)} of other "
                f"programs, least recently used first ({self.removed_bytes / 2**20:.1f} MiB: "
                f"{', '.join(name[:12] for name in self.removed)}); kept {kept}")


def apply_bound(root: Path, keep: Path, max_bytes: int, grace_s: float = GRACE_S,
                now: float | None = None) -> BoundReport:
    """Removes program folders under `root` (the store's `executables/`), least recently used
    first, until the rest fits in `max_bytes` (0: removes nothing), never `keep` (this
    engine's), one a live engine holds or one used within `grace_s`. Leftovers of an earlier
    removal that did not finish go first. Never raises: a failure is logged and kept."""
    now = time.time() if now is None else now
    folders: list[tuple[float, int, Path]] = []
    try:
        with os.scandir(root) as it:
            children = [Path(entry.path) for entry in it if entry.is_dir(follow_symlinks=False)]
    except OSError as e:
        log.warning("executable store: cannot list %s (%s); nothing removed", root, e)
        return BoundReport((), 0, 0, 0, max_bytes)
    for child in children:
        if child.name.startswith(TRASH_PREFIX):
            if max_bytes and now - last_use(child) > grace_s:  # a removal that died midway
                _delete(child)
            continue
        folders.append((last_use(child), folder_bytes(child), child))
    total = sum(size for _, size, _ in folders)
    removed: list[str] = []
    removed_bytes = 0
    for used, size, folder in sorted(folders, key=lambda f: f[0]):  # least recently used first
        if not max_bytes or total <= max_bytes:
            break
        if folder == keep or now - used <= grace_s or not _remove(folder):
            continue
        removed.append(folder.name)
        removed_bytes += size
        total -= size
    return BoundReport(tuple(removed), removed_bytes, len(folders) - len(removed), total, max_bytes)
