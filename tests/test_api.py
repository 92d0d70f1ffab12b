"""cafa_cli.api is the Python API that docs/reference/python-api.md documents, no more and no less, and
the docs and benchmarks/ reach cafa through it alone (but for the internals listed below,
which benchmarks measure). Adding a name to the API is its import and `__all__` entry (and its
word in the module docstring's map) in api.py, and its mention in python-api.md's "The names"."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cafa_cli import api

ROOT = Path(__file__).parents[1]
API_DOC = ROOT / "docs" / "reference" / "python-api.md"
PLUGIN_GUIDE = ROOT / "docs" / "guides" / "plugins.md"

# What benchmarks measure of cafa's insides, which no user needs (each import says why, beside it):
# {file: the cafa_cli modules it imports other than cafa_cli.api}
INTERNALS = {
    "perf.py": {
        "cafa_cli.data.loading",  # Batch: the stats pass it times, as cafa stats runs it
        "cafa_cli.statistics.moments",  # accumulate_features: that pass
        "cafa_cli.engine.step_graph",  # WARMUP: the steps before a CUDA graph replays
        "cafa_cli.statistics",  # distances.KEEP_BYTES: the memory budget it varies
        "cafa_cli.model.loading",  # resolve: an untrained architecture to time, which load_model refuses
    },
    "dense_distance.py": {"cafa_cli.statistics"},  # distances.KEEP_BYTES
    "gate_probe.py": {"cafa_cli.engine.class_balanced", "cafa_cli.engine.norms"},  # the skew it probes
    "robust_gate_trace.py": {"cafa_cli.methods.cafa_robust"},  # the gate it traces
    "severity_scan.py": {"cafa_cli.data.fmnist_c"},  # how cafa demo corrupts Fashion-MNIST
    "held_out_transforms.py": {"cafa_cli.data.fmnist_c"},
    "soak.py": {
        "cafa_cli.data.domain",
        "cafa_cli.jobs.adapt.stream",
        "cafa_cli.jobs.config.settings",
    },  # the stream loop it soaks, and its settings
    "stream_orders.py": {"cafa_cli.data.orders"},  # the orders it times
    "protocols_tables.py": {"cafa_cli.jobs.bench"},  # tables.plot_rounds: bench's figure
    "wide_fmnist.py": {"cafa_cli.model.zoo", "cafa_cli.model.zoo.fmnist_resnet"},  # the model it widens
    "bare_loop.py": {"cafa_cli.model.zoo.fmnist_resnet"},  # the bundled architecture, without cafa's loading
    "ccc_table.py": {"cafa_cli.jobs.adapt.prepare"},  # prepare_adaptation: each image's record as the stream goes
    "choose_lr.py": {"cafa_cli.jobs.bench.selection"},  # best: the pick `cafa bench --by held-out` makes
    "method_memory.py": {"cafa_cli.model.clip"},  # the zero-shot head, on a tiny CLIP made without a checkpoint
}


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def backticked_names(text: str) -> set[str]:
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", text))


def cafa_imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names) of every import of cafa_cli in `tree`, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cafa_cli":
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "cafa_cli"]
    return found


def shell_python(path: Path) -> str:
    """The Python a shell script runs from here-documents (`"$PY" - ... <<'EOF'`)."""
    return "\n".join(re.findall(r"<<'?EOF'?\n(.*?)\nEOF", path.read_text(), flags=re.S))


def test_the_names_the_doc_lists_are_the_names_the_api_exports():
    listed = backticked_names(API_DOC.read_text().split("\n## The names\n")[1].split("\n## ")[0])
    exported = set(api.__all__)
    assert not listed - exported, f"python-api.md lists, cafa_cli.api does not export: {sorted(listed - exported)}"
    assert not exported - listed, f"cafa_cli.api exports, python-api.md does not list: {sorted(exported - listed)}"
    assert len(api.__all__) == len(exported), "a name twice in __all__"


def test_every_exported_name_is_on_the_module_docstrings_map():
    assert not set(api.__all__) - backticked_names(api.__doc__)


def test_the_docs_code_imports_cafa_only_from_the_api_and_only_what_it_exports():
    wrong = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in python_blocks(path):
            tree = ast.parse(block, str(path))  # every block at least compiles
            for module, names in cafa_imports(tree):
                if module != "cafa_cli.api" or not set(names) <= set(api.__all__):
                    wrong.append(f"{path.name}: from {module} import {', '.join(names)}")
    assert not wrong, wrong


def test_python_api_md_names_no_module_but_the_api():
    """Its prose too, and the plug-in guide's: `cafa_cli.jobs.adapt.run` became `run_adapt`; files
    (cafa_cli/methods/tent.py) may be named."""
    for doc in (API_DOC, PLUGIN_GUIDE):
        named = re.findall(r"cafa_cli\.(?!api\b)[\w.]+", doc.read_text())
        assert not named, f"{doc.name} names internal modules: {named}"


def test_the_generated_reference_renders_every_exported_name():
    """mkdocstrings renders `::: cafa_cli.api` with `filters: public` (the names in `__all__`) and,
    by default, leaves out an object without a docstring: a new name without one would be missing
    from the site. griffe reads what mkdocstrings reads, attribute docstrings included."""
    griffe = pytest.importorskip("griffe")
    directive = API_DOC.read_text().split("::: cafa_cli.api\n")[1]
    assert "filters: public" in directive.split("\n\n")[0]
    module = griffe.load("cafa_cli.api", search_paths=[str(ROOT / "src")])
    assert not [name for name in api.__all__ if not module[name].docstring]


def test_benchmarks_import_cafa_through_the_api_but_for_the_internals_they_measure():
    internal, unknown = {}, []
    for path in sorted((ROOT / "benchmarks").iterdir()):
        if path.suffix == ".py":
            tree = ast.parse(path.read_text(), str(path))
        elif path.suffix == ".sh":
            tree = ast.parse(shell_python(path), str(path))
        else:
            continue
        for module, names in cafa_imports(tree):
            if module == "cafa_cli.api":
                unknown += [f"{path.name}: {name}" for name in names if name not in api.__all__]
            else:
                internal.setdefault(path.name, set()).add(module)
    assert not unknown, f"not in cafa_cli.api: {unknown}"
    assert internal == INTERNALS  # a new internal import: through the API, or listed here with why
