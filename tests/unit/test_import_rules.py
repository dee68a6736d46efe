"""The package's import rules, read from the source (ast) without importing anything.

1. The layers (`collective`, `recovery`, `policy`) import nothing of megatron-core (`megatron`),
   of the glue (`megatron_recover.megatron`), or of the entry points (`launch`, `launch_cli`,
   `relaunch`, `runtime`, `cli`): layers import downward only.
2. `megatron_recover.policy` imports neither torch nor mpi4py: it stays pure Python, so it can be
   tested exhaustively without a process group.
3. No import cycle among the package's modules.
4. The round core and its checks: the registered checks (`recovery/checks/`) import neither the
   round core (`recovery.round`) nor the trainer (the core hands itself to their hooks), and the
   core imports no particular check, only their protocol (`checks.base`): a new check is a new
   module and one line of the registry.
5. The glue's subpackages import downward only, in the order data, adapters, config,
   persistence, app (the application on top), and `adapters/hooks.py`, which patched
   megatron-core imports, imports nothing of megatron-core or of ours.

Every import statement counts: at module level, inside functions, under `if TYPE_CHECKING:`, and
relative ones. `from pkg import name` imports the module `pkg.name` when there is one, else `pkg`;
a package's `__init__` re-exports are edges from the package. A failure names the file, the line
and the import.

Run: `.venv/bin/python -m pytest -p no:cacheprovider tests/unit/test_import_rules.py` (CPU only,
about a second; needs neither MPI nor torch).
"""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_recover"

LAYERS = ("megatron_recover.collective", "megatron_recover.recovery", "megatron_recover.policy")
ABOVE_THE_LAYERS = ("megatron", "megatron_recover.megatron", "megatron_recover.launch",
                    "megatron_recover.launch_cli", "megatron_recover.relaunch",
                    "megatron_recover.runtime", "megatron_recover.cli")
PURE_PYTHON = ("megatron_recover.policy",)
NOT_IN_PURE_PYTHON = ("torch", "mpi4py")
# Modules compiled by `make build` (scripts/build_ulfm_backend.py): no .py file, imports none of
# ours. Named here so `from megatron_recover.collective import _ulfm_backend` counts as importing
# that module, not its package, whether or not it has been built.
COMPILED = ("megatron_recover.collective._ulfm_backend",)


@dataclass(frozen=True)
class Import:
    """One module that one import statement imports."""

    file: str  # relative to the checkout
    line: int
    statement: str  # as written, on one line
    module: str  # absolute name of what it imports

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.statement}"


def package_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package under `root` (a package is its
    __init__.py)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, relative levels resolved."""
    if not node.level:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(module: str, modules: dict[str, Path], root: Path) -> list[Import]:
    """Every module that `module`'s file imports, wherever the statement stands, in line order."""
    path = modules[module]
    source = path.read_text()
    known = {*modules, *COMPILED}
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                     for alias in node.names]
        else:
            continue
        statement = " ".join(ast.get_source_segment(source, node).split())
        statement = statement.replace("( ", "(").replace(", )", ")")
        found += [Import(str(path.relative_to(root)), node.lineno, statement, name)
                  for name in dict.fromkeys(names)]
    return sorted(found, key=lambda i: i.line)  # ast.walk goes breadth-first


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(importers: tuple[str, ...], forbidden: tuple[str, ...],
               root: Path = REPO) -> list[str]:
    """Each import of a module in `forbidden` by a module in `importers`, as file:line: import."""
    modules = package_modules(root)
    return [f"{imp}  (imports {imp.module})"
            for module in modules if _within(module, importers)
            for imp in imports_of(module, modules, root) if _within(imp.module, forbidden)]


def import_graph(root: Path = REPO) -> dict[str, dict[str, Import]]:
    """Module -> {module of the package it imports: the first statement that does}."""
    modules = package_modules(root)
    edges: dict[str, dict[str, Import]] = {}
    for module in modules:
        edges[module] = {}
        for imp in imports_of(module, modules, root):
            if imp.module in modules and imp.module != module:
                edges[module].setdefault(imp.module, imp)
    return edges


def _reachable(edges: dict[str, dict[str, Import]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others (itself only through a cycle)."""
    seen, todo = set(), [start]
    while todo:
        for target in edges[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _a_cycle(edges: dict[str, dict[str, Import]], start: str) -> list[str]:
    """A shortest cycle through `start` (which lies on one), first module again at the end."""
    came_from, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for module in frontier:
            for target in sorted(edges[module]):
                if target == start:
                    cycle = [module]
                    while came_from[cycle[-1]] is not None:
                        cycle.append(came_from[cycle[-1]])
                    return cycle[::-1] + [start]
                if target not in came_from:
                    came_from[target] = module
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"{start} lies on no cycle")


def find_cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (a strongly connected component),
    each as its modules in import order with the first again at the end."""
    reach = {module: _reachable(edges, module) for module in edges}
    cycles, placed = [], set()
    for module in sorted(edges):
        if module in reach[module] and module not in placed:
            placed |= {m for m in reach[module] if module in reach[m]}
            cycles.append(_a_cycle(edges, module))
    return cycles


def test_layers_import_nothing_above_them():
    bad = violations(LAYERS, ABOVE_THE_LAYERS)
    assert not bad, ("a layer (collective, recovery, policy) imports megatron-core, the glue or "
                     "an entry point; layers import downward only:\n" + "\n".join(bad))


def test_policy_is_pure_python():
    bad = violations(PURE_PYTHON, NOT_IN_PURE_PYTHON)
    assert not bad, ("the policy imports torch or mpi4py; it must stay pure Python:\n"
                     + "\n".join(bad))


def test_no_import_cycle():
    edges = import_graph()
    report = ["import cycle: " + " -> ".join(cycle) + "".join(
        f"\n  {edges[a][b]}" for a, b in zip(cycle, cycle[1:])) for cycle in find_cycles(edges)]
    assert not report, "\n".join(report)


CHECKS = ("megatron_recover.recovery.checks",)
CORE = ("megatron_recover.recovery.round",)


def test_checks_import_neither_the_core_nor_the_trainer():
    bad = violations(CHECKS, CORE + ("megatron_recover.recovery.trainer",))
    assert not bad, ("a registered check imports the round core or the trainer; the core hands "
                     "itself to the check's hooks:\n" + "\n".join(bad))


def test_the_core_knows_the_checks_protocol_only():
    particular = {m for m in package_modules(REPO) if _within(m, CHECKS)} - {
        "megatron_recover.recovery.checks", "megatron_recover.recovery.checks.base"}
    assert particular, "no registered check found"
    bad = [bad for bad in violations(CORE, tuple(particular))
           if bad.split("(imports ")[1].rstrip(")") in particular]
    assert not bad, ("the round core imports a particular check; it consults the registered "
                     "ones through checks.base only:\n" + "\n".join(bad))


GLUE_ORDER = tuple(f"megatron_recover.megatron.{sub}"
                   for sub in ("data", "adapters", "config", "persistence", "app"))
HOOKS = "megatron_recover.megatron.adapters.hooks"


def test_the_glue_subpackages_import_downward_only():
    modules = package_modules(REPO)
    for sub in GLUE_ORDER:
        assert any(_within(m, (sub,)) for m in modules), f"{sub} holds no module"
    bad = [line for i, sub in enumerate(GLUE_ORDER)
           for line in violations((sub,), GLUE_ORDER[i + 1:])]
    assert not bad, ("a subpackage of the glue imports one above it (order: "
                     + ", ".join(s.rpartition(".")[2] for s in GLUE_ORDER) + "):\n"
                     + "\n".join(bad))
    unplaced = [m for m in modules if _within(m, ("megatron_recover.megatron",))
                and m != "megatron_recover.megatron" and not _within(m, GLUE_ORDER)]
    assert not unplaced, f"glue modules outside the subpackages: {unplaced}"


def test_the_hooks_import_nothing_of_megatron_or_ours():
    modules = package_modules(REPO)
    bad = [str(i) for i in imports_of(HOOKS, modules, REPO)
           if _within(i.module, ("megatron", PACKAGE))]
    assert not bad, "the hooks patched megatron-core imports must import neither:\n" + "\n".join(bad)


def test_the_rules_see_every_kind_of_import(tmp_path):
    """The checks cannot pass by overlooking an import: a function-level, a relative, a
    TYPE_CHECKING and a re-exporting one each count, and a cycle through them is found."""
    recovery = tmp_path / PACKAGE / "recovery"
    recovery.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "megatron.py").write_text("")
    (recovery / "__init__.py").write_text("from megatron_recover.recovery.b import x\n")
    (recovery / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from megatron_recover.runtime import Context\n"
        "def f():\n"
        "    from .. import megatron\n"
        "    import megatron.core\n")
    (recovery / "b.py").write_text("from . import a\nfrom . import x\n")
    modules = package_modules(tmp_path)
    assert [(i.line, i.module) for i in imports_of("megatron_recover.recovery.a", modules,
                                                    tmp_path)] == [
        (1, "typing"), (3, "megatron_recover.runtime"), (5, "megatron_recover.megatron"),
        (6, "megatron.core")]
    assert [i.module for i in imports_of("megatron_recover.recovery.b", modules, tmp_path)] == [
        "megatron_recover.recovery.a", "megatron_recover.recovery"]
    assert len(violations(LAYERS, ABOVE_THE_LAYERS, tmp_path)) == 3
    assert find_cycles(import_graph(tmp_path)) == [
        ["megatron_recover.recovery", "megatron_recover.recovery.b", "megatron_recover.recovery"]]
