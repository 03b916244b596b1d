"""The executable store's disk bound (`ferrox_jax/store_bound.py`): least recently used
program folders go first until the store fits; never the engine's own folder, one another
live engine holds (another process, or this one) or one used within the grace period; a
failed removal is logged, not raised; and one real store round trip on a small jit.

The policy runs on fake folders (one entry file of known size each, the `.in-use` file's
mtime set by hand), so no engine compiles. Negative controls: ordering by name instead of
use removes the wrong folders, and the folder a live process held is removed once that
process is gone (the lock, not luck, kept it).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrox_jax import executable_store, store_bound
from ferrox_jax.config import EngineConfig
from ferrox_jax.store_bound import GRACE_S, TRASH_PREFIX, USE_FILE, apply_bound

ENTRY_BYTES = 1000  # each fake folder: one entry of this size and an empty `.in-use` file
HOUR = 3600.0
REPO = Path(__file__).resolve().parents[2]


def make_folder(root: Path, name: str, hours_ago: float, marker: bool = True) -> Path:
    """A program folder last used `hours_ago`: its `.in-use` file's mtime, or (marker=False,
    as written before the bound existed) its entry's."""
    folder = root / name
    folder.mkdir(parents=True)
    entry = folder / "forward-8-0-0.exe"
    entry.write_bytes(b"x" * ENTRY_BYTES)
    used = time.time() - hours_ago * HOUR
    if marker:
        (folder / USE_FILE).touch()
        os.utime(folder / USE_FILE, (used, used))
    else:
        os.utime(entry, (used, used))
        os.utime(folder, (used, used))
    return folder


def present(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def check_least_recently_used_go_first(root: Path) -> None:
    """Five folders whose names sort in another order than their use: a bound of three
    entries removes exactly the two least recently used, and the rest fits."""
    ages = {"a-newest": 2, "b-oldest": 9, "c-middle": 5, "d-second-oldest": 7, "e-own": 3}  # hours since use
    for name, hours in ages.items():
        make_folder(root, name, hours)
    report = apply_bound(root, keep=root / "e-own", max_bytes=3 * ENTRY_BYTES)
    # 5 x 1000 bytes over a 3000 bound: the two oldest go (9 h, then 7 h), 3000 <= 3000 is kept
    assert report.removed == ("b-oldest", "d-second-oldest"), f"least recently used first: {report}"
    assert present(root) == {"a-newest", "c-middle", "e-own"}
    assert report.kept == 3 and report.kept_bytes == 3 * ENTRY_BYTES <= report.max_bytes
    assert report.removed_bytes == 2 * ENTRY_BYTES


def test_least_recently_used_folders_go_first_until_the_bound_holds(tmp_path):
    check_least_recently_used_go_first(tmp_path)


def test_negative_control_ordering_by_name_removes_the_wrong_folders(tmp_path, monkeypatch):
    """A policy that sorts by name (every folder old enough to go) fails the check above."""
    by_name = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 5.0}  # seconds after the epoch: all long unused
    monkeypatch.setattr(store_bound, "last_use", lambda folder: by_name[folder.name[0]])
    with pytest.raises(AssertionError, match="least recently used first"):
        check_least_recently_used_go_first(tmp_path)


def test_the_own_folder_and_a_fresh_one_are_never_removed_even_over_the_bound(tmp_path, caplog):
    own = make_folder(tmp_path, "own", hours_ago=30)  # oldest of all: kept, it is this engine's
    make_folder(tmp_path, "fresh", hours_ago=0.5 * GRACE_S / HOUR)  # used inside the grace period
    make_folder(tmp_path, "fresh-unmarked", hours_ago=0.5 * GRACE_S / HOUR, marker=False)  # its entry is new
    make_folder(tmp_path, "old", hours_ago=20)
    make_folder(tmp_path, "old-unmarked", hours_ago=10, marker=False)  # written before the bound existed
    with caplog.at_level(logging.INFO, logger="ferrox_jax.store_bound"):
        report = apply_bound(tmp_path, keep=own, max_bytes=1)
    assert report.removed == ("old", "old-unmarked")
    assert present(tmp_path) == {"own", "fresh", "fresh-unmarked"}
    assert report.kept_bytes == 3 * ENTRY_BYTES > report.max_bytes, "what may not go is kept, over the bound"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "nothing failed"


def test_unbounded_removes_nothing(tmp_path):
    for i, name in enumerate(("x", "y", "z")):
        make_folder(tmp_path, name, hours_ago=100 + i)
    report = apply_bound(tmp_path, keep=tmp_path / "x", max_bytes=0)
    assert report.removed == () and present(tmp_path) == {"x", "y", "z"} and report.kept_bytes == 3 * ENTRY_BYTES
    assert "no bound" in report.describe()


HOLDER = """
import sys
from pathlib import Path
from ferrox_jax import store_bound
held = store_bound.hold(Path(sys.argv[1]))
print("held" if held else "not held", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_a_folder_a_live_engine_holds_is_never_removed(tmp_path):
    """Another process holds one folder, this process another (as a model swap's old engine
    would): both are old and over the bound, and both stay. Negative control: once the
    holders are gone, the same call removes them."""
    other = make_folder(tmp_path, "other-server", hours_ago=50)
    mine = make_folder(tmp_path, "old-engine-here", hours_ago=40)
    own = make_folder(tmp_path, "own", hours_ago=0)
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(other)], cwd=REPO, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "held"
        held_here = store_bound.hold(mine)
        assert held_here is not None
        for folder in (other, mine):  # a long-running server's: its start was long ago
            os.utime(folder / USE_FILE, (time.time() - 40 * HOUR,) * 2)
        report = apply_bound(tmp_path, keep=own, max_bytes=1)
        assert report.removed == () and present(tmp_path) == {"other-server", "old-engine-here", "own"}, \
            "a folder a live engine holds is kept"
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    held_here.release()
    report = apply_bound(tmp_path, keep=own, max_bytes=1)
    assert report.removed == ("other-server", "old-engine-here") and present(tmp_path) == {"own"}


def test_a_start_that_waited_on_a_removal_finds_its_folder_gone(tmp_path):
    """`hold` on a folder that is no longer there holds nothing (the store creates it anew)."""
    gone = make_folder(tmp_path, "gone", hours_ago=5)
    assert apply_bound(tmp_path, keep=tmp_path / "own", max_bytes=1).removed == ("gone",)
    assert store_bound.hold(gone) is None and not gone.exists()


def test_a_failed_removal_is_logged_and_leftovers_are_cleared_later(tmp_path, monkeypatch, caplog):
    make_folder(tmp_path, "stuck", hours_ago=5)

    def refuse(*_args):
        raise PermissionError("read-only file system")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="ferrox_jax.store_bound"):
        patch.setattr(store_bound.os, "rename", refuse)
        report = apply_bound(tmp_path, keep=tmp_path / "own", max_bytes=1)
    assert report.removed == () and present(tmp_path) == {"stuck"}
    assert any("cannot remove" in r.getMessage() and "stuck" in r.getMessage() for r in caplog.records)
    # A removal that died between its rename and its delete: the next start clears it.
    leftover = make_folder(tmp_path, f"{TRASH_PREFIX}dead-1234", hours_ago=5)
    apply_bound(tmp_path, keep=tmp_path / "own", max_bytes=1)
    assert not leftover.exists() and present(tmp_path) == set()


def test_a_real_store_marks_its_folder_and_bounds_the_others(tmp_path, caplog):
    """Two stores on a small jit: the first one's folder, released and last used long ago,
    is removed by the second's `apply_bound`; the second's is marked, held and loads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    fn = jax.jit(lambda v: jnp.cos(v) @ v.T)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    old = executable_store.ExecutableStore(tmp_path, "fp-old")
    with old.fresh_compiles():
        old.compile(("forward", 3), fn.lower(x))
    assert old.stored == 1 and (old.folder / USE_FILE).is_file(), "the first write marks the folder"
    os.utime(old.folder / USE_FILE, (time.time() - 48 * HOUR,) * 2)
    assert apply_bound(old.folder.parent, keep=tmp_path / "other", max_bytes=1).removed == (), "held while alive"
    old._hold.release()  # as when that server stops

    new = executable_store.ExecutableStore(tmp_path, "fp-new", max_bytes=1)
    jax.clear_caches()
    with new.fresh_compiles():
        compiled = new.compile(("forward", 3), fn.lower(x))
    with caplog.at_level(logging.INFO, logger="ferrox_jax.executable_store"):
        report = new.apply_bound()
    assert report.removed == ("fp-old",) and not old.folder.exists()
    assert any("removed 1 folder" in r.getMessage() and "kept 1 folder" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(new.load(("forward", 3))(x), compiled(x))  # same program, same bits


def test_the_setting_is_validated_and_kept_out_of_the_fingerprint():
    assert EngineConfig().executable_store_max_gib > 0, "bounded by default"
    for bad in (-1, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match="executable_store_max_gib"):
            EngineConfig(executable_store_max_gib=bad)
    # Another bound is the same program: it must not start a new folder.
    assert "executable_store_max_gib" in executable_store.HOST_SIDE_FIELDS


def test_the_flag_and_variable_reach_the_engine_config():
    from api import cli
    from api.settings import env_defaults

    def engine_config(argv, environ):
        return cli.engine_config(cli.build_parser(environ).parse_args(["serve", *argv]))

    assert engine_config([], {}).executable_store_max_gib == EngineConfig().executable_store_max_gib
    assert engine_config([], {"FERROX_EXECUTABLE_STORE_MAX_GIB": "0.5"}).executable_store_max_gib == 0.5
    assert engine_config(["--executable-store-max-gib", "0"], {"FERROX_EXECUTABLE_STORE_MAX_GIB": "3"}) \
        .executable_store_max_gib == 0, "the flag wins; 0 is unbounded"
    with pytest.raises(SystemExit, match="FERROX_EXECUTABLE_STORE_MAX_GIB"):
        env_defaults({"FERROX_EXECUTABLE_STORE_MAX_GIB": "-1"})
