"""The test suite's own helpers: test_durations turns a JUnit report into
tests/durations.json, the order `make test` runs the files in (tests/conftest.py)."""
