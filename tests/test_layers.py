"""The package's floors, from the top: cli → jobs → methods → (engine | artifact) → model →
(data | statistics) → core. A module imports its own package and the floors below it, never a
neighbour on its own floor; and no two modules import each other, however indirectly, not even
inside a function or for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import cafa_cli

ROOT = Path(cafa_cli.__file__).parent
FLOORS = {
    "__main__": 8,
    "api": 7,
    "cli": 7,
    "jobs": 6,
    "methods": 5,
    "engine": 4,
    "artifact": 4,
    "model": 3,
    "data": 2,
    "statistics": 2,
    "core": 1,
    "__init__": 0,
}


def _modules() -> dict[str, Path]:
    return {"cafa_cli." + ".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in ROOT.rglob("*.py")}


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: Path) -> set[str]:
    """The cafa_cli modules `path` imports, anywhere in it (inside a function, for type checking)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cafa_cli"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("cafa_cli")}
    return found


def test_nothing_imports_a_floor_above_its_own_or_a_neighbour_on_it():
    wrong = []
    for module, path in _modules().items():
        here = _package(module)
        for target in _imports(path):
            there = _package(target)
            if there in ("__version__", "DEFAULT_ARTIFACT"):  # the package's own constants
                continue
            if FLOORS[there] > FLOORS[here] or (FLOORS[there] == FLOORS[here] and there != here):
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_no_modules_import_each_other():
    modules = _modules()

    def run_by(target: str) -> set[str]:  # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
        parts = target.split(".")
        named = {".".join(parts[:k]) for k in range(2, len(parts) + 1)}
        return {m for m in named | {f"{n}.__init__" for n in named} if m in modules}

    def own_packages(module: str) -> set[str]:  # already being imported when `module` runs
        parts = module.split(".")
        return {".".join(parts[:k]) + ".__init__" for k in range(2, len(parts))}

    graph = {m: set().union(*map(run_by, _imports(p))) - {m} - own_packages(m) for m, p in modules.items()}
    done, on_path, loops = set(), [], []

    def visit(module):
        if module in on_path:
            loops.append(on_path[on_path.index(module) :] + [module])
            return
        if module in done:
            return
        on_path.append(module)
        for target in graph[module]:
            visit(target)
        on_path.pop()
        done.add(module)

    for module in graph:
        visit(module)
    assert not loops, loops


def test_each_package_says_what_it_holds():
    for package in ROOT.glob("*/__init__.py"):
        assert ast.get_docstring(ast.parse(package.read_text())), f"{package.parent.name}/__init__.py has no docstring"
