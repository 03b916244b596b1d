"""The suite's layout, as tests/conftest.py describes it: every test file in one tier folder,
support/ without tests, every folder a package (so `tests.<tier>.<module>` imports alike in
pytest and its xdist workers), and the Makefile's fast target leaving out only files that
exist in the tiers it runs (a renamed file must not slip back in unnoticed)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
TIERS = ("engine", "models", "server", "system", "tools")


def _make_words(name: str) -> list[str]:
    """The words of a `NAME := ...` assignment in the Makefile, continuation lines joined."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith(f"{name} :="))
    return line.split(":=", 1)[1].split()


def test_every_test_file_sits_in_a_tier_folder():
    stray = sorted(str(p.relative_to(REPO)) for p in TESTS.rglob("test_*.py")
                   if p.parent.parent != TESTS or p.parent.name not in TIERS)
    assert not stray, f"test files outside the tier folders {TIERS}: {stray}"


def test_support_holds_no_tests_and_every_folder_is_a_package():
    assert not list((TESTS / "support").glob("test_*.py")), "support/ is for helpers; tests go in a tier"
    folders = [TESTS, *(TESTS / name for name in (*TIERS, "support"))]
    missing = [str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py (their modules would not import as tests.*): {missing}"


def test_the_fast_target_leaves_out_only_existing_files_of_its_own_tiers():
    tiers = _make_words("FAST_TIERS")
    skipped = _make_words("FAST_SKIP")
    assert set(tiers) == {"tests/engine", "tests/models", "tests/server"}, tiers
    gone = [f for f in skipped if not (REPO / f).is_file()]
    elsewhere = [f for f in skipped if Path(f).parent.as_posix() not in tiers]
    assert skipped and not gone and not elsewhere, f"FAST_SKIP names missing {gone} or other tiers' {elsewhere}"
