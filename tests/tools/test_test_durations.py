"""tools/suite/test_durations.py: a JUnit report's seconds per test file (tests/durations.json),
and the order tests/conftest.py gives the files from them (files the table lacks first)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.suite.test_durations import file_seconds

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_fast" name="test_a" time="0.5"/>
<testcase classname="tests.test_slow" name="test_b[x]" time="10.3"/>
<testcase classname="tests.test_slow.TestGroup" name="test_c" time="2.0"/>
<testcase classname="tests.test_fast" name="test_d" time="1.0"><skipped message="no"/></testcase>
</testsuite></testsuites>
"""


def test_seconds_are_summed_per_file_classes_included_dearest_first(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    seconds = file_seconds(str(report))
    assert seconds == {"tests/test_slow.py": 12.3, "tests/test_fast.py": 1.5}
    assert list(seconds) == ["tests/test_slow.py", "tests/test_fast.py"]


def test_the_table_names_files_that_exist():
    table = json.loads((Path(__file__).parents[1] / "durations.json").read_text())["seconds"]
    root = Path(__file__).resolve().parents[2]
    missing = [name for name in table if not (root / name).exists()]
    assert table and not missing, f"tests/durations.json names files that are gone: {missing}"


def test_a_file_in_a_tier_folder_keeps_its_folder(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT.replace('"tests.test_fast', '"tests.engine.test_fast')
                      .replace('"tests.test_slow', '"tests.server.test_slow'))
    seconds = file_seconds(str(report))
    assert seconds == {"tests/server/test_slow.py": 12.3, "tests/engine/test_fast.py": 1.5}


def test_files_missing_from_the_table_run_first_then_the_dearest():
    """tests/conftest.py's order: a file the table lacks (a new one, often dear) starts before
    every file in it, so it cannot start late and hold one worker after the other is done.
    The former rule (a missing file counts as the median, 5 s here) would run new1 after
    b and new2 after c, last but one: the assertion catches it."""
    from tests.conftest import file_order

    files = ["a", "b", "new1", "c", "new2"]
    seconds = {"a": 1.0, "b": 30.0, "c": 5.0}
    assert file_order(files, seconds) == ["new1", "new2", "b", "c", "a"]
    assert file_order(["x", "y", "z"], {"x": 2.0, "y": 2.0, "z": 3.0}) == ["z", "x", "y"], "ties keep collection order"
