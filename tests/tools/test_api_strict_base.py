"""Every request body the API parses derives from one strict base, `api/protocol.py:StrictBody`,
so its parsing rules (strict types, unknown fields ignored, no NaN) are written once.
Read from the source: no import, no server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "api"
BASE_MODULE = "protocol.py"  # where StrictBody and the response models (plain BaseModel) live


def _classes(path: Path) -> list[ast.ClassDef]:
    return [node for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.ClassDef)]


def _base_names(cls: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases}


@pytest.mark.parametrize("path", sorted(p for p in API.glob("*.py") if p.name != BASE_MODULE), ids=lambda p: p.name)
def test_request_models_outside_protocol_derive_from_the_one_strict_base(path):
    own_configs = [c.name for c in _classes(path)
                   if "BaseModel" in _base_names(c)
                   or any(isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "model_config" for t in s.targets)
                          for s in c.body)]
    assert not own_configs, (f"api/{path.name}: {own_configs} set pydantic parsing rules of their own; "
                             "derive request bodies from api.protocol.StrictBody")


def test_the_strict_base_is_defined_once():
    bases = [c for c in _classes(API / BASE_MODULE) if c.name == "StrictBody"]
    assert len(bases) == 1 and "BaseModel" in _base_names(bases[0]), "api/protocol.py defines StrictBody(BaseModel)"
