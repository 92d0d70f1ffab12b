"""Small text inputs (a recipe, cafa.toml and pyproject.toml, `classes` and `class_subset`
lists, `subset` lists, DomainNet-126's lists) are read only when they are regular files
under a size limit (files.read_small_text): a FIFO, a folder, a link to /dev/zero, a sparse
file over the limit or a file that is not UTF-8 each get one line naming the file and the
fix, at once, without hanging or reading on.

Every reader runs guarded: the CLI in a child process with a timeout and a memory limit,
the direct calls in a thread with a timeout (a blocked open() of a FIFO is let go by
opening its other end), so that a regression fails here instead of hanging the suite."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import fails

from cafa_cli.cli.defaults import CONFIG_LIMIT
from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.core.files import read_small_text
from cafa_cli.data.domain import CLASS_LIST_LIMIT, read_class_list
from cafa_cli.data.domain_sets import DOMAIN_LIST_LIMIT
from cafa_cli.data.sources import open_domain
from cafa_cli.data.subsets import SUBSET_LIMIT, read_image_ids
from cafa_cli.methods.recipes import RECIPE_LIMIT

TIMEOUT = 30  # seconds; each refusal takes milliseconds, the child's start well under a second
MEMORY = 2 << 30  # the child's address space: reading on from /dev/zero fails with MemoryError, not the host

SPELLINGS = ("fifo", "folder", "dev-zero", "sparse", "not-utf8")
# what each spelling's one line says
PROBLEM = {
    "fifo": "not a regular file",
    "folder": "not a regular file",
    "dev-zero": "not a regular file",
    "sparse": "over the limit of",
    "not-utf8": "not a UTF-8 text file",
}


def plant(path: Path, spelling: str, limit: int) -> Path:
    """`path` made the hostile file `spelling` names (for a reader whose limit is `limit`)."""
    if spelling == "fifo":
        os.mkfifo(path)
    elif spelling == "folder":
        path.mkdir()
    elif spelling == "dev-zero":
        path.symlink_to("/dev/zero")
    elif spelling == "sparse":  # limit + 1 bytes of NULs, none of them on the disk
        with open(path, "wb") as file:
            file.truncate(limit + 1)
    else:
        path.write_bytes("[eata]\nsource = 'café'\n".encode("latin-1"))
    return path


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def cafa(*args, cwd: Path, bounded: bool = True):
    """`cafa ARGS` through the real entry point (which reads cafa.toml) in a child process,
    as a CliRunner result for `fails`: a hang is a timeout, growth a MemoryError, both failures."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cafa_cli", *map(str, args)],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            preexec_fn=_bounded if bounded else None,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"cafa {' '.join(map(str, args))} still ran after {TIMEOUT} s")
    return SimpleNamespace(exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr, exception=None)


def refused(error: type, call, *needles: str, release: Path | None = None) -> str:
    """The one-line `error` that call() raises within TIMEOUT seconds, holding every needle."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as raised:  # noqa: BLE001 - handed to the test's thread
            outcome["raised"] = raised

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    if thread.is_alive():
        if release is not None and release.exists():  # a reader blocked in open(): give it a writer, which closes
            os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"still reading after {TIMEOUT} s")
    raised = outcome.get("raised")
    assert isinstance(raised, error), f"no {error.__name__}: {outcome.get('value', raised)!r}"[:500]
    message = str(raised)
    assert "\n" not in message and "; " in message, message[:500]
    for needle in needles:
        assert needle in message, (needle, message[:500])
    return message


# --- the recipe (`--recipe FILE.toml`): exit 3 --------------------------------


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_recipe_that_is_no_small_regular_file_is_refused_at_once(tmp_path, spelling):
    recipe = plant(tmp_path / "r.toml", spelling, RECIPE_LIMIT)
    fails(
        cafa("methods", "eata", "--recipe", recipe, cwd=tmp_path),
        3,
        f"--recipe {recipe}: ",
        PROBLEM[spelling],
        "give a UTF-8 TOML file of method tables",
    )


def test_adapt_refuses_a_fifo_recipe_before_anything_else(tmp_path):
    """The hang the issue found: `cafa adapt ... --recipe FIFO` waited for a writer for ever.
    (No memory limit here: adapt imports torch, which maps more than the limit.)"""
    recipe = plant(tmp_path / "r.toml", "fifo", RECIPE_LIMIT)
    fails(cafa("adapt", "--data", "nowhere", "--recipe", recipe, cwd=tmp_path, bounded=False), 3, "not a regular file")


# --- cafa.toml and [tool.cafa] in pyproject.toml: exit 2, before every command --


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("name", ["cafa.toml", "pyproject.toml"])
def test_a_defaults_file_that_is_no_small_regular_file_is_refused_at_once(tmp_path, spelling, name):
    config = plant(tmp_path / name, spelling, CONFIG_LIMIT)
    fails(cafa("methods", cwd=tmp_path), 2, f"{config}: ", PROBLEM[spelling], "fix it, or move it away")


def test_a_defaults_file_under_its_limit_is_read(tmp_path):
    (tmp_path / "cafa.toml").write_text("[adapt]\nbogus = 1\n" + "#" * (CONFIG_LIMIT - 100) + "\n")
    fails(cafa("methods", cwd=tmp_path), 2, "[adapt] has no option 'bogus'")


# --- `classes` and `class_subset`: exit 3 --------------------------------------


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("setting", ["classes", "class_subset"])
def test_a_class_list_that_is_no_small_regular_file_is_refused_at_once(tmp_path, spelling, setting):
    path = plant(tmp_path / "classes.txt", spelling, CLASS_LIST_LIMIT)
    refused(
        InputError,
        lambda: read_class_list(str(path), setting),
        f"`{setting}` {path}: ",
        PROBLEM[spelling],
        release=path,
    )


# --- `subset`: exit 3 ----------------------------------------------------------


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_subset_list_that_is_no_small_regular_file_is_refused_at_once(tmp_path, spelling):
    path = plant(tmp_path / "ids.txt", spelling, SUBSET_LIMIT)
    refused(InputError, lambda: read_image_ids(str(path)), f"`subset` {path}: ", PROBLEM[spelling], release=path)


# --- DomainNet-126's ROOT/<domain>_list.txt: exit 3 ----------------------------


@pytest.mark.parametrize("spelling", [*SPELLINGS, "dangling-link"])
def test_a_domainnet_list_that_is_no_small_regular_file_is_refused_not_passed_over(tmp_path, spelling):
    """Not "put the benchmark's clipart_list.txt in ROOT" while one is there: what is wrong with it."""
    root = tmp_path / "domainnet"
    (root / "clipart" / "cello").mkdir(parents=True)
    listed = root / "clipart_list.txt"
    if spelling == "dangling-link":
        listed.symlink_to(root / "gone.txt")
    else:
        plant(listed, spelling, DOMAIN_LIST_LIMIT)
    problem = "a symbolic link that leads nowhere" if spelling == "dangling-link" else PROBLEM[spelling]
    message = refused(
        InputError, lambda: open_domain(f"domainnet126:{root / 'clipart'}"), f"{listed}: ", problem, release=listed
    )
    assert "give the benchmark's list of clipart's images" in message


# --- read_small_text itself ------------------------------------------------------


def test_the_limit_is_inclusive_and_a_size_that_lies_is_read_no_further(tmp_path, monkeypatch):
    path = tmp_path / "list.txt"
    path.write_bytes(b"\xef\xbb\xbf" + b"a" * 13)  # 16 bytes, a byte-order mark first
    assert read_small_text(path, "`x`", 16, "fix") == "a" * 13
    path.write_bytes(b"a" * 17)
    refused(InputError, lambda: read_small_text(path, "`x`", 16, "fix"), f"`x` {path}: 17 bytes, over the limit")
    # a kernel file says it holds 0 bytes and holds more: the reading stops at limit + 1
    maps = Path("/proc/self/maps")
    if not maps.exists() or maps.stat().st_size:
        pytest.skip("needs a /proc whose files report size 0")
    message = refused(UsageError, lambda: read_small_text(maps, "", 16, "fix", error=UsageError), "more than the limit")
    assert message.startswith(f"{maps}: ")


def test_each_problem_names_the_file_and_the_fix_in_the_callers_error(tmp_path):
    assert "no such file; fix" in refused(
        UsageError, lambda: read_small_text(tmp_path / "no", "", 9, "fix", error=UsageError)
    )
    (tmp_path / "link").symlink_to(tmp_path / "no")
    assert "a symbolic link that leads nowhere; fix" in refused(
        InputError, lambda: read_small_text(tmp_path / "link", "`y`", 9, "fix")
    )
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked"
        locked.write_text("x")
        locked.chmod(0)
        refused(InputError, lambda: read_small_text(locked, "`y`", 9, "fix"), "cannot read it (Permission denied); fix")
