"""The docs cite tests by pytest node id (tests/test_x.py::test_name): each must exist,
so that a renamed or moved test cannot leave a claim in the docs without its evidence."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"(tests/test_\w+\.py)::(test_\w+)")


def test_every_test_the_docs_cite_exists():
    cited = [(doc.relative_to(ROOT), *m.groups()) for doc in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
             for m in CITATION.finditer(doc.read_text(encoding="utf-8"))]
    assert len(cited) > 100  # errors.md alone cites more: a broken pattern would pass vacuously
    missing = [(str(doc), f"{file}::{name}") for doc, file, name in cited
               if not (ROOT / file).is_file() or not re.search(rf"^def {name}\(", (ROOT / file).read_text(encoding="utf-8"), re.M)]
    assert not missing, missing


def test_the_docs_cite_tests_by_node_id_only():
    """A bare `module::test` citation (the form before the tests were split) names no file."""
    stale = [(doc.name, m.group()) for doc in sorted((ROOT / "docs").rglob("*.md"))
             for m in re.finditer(r"(?<![\w/.])[a-z_]+::(test_\w+|\.\.\.)", doc.read_text(encoding="utf-8"))]
    assert not stale, stale
