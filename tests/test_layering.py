"""The architecture's import rules, checked from the source: they fail the day a shortcut lands.

- `api/` has no import cycle (each module's imports of other `api` modules form a DAG);
- `api/` reaches the engine only through its facade: it never imports the batcher,
  scheduler, block budget, runner, plan, step or grammar-compiler modules (output
  constraints are plain data from `ferrox_jax/constraint.py`);
- the scheduler, block budget, block tables, prefix cache, batcher, stats, request, constraint,
  config, plan, host batch and buckets modules never import jax or llguidance (checked in a fresh interpreter, so a
  transitive import counts too);
- imports flow `api -> ferrox_jax -> models`: nothing under `ferrox_jax/` or `models/`
  imports `api`, and `models/` never imports `ferrox_jax`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE_INTERNALS = ("ferrox_jax.batcher", "ferrox_jax.scheduler", "ferrox_jax.block_budget", "ferrox_jax.block_tables",
                    "ferrox_jax.prefix_cache", "ferrox_jax.runner", "ferrox_jax.plan", "ferrox_jax.step",
                    "ferrox_jax.grammar")
JAX_FREE = ("ferrox_jax.scheduler", "ferrox_jax.block_budget", "ferrox_jax.block_tables", "ferrox_jax.prefix_cache",
            "ferrox_jax.batcher", "ferrox_jax.stats", "ferrox_jax.request", "ferrox_jax.constraint", "ferrox_jax.config",
            "ferrox_jax.host_batch", "ferrox_jax.plan", "ferrox_jax.buckets")


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at any depth (function-level imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def package_modules(package: str) -> dict[str, Path]:
    return {f"{package}.{p.stem}": p for p in sorted((ROOT / package).glob("*.py")) if p.stem != "__init__"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in a directed graph, as a list of nodes, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_api_has_no_import_cycle():
    modules = package_modules("api")
    graph = {name: {m for m in imported_modules(path) if m in modules} for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"api/ import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", sorted(package_modules("api")))
def test_api_reaches_the_engine_only_through_its_facade(module):
    path = package_modules("api")[module]
    internal = sorted(m for m in imported_modules(path)
                      if any(m == x or m.startswith(x + ".") for x in ENGINE_INTERNALS))  # step_faults is not step
    assert not internal, f"{module} imports engine internals {internal}; use ferrox_jax.engine / request"


@pytest.mark.parametrize("package,forbidden", [("ferrox_jax", ("api",)), ("models", ("api", "ferrox_jax"))])
def test_imports_flow_one_way(package, forbidden):
    for module, path in package_modules(package).items():
        bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in forbidden)
        assert not bad, f"{module} imports {bad}: imports flow api -> ferrox_jax -> models"


def test_scheduler_side_never_imports_jax_or_llguidance():
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in JAX_FREE)
            + "print(sorted(m for m in sys.modules if m in ('jax', 'llguidance')\n"
            + "             or m.startswith(('jax.', 'jaxlib', 'flax', 'llguidance.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing {JAX_FREE} pulled in {out.stdout.strip()}"
