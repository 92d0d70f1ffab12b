"""Open one data value, whatever its kind, as a `Domain`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.core.files import reading_images
from cafa_cli.data.arrays import TRAINING_SETS, _array_domain
from cafa_cli.data.benchmarks import BENCHMARKS, benchmark_of, on_disk_benchmark, open_benchmark, stages_of
from cafa_cli.data.domain import Domain, relabel
from cafa_cli.data.folders import _folder_domain, _stdin_domain


def open_domain(
    spec: str,
    class_names: Sequence[str] | None = None,
    labels: str | None = None,
    severity: int | None = None,
    stdin=None,
    option: str = "data",
) -> Domain:
    """Open one `--data` value (or one of another option that takes the same values, named
    by `option` in errors: `clean`, `source_data`, `forgetting`, `train`).

    `class_names`, when given, is the model's output order (from `--classes` or the
    artifact); labels are mapped into it by name. Without it, an image folder's
    sorted folder names become the class list. None of its images may be one of the
    command's outputs, however they are reached (files.reading_images).
    """
    try:
        domain = _open(spec, class_names, labels, severity, stdin, option)
    except InputError as error:  # what the folder and array readers find, named by the option that gave them
        if option == "data" or not str(error).startswith("`data` "):
            raise
        raise InputError(f"`{option}` {str(error).removeprefix('`data` ')}") from None
    reading_images(domain.refs, f"`{option}` {spec}")
    return domain


def _open(spec, class_names, labels, severity, stdin, option) -> Domain:
    if benchmark_of(spec) is not None:
        domain = open_benchmark(spec, labels, severity)
        return domain if class_names is None else relabel(domain, list(class_names))
    is_array = Path(spec).suffix.lower() == ".npy"
    if labels is not None and not is_array:
        raise UsageError(
            f"`labels` is only for .npy arrays, and `data` {spec} is not one; image folders take labels from class "
            "folders"
        )
    if severity is not None and not is_array:
        raise UsageError(
            "`severity` is only for .npy arrays that stack 5 severities (CIFAR-10-C) and the named benchmarks "
            "(imagenet-c:ROOT, "
            "cifar10-c:ROOT); for an image folder, give the folder of one severity as `data`"
        )
    kind, _, root = spec.partition(":")
    if kind in TRAINING_SETS and (root or not Path(spec).exists()):
        domain = TRAINING_SETS[kind](Path(root) if root else None)
    elif spec == "-":
        domain = _stdin_domain(stdin if stdin is not None else sys.stdin)
    else:
        path = Path(spec)
        if not path.exists():
            raise InputError(f"`{option}` {spec}: no such file or folder")
        if path.is_dir():
            domain = _folder_domain(path)
        elif path.suffix.lower() == ".npy":
            domain = _array_domain(path, labels, severity)
        else:
            raise InputError(
                f"`{option}` {spec}: expected an image folder, a .npy array, '-' (paths on stdin) "
                f"or one of {', '.join(k + ':ROOT' for k in [*TRAINING_SETS, *BENCHMARKS])}"
            )
    if class_names is not None:
        domain = relabel(domain, list(class_names))
    return domain


def on_disk(spec: str) -> str:
    """Where a --data value lies in the file system: ROOT for `cifar10:ROOT` and the like."""
    kind, _, root = spec.partition(":")
    return root if kind in TRAINING_SETS and root else on_disk_benchmark(spec) or spec


# the severities a corruption is visited in by `gradual`: up from 1 to 5 and back, as in
# CoTTA (Wang et al., CVPR 2022) and the test-time-adaptation benchmark's "gradual" setting
GRADUAL_SEVERITIES = (1, 2, 3, 4, 5, 4, 3, 2, 1)


def gradual_stages(spec: str) -> list[str]:
    """The severity folders of one corruption in the gradual order. `spec` is the corruption
    folder (`fog`, holding fog/1 ... fog/5) or one of its severities (`fog/3`)."""
    path = Path(stages_of(spec))
    corruption = path.parent if path.name.isdigit() and path.parent != path else path
    missing = [str(corruption / str(s)) for s in sorted(set(GRADUAL_SEVERITIES)) if not (corruption / str(s)).is_dir()]
    if missing:
        raise InputError(
            f"`data` {spec}: `gradual` visits severities 1-5 of a corruption, which needs the corruption/severity "
            f"layout, and {', '.join(missing)} {'is not a folder' if len(missing) == 1 else 'are not folders'}; "
            f"build every severity (cafa demo --data-only --severities 1,2,3,4,5), or drop `gradual`"
        )
    return [str(corruption / str(s)) for s in GRADUAL_SEVERITIES]
