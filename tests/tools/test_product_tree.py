"""The product tree does not carry the lab: the wheel packages ferrox_jax, api and models
only (pyproject.toml's package finder), none of their modules imports tools/ (at module or
function level), and tools/ is grouped into packages by what each tool is for."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import setuptools

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("api", "ferrox_jax", "models")


def _wheel_packages() -> list[str]:
    """What setuptools' `packages.find` in pyproject.toml selects (namespace packages
    included unless the table turns them off, as setuptools does)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    find = config["packages"]["find"]
    finder = setuptools.find_namespace_packages if find.get("namespaces", True) else setuptools.find_packages
    return finder(where=str(REPO / find.get("where", ["."])[0]), include=find.get("include", ["*"]),
                  exclude=find.get("exclude", ()))


def test_the_wheel_ships_the_product_and_not_tools():
    packages = _wheel_packages()
    assert {p.split(".")[0] for p in packages} == set(PRODUCT), f"the wheel's top-level packages: {sorted(packages)}"
    assert not [p for p in packages if p == "tools" or p.startswith("tools.")], "tools/ must stay out of the wheel"
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not [k for k in config.get("package-data", {}) if k.split(".")[0] not in PRODUCT]


def _imports_of_tools(source: str) -> list[str]:
    """Every import of tools in a module's source, wherever it sits (function bodies too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "tools"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tools":
            found.append(f"from {node.module} import ...")
    return found


def test_no_product_module_imports_tools():
    offenders = [f"{path.relative_to(REPO)}: {hit}" for package in PRODUCT
                 for path in sorted((REPO / package).rglob("*.py")) for hit in _imports_of_tools(path.read_text())]
    assert not offenders, f"the product imports the lab: {offenders}"


def test_the_import_check_sees_a_function_level_import():
    """Negative control: an import of tools inside a function body is found, a lookalike is not."""
    source = "import toolsmith\n\ndef f():\n    from tools.parity import compare_logits\n    import tools.soak\n"
    assert _imports_of_tools(source) == ["from tools.parity import ...", "import tools.soak"]


def test_tools_are_grouped_into_packages():
    loose = sorted(p.name for p in (REPO / "tools").iterdir() if p.is_file() and p.name != "__init__.py")
    assert not loose, f"tools/ holds groups (bench, device, soak, ...), not loose files: {loose}"
    groups = [p for p in (REPO / "tools").iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert groups and all((g / "__init__.py").is_file() for g in groups), "every group is a package"
