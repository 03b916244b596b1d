"""tools/suite/test_durations.py: a JUnit report's seconds per test file (tests/durations.json),
and the order tests/conftest.py gives the files from them."""

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
