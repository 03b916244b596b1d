"""Seconds per test file from a pytest JUnit XML report, for tests/durations.json.

`make test` orders the files dearest first from that table (tests/conftest.py), so the
two xdist workers end close together. Refresh it after a change moves a file's cost:

    make test PYTEST_ARGS="--junitxml=/tmp/junit.xml"
    python -m tools.suite.test_durations /tmp/junit.xml > tests/durations.json

A file's seconds are the sum of its tests' times (setup and teardown included, as JUnit
records them). The table is a hint for the order only: a stale one slows the run, never
changes what runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET


def file_seconds(junit_xml: str) -> dict[str, float]:
    """{"tests/engine/test_x.py": seconds} from a JUnit XML file written by pytest."""
    totals: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # pytest writes classname "tests.engine.test_x" (or "tests.engine.test_x.TestClass"): the
        # package path up to the module is the file's path under the repository.
        parts = [p for p in module if p]
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if parts:
            totals["/".join(parts) + ".py"] += float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("junit_xml")
    args = p.parse_args(argv)
    seconds = file_seconds(args.junit_xml)
    json.dump({"source": "python -m tools.suite.test_durations (see its docstring)", "seconds": seconds},
              sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
