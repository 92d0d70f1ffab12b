"""The package's layers: cli → jobs → (artifact, artifact_format, provenance, models, hub, checkpoints, zoo) →
(method | data | recipes) → (errors, files, devices, environment). Nothing imports a layer above its own, and
method/ and data/ do not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import cafa_cli

ROOT = Path(cafa_cli.__file__).parent
LAYERS = {
    "cli": 4,
    "jobs": 3,
    "artifact": 2,
    "artifact_format": 2,
    "provenance": 2,
    "models": 2,
    "hub": 2,
    "checkpoints": 2,
    "zoo": 2,
    "method": 1,
    "data": 1,
    "recipes": 1,
    "errors": 0,
    "files": 0,
    "factories": 0,
    "devices": 0,
    "environment": 0,
    "numbers": 0,
    "interrupts": 0,
    "__init__": 0,
    "__main__": 5,
}


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cafa_cli"):
            found |= {f"{node.module}.{a.name}" if node.module == "cafa_cli" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("cafa_cli")}
    return found


def test_nothing_imports_a_layer_above_its_own():
    climbing = []
    for path in ROOT.rglob("*.py"):
        module = "cafa_cli." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        room = _room(module)
        for target in _imports(path):
            other = _room(target)
            if other in ("__version__", "DEFAULT_ARTIFACT"):  # the package's own constants
                continue
            if LAYERS[other] > LAYERS[room] or {room, other} == {"method", "data"}:
                climbing.append(f"{module} imports {target}")
    assert not climbing, climbing
