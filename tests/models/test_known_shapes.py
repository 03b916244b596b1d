"""models/known_shapes.py: config-only folders of public checkpoints' shapes, shared by the
dummy-loader tests, the device check and the sizing CLI; standard library only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.known_shapes import SHAPES, write_config_folder

REPO = Path(__file__).resolve().parents[2]


def test_a_written_folder_holds_exactly_the_shapes_config(tmp_path):
    folder = write_config_folder("tiny", tmp_path / "nested" / "tiny")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"], "config only: no weights, no tokenizer"
    assert json.loads((folder / "config.json").read_text()) == SHAPES["tiny"]


def test_an_unknown_shape_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        write_config_folder("llama-9", tmp_path / "x")


def test_importing_the_shapes_loads_nothing_beyond_the_standard_library():
    code = ("import sys; before = set(sys.modules); import models.known_shapes; "
            "print(sorted(m for m in set(sys.modules) - before "
            "if m.split('.')[0] not in sys.stdlib_module_names and m.split('.')[0] != 'models'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"models.known_shapes pulled in {out.stdout.strip()}"
