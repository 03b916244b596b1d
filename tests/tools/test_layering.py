"""The architecture's rules, checked from the source: the source of truth that
docs/architecture.md ("Rules") quotes. They fail the day a shortcut lands.

1. Imports are an allowlist per package (`ALLOWED`): `api` -> the engine's facade
   (`ferrox_jax.engine`, taking only the names in its `__all__`) and the plain data of jobs
   and output constraints (`ferrox_jax.request`, `ferrox_jax.constraint`); `ferrox_jax` ->
   `models`; `models` -> nothing of ours. Nothing in them imports `tools`, `tests` or `bench`.
2. No import cycle among the modules of api/, ferrox_jax/ and models/, counting imports
   inside functions and under TYPE_CHECKING (the rule of the repository's import-cycle hook:
   a lazy import that closes a circle is still a circle).
3. The scheduler side (`JAX_FREE`) and the CLI's `--help` path import neither jax nor
   llguidance, checked in a fresh interpreter, so a transitive import counts too.
4. The environment is read in one place, `api/settings.py` (each setting a flag and a
   FERROX_* variable); `ENV_READERS` names the few functions that may read it besides, each
   with its reason.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "ferrox_jax", "models")  # the product; each module is checked
OURS = PACKAGES + ("tools", "tests", "bench")  # top-level names an import may reach of ours

# What a module of each package may import of ours: a module named here, or one under it.
ALLOWED = {
    # The facade, and the jax-free data a route builds and reads at import time.
    "api": ("api", "ferrox_jax.engine", "ferrox_jax.request", "ferrox_jax.constraint"),
    "ferrox_jax": ("ferrox_jax", "models"),
    "models": ("models",),
}
FACADE = "ferrox_jax.engine"

JAX_FREE = ("ferrox_jax.scheduler", "ferrox_jax.block_budget", "ferrox_jax.block_tables", "ferrox_jax.prefix_cache",
            "ferrox_jax.batcher", "ferrox_jax.stats", "ferrox_jax.request", "ferrox_jax.constraint", "ferrox_jax.config",
            "ferrox_jax.host_batch", "ferrox_jax.plan", "ferrox_jax.buckets",
            "api.cli")  # `ferrox --help` answers without loading jax

ENV_MODULE = "api.settings"  # the settings table: every flag's FERROX_* variable
ENV_NAMES = ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")
# (module, function) -> why it may read the environment besides the settings table.
ENV_READERS = {
    ("ferrox_jax.grammar_sandbox", "_child_env"):
        "builds the grammar compiler's child process environment: the server's own, this checkout on its path",
    ("ferrox_jax.executable_store", "_xla_flags"):
        "XLA_FLAGS change what XLA compiles, so the executable store's key holds them (as JAX's own cache "
        "key does); not a setting of ours",
    ("models.cpu_isa", "requested"):
        "FERROX_CPU_ISA is read by the kernels' C library as it loads, before any engine or setting exists; "
        "this reads the same value so the check, the start-up log and the store's key agree with the library",
    ("models.cpu_isa", "cap_xla"):
        "hands that cap to XLA's own code generation through XLA_FLAGS, which XLA reads when the backend starts",
    ("models.cpu_kernels", "build"):
        "the kernels' build step (`make`, `python -m models.cpu_kernels`) takes its compiler from CXX, as make "
        "does; the server never calls it",
}


# ---------------------------------------------------------------- reading the source


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    """Every module of api/, ferrox_jax/ and models/ (packages under them included)."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = product_modules()


def parse(module: str) -> ast.Module:
    path = MODULES[module]
    return ast.parse(path.read_text(), filename=str(path))


def written_imports(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module as written, names taken from it) for every import in `module`, at any depth
    (inside functions, under TYPE_CHECKING); relative imports made absolute."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(parse(module)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.append((base, tuple(alias.name for alias in node.names)))
    return out


def known(name: str) -> str | None:
    """The module of ours `name` lies in (its longest prefix that is a module), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def targets(base: str, names: tuple[str, ...]) -> set[str]:
    """What one import reaches of ours: `from pkg import mod` reaches the module `mod`,
    `from mod import name` the module `mod`; names outside the product stay as written."""
    if base.split(".")[0] not in OURS:
        return set()
    submodules = {f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES}
    if submodules and len(submodules) == len(names):
        return submodules
    return submodules | {known(base) or base}


def import_graph() -> dict[str, set[str]]:
    """The repository hook's graph: an edge to every module of ours an import names, the
    package (`__init__`) of a `from package import x` included; a module's own packages left out."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod in MODULES:
        for base, names in written_imports(mod):
            for name in [base] + [f"{base}.{n}" for n in names]:
                found = known(name)
                if found and found != mod and not mod.startswith(found + "."):
                    graph[mod].add(found)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan), each a cycle or
    several sharing nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def facade_exports() -> set[str]:
    """The names `ferrox_jax/engine.py` lists in `__all__`."""
    for node in parse(FACADE).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{FACADE} has no __all__: the facade must declare what the API may take from it")


def environment_reads(module: str) -> set[str]:
    """The functions of `module` (qualified names; "<module>" for top-level code) that
    touch os.environ, os.getenv and the like."""
    reads: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def __init__(self) -> None:
            self.scope: list[str] = []

        def _scoped(self, node: ast.AST) -> None:
            self.scope.append(node.name)
            self.generic_visit(node)
            self.scope.pop()

        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

        def _read(self) -> None:
            reads.add(".".join(self.scope) or "<module>")

        def visit_Attribute(self, node: ast.Attribute) -> None:
            if isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr in ENV_NAMES:
                self._read()
            self.generic_visit(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.module == "os" and any(alias.name in ENV_NAMES for alias in node.names):
                self._read()

    Visitor().visit(parse(module))
    return reads


# ---------------------------------------------------------------- the helpers themselves


def test_find_cycles_finds_each_cycle_and_accepts_a_dag():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert sorted(map(sorted, find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}))) == [["a", "b"], ["c", "d"]]


def test_imports_count_inside_functions_and_under_type_checking():
    """The negative control: api/ names the facade under TYPE_CHECKING and imports it inside
    functions (it pulls in jax); the graph must see both, or a lazy import could hide a cycle."""
    graph = import_graph()
    assert "ferrox_jax.engine_builder" in graph["ferrox_jax.engine"], "a module-level import"
    assert "ferrox_jax.engine" in graph["api.state"], "an import under TYPE_CHECKING"
    assert "ferrox_jax.engine" in graph["api.structured"], "an import inside a function"


def test_environment_reads_are_found_with_their_function():
    assert environment_reads("api.settings") == {"env_defaults"}
    assert ("ferrox_jax.grammar_sandbox", "_child_env") in {(m, f) for m in MODULES for f in environment_reads(m)}


# ---------------------------------------------------------------- the rules


def test_no_import_cycle_in_api_ferrox_jax_or_models():
    cycles = [sorted(c) for c in find_cycles(import_graph())]
    assert not cycles, "import cycles (cut at the concept both sides share, not with a lazy import): " + "; ".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_package_imports_only_what_its_allowlist_names(module):
    allowed = ALLOWED[module.split(".")[0]]
    reached = {t for base, names in written_imports(module) for t in targets(base, names)}
    bad = sorted(t for t in reached if not any(t == a or t.startswith(a + ".") for a in allowed))
    assert not bad, (f"{module} imports {bad}; {module.split('.')[0]}/ may import only {', '.join(allowed)} "
                     "(imports flow api -> ferrox_jax -> models; api/ reaches the engine through ferrox_jax.engine)")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("api.") or m == "api"))
def test_api_takes_from_the_facade_only_what_it_exports(module):
    exports = facade_exports()
    for base, names in written_imports(module):
        if base == FACADE:
            extra = sorted(set(names) - exports)
            assert not extra, f"{module} takes {extra} from {FACADE}, which does not export them (__all__)"
        assert not (base == "ferrox_jax" and "engine" in names), \
            f"{module}: import names from {FACADE} (`from {FACADE} import Engine`), not the module"


def test_the_facade_exports_names_it_has():
    defined = set()
    for node in parse(FACADE).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            defined.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
    assert facade_exports() <= defined, f"__all__ names {sorted(facade_exports() - defined)}, which {FACADE} lacks"


def test_the_environment_is_read_in_one_place():
    found = {(m, f) for m in MODULES if m != ENV_MODULE for f in environment_reads(m)}
    unexpected = sorted(found - set(ENV_READERS))
    assert not unexpected, (f"{unexpected} read the environment: make it a setting (a row of {ENV_MODULE}'s table, "
                            "a field of ServerConfig or EngineConfig) and pass it down")
    assert environment_reads(ENV_MODULE), f"{ENV_MODULE} reads the variables of its table"


def test_scheduler_side_and_help_never_import_jax_or_llguidance():
    code = ("import sys\n"
            + "".join(f"import {m}\n" for m in JAX_FREE)
            + "print(sorted(m for m in sys.modules if m in ('jax', 'llguidance')\n"
            + "             or m.startswith(('jax.', 'jaxlib', 'flax', 'llguidance.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing {JAX_FREE} pulled in {out.stdout.strip()}"
