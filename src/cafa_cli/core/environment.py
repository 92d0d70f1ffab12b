"""What a result was computed with, recorded beside it so that a table can be rerun exactly:
the code (its version, and its commit when it runs from a checkout), torch's build and the
settings of this process that change its numbers. ROID's predictions, for one, change with
the intra-op thread count, and torch's package version reads "2.14.1" for a CPU and a CUDA
build alike."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from cafa_cli import __version__

if TYPE_CHECKING:
    import torch

PACKAGE = Path(__file__).resolve().parents[1]  # cafa_cli/
GIT_SECONDS = 5  # git on a slow or huge checkout: the record goes without the commit, the run does not wait


def environment(device: str | torch.device) -> dict:
    """The block every metrics, bench and plot JSON, an export's and an artifact's metadata
    record as `environment`. `device`: the one the run resolved to."""
    import torch  # here: the command line imports this module and starts without torch (its help)

    device = torch.device(device)
    commit = source_commit()
    return {
        "cafa": __version__,
        **({"commit": commit} if commit else {}),
        "python": platform.python_version(),
        "torch": torch.__version__,  # with its local part (+cpu, +cu130) where the build has one
        "torch_cuda": torch.version.cuda,  # null: a CPU build
        "torchvision": version("torchvision"),  # read, not imported: no run needs to import it
        "threads": torch.get_num_threads(),
        "device": str(device),
        **({"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}),
        # which of torch's CPU kernels run (AVX2, AVX512...): their sums round differently
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


@functools.cache
def source_commit() -> str | None:
    """`git describe --always --dirty` of the checkout this package runs from (the full
    commit, `-dirty` with uncommitted changes to tracked files), or None when it runs from
    an installed copy: no checkout, git missing or slow, or a package inside a repository
    that does not track it (a virtual environment within a checkout)."""
    # a GIT_DIR or GIT_WORK_TREE in the environment (a hook's) would name another repository
    clean = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", *args], cwd=PACKAGE, env=clean, capture_output=True, text=True, timeout=GIT_SECONDS
        )

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return None
        described = git("describe", "--always", "--dirty", "--abbrev=40")
    except (OSError, subprocess.SubprocessError):
        return None
    return (described.stdout.strip() or None) if described.returncode == 0 else None
