"""The measured outputs under docs/results/ in the site: mkdocs.yml's `not_in_nav` names them.

The results pages link each table's raw outputs (JSON, CSV, the benches' Markdown tables, figures),
file by file or a folder at a time (`margin/`, which GitHub shows as a folder). In the site a Markdown
table renders as a page of its own, titled by its path and left out of the search (some 400 tables of
numbers would bury the pages in it); every folder of outputs gets a generated listing, and a link to
the folder is pointed at that listing, so that both kinds of link resolve and `mkdocs build --strict`
checks them.
"""

from __future__ import annotations

import posixpath
import re

from mkdocs.structure.files import File, Files, InclusionLevel

SECTION = "results"
FOLDER_LINK = re.compile(r"\]\(([^()\s#:]+/)\)")  # ](margin/) or ](../results/wide/): a relative link to a folder
_listings: set[str] = set()  # the src_uri of each generated listing


def _is_output(file: File) -> bool:
    return file.src_uri.startswith(SECTION + "/") and file.inclusion.is_not_in_nav()


def _listing(folder: str, names: set[str]) -> str:
    up = "../" * folder.count("/")
    lines = [f"# {folder}/", "", f"Measured outputs; the [results pages]({up}index.md) say what ran them.", ""]
    lines += [f"- [{name}]({name}index.md)" if name.endswith("/") else f"- [{name}]({name})" for name in sorted(names)]
    return "\n".join(lines) + "\n"


def on_files(files: Files, config) -> Files:
    contents: dict[str, set[str]] = {}  # folder → the names in it, a subfolder's with a trailing /
    for file in list(files):
        if _is_output(file):
            folder, name = posixpath.split(file.src_uri)
            while folder != SECTION:
                contents.setdefault(folder, set()).add(name)
                folder, name = posixpath.dirname(folder), posixpath.basename(folder) + "/"
    _listings.clear()
    for folder, names in contents.items():
        uri = f"{folder}/index.md"
        files.append(File.generated(config, uri, content=_listing(folder, names), inclusion=InclusionLevel.NOT_IN_NAV))
        _listings.add(uri)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    here = posixpath.dirname(page.file.src_uri)

    def to_listing(link: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(here, link.group(1)))
        return f"]({link.group(1)}index.md)" if f"{target}/index.md" in _listings else link.group(0)

    markdown = FOLDER_LINK.sub(to_listing, markdown)
    if _is_output(page.file):
        page.meta["search"] = {"exclude": True}
        if page.file.src_uri not in _listings:
            markdown = f"# {page.file.src_uri}\n\n{markdown}"
    return markdown
