"""The docs cite tests by pytest node id (tests/test_x.py::test_name): each must exist,
so that a renamed or moved test cannot leave a claim in the docs without its evidence."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"(tests/test_\w+\.py)::(test_\w+)")


def test_every_test_the_docs_cite_exists():
    cited = [
        (doc.relative_to(ROOT), *m.groups())
        for doc in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
        for m in CITATION.finditer(doc.read_text(encoding="utf-8"))
    ]
    assert len(cited) > 100  # errors.md alone cites more: a broken pattern would pass vacuously
    missing = [
        (str(doc), f"{file}::{name}")
        for doc, file, name in cited
        if not (ROOT / file).is_file()
        or not re.search(rf"^def {name}\(", (ROOT / file).read_text(encoding="utf-8"), re.M)
    ]
    assert not missing, missing


def test_the_docs_cite_tests_by_node_id_only():
    """A bare `module::test` citation (the form before the tests were split) names no file."""
    stale = [
        (doc.name, m.group())
        for doc in sorted((ROOT / "docs").rglob("*.md"))
        for m in re.finditer(r"(?<![\w/.])[a-z_]+::(test_\w+|\.\.\.)", doc.read_text(encoding="utf-8"))
    ]
    assert not stale, stale


def _inventory_rows() -> tuple[list[str], list[str]]:
    """(numbered rows, other rows) of the tables in docs/reference/errors.md's Inventory."""
    text = (ROOT / "docs" / "reference" / "errors.md").read_text(encoding="utf-8")
    inventory = text[text.index("## Inventory") : text.index("\n## ", text.index("## Inventory") + 1)]
    lines = inventory.splitlines()
    rows = [
        line
        for i, line in enumerate(lines)
        if line.startswith("| ")
        and not re.match(r"\|[-: |]+\|$", line)
        and not (i + 1 < len(lines) and re.match(r"\|[-: |]+\|$", lines[i + 1]))
    ]  # a header is followed by |---|
    numbered = [row for row in rows if re.match(r"\| \d+[a-z]? \|", row)]
    return numbered, [row for row in rows if row not in numbered]


def test_the_error_inventory_states_its_own_count_and_numbers_each_case_once():
    numbered, other = _inventory_rows()
    ids = [row.split("|")[1].strip() for row in numbered]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    stated = re.search(
        r"\*\*(\d+) documented cases\*\*, (\d+) numbered\s+bad inputs and (\d+) other",
        (ROOT / "docs" / "reference" / "errors.md").read_text(encoding="utf-8"),
    )
    assert stated and tuple(map(int, stated.groups())) == (len(numbered) + len(other), len(numbered), len(other))


def test_the_license_is_the_spdx_string_setuptools_builds_without_a_deprecation_warning():
    """`make demo` printed setuptools' warning (with a date after which builds break) for the TOML-table form."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT" and project["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in project["build-system"]["requires"]
