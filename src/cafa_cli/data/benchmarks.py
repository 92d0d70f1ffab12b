"""The corruption benchmarks by name, as `data` values:

- `imagenet-c:ROOT`: ImageNet-C's folders, ROOT/<corruption>/<severity>/<wnid>/*.JPEG;
- `fashion-mnist-c:ROOT`: the bundled demo's, in the same layout (cafa demo --data-only:
  ROOT is WORKDIR/fashion-mnist-c-N), named apart so that `recipe` auto takes the family
  of its 10 classes, not ImageNet-C's;
- `cifar10-c:ROOT`, `cifar100-c:ROOT`: the .npy stacks, ROOT/<corruption>.npy holding the
  5 severities one after another (5 × 10,000 images) and ROOT/labels.npy.

A ROOT stands for every one of the 15 standard corruptions it holds, one domain each, in the
benchmark's order; `KIND:ROOT/fog` (`fog.npy`) for one of them. `severity` picks the severity
(default 5, the one papers report).

The domain-adaptation benchmarks (`office-home:ROOT`, `domainnet:ROOT`, `domainnet126:ROOT`,
data/domain_sets.py) go the same way: a ROOT stands for its domains, `KIND:ROOT/Art` for one;
they have no severities, and `source` leaves their source domain out.

ImageNet's natural-shift test sets are one domain each, labelled as ImageNet's 1,000 classes:
- `imagenet-v2:ROOT`: ImageNet-V2 (Recht et al., ICML 2019), any of its three sets,
  ROOT/<0..999>/*.jpeg, a folder named by its class's ImageNet output index;
- `imagenet-sketch:ROOT`: ImageNet-Sketch (Wang et al., NeurIPS 2019), ROOT/<wnid>/*.JPEG.
A model's class list for them (and a CLIP model's prompts) is ImageNet's wnids in output
order, `imagenet_classes()`; `recipe` auto takes the imagenet-c family from the 1,000 classes."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np

from cafa_cli.core.errors import InputError, UsageError, listing
from cafa_cli.data.arrays import _array_domain
from cafa_cli.data.domain import UNLABELLED, Domain
from cafa_cli.data.domain_sets import DOMAIN_SETS, domains_in, is_one_domain, open_member, source_domain, targets
from cafa_cli.data.fmnist_c import BENCHMARK_CORRUPTIONS
from cafa_cli.data.folders import _folder_domain

# the 15 corruptions of ImageNet-C (Hendrycks & Dietterich, ICLR 2019), in its tables' order;
# the 4 held out for choosing hyper-parameters are named one by one (`imagenet-c:ROOT/spatter`)
CORRUPTIONS = BENCHMARK_CORRUPTIONS
# corruption/severity folders, stacked arrays, domain folders, one folder of class folders
FOLDERS, ARRAYS, DOMAINS, ONE = "folders", "arrays", "domains", "one"
BENCHMARKS = {
    "imagenet-c": FOLDERS,
    "fashion-mnist-c": FOLDERS,
    "cifar10-c": ARRAYS,
    "cifar100-c": ARRAYS,
    **{kind: DOMAINS for kind in DOMAIN_SETS},
    "imagenet-v2": ONE,
    "imagenet-sketch": ONE,
}
IMAGENET_FAMILY = ("imagenet-c", "imagenet-v2", "imagenet-sketch")  # labelled as ImageNet's 1,000 classes
DEFAULT_SEVERITY = 5


@cache
def imagenet_classes() -> dict[str, str]:
    """ImageNet's wnids, in output order (sorted, as torchvision's ImageNet models number them),
    each with CLIP's cleaned name of its class (the CLIP repository's list)."""
    rows = (Path(__file__).with_name("imagenet_classes.tsv")).read_text(encoding="utf-8").splitlines()
    return dict(row.split("\t") for row in rows)


def imagenet_family(data: list[str]) -> bool:
    """Every `data` value is a benchmark labelled as ImageNet's 1,000 classes."""
    return bool(data) and all((benchmark_of(spec) or ("",))[0] in IMAGENET_FAMILY for spec in data)


def benchmark_of(spec: str) -> tuple[str, Path] | None:
    """(kind, ROOT) of a `kind:ROOT` value, else None."""
    kind, colon, root = spec.partition(":")
    return (kind, Path(root)) if colon and root and kind in BENCHMARKS else None


def expand_benchmarks(specs: list[str], source: str | None = None) -> tuple[list[str], list[str]]:
    """Each benchmark ROOT as its corruptions (`imagenet-c:ROOT/gaussian_noise`, ...) or domains
    (`office-home:ROOT/Art`, ...), other values as they are, without the domains named `source`;
    and a note for each ROOT that lacks some of its corruptions or domains."""
    if source is not None:  # before the folders are listed: a misspelt name is said at once
        source = source_domain(source, _kinds(specs))
    domains, notes = [], []
    for spec in specs:
        found, missing = _members_of(spec)
        domains += found
        if missing:
            kind = benchmark_of(spec)[0]
            total, noun = (len(DOMAIN_SETS[kind]), f"{kind} domains") if kind in DOMAIN_SETS else (15, "corruptions")
            notes.append(
                f"`data` {spec}: {total - len(missing)} of the {total} {noun} found (no {listing(missing)}); "
                f"those found are used"
            )
    if source is None:
        return domains, notes
    return targets([(domain, *(benchmark_of(domain) or (None, None))) for domain in domains], source), notes


def source_of(config) -> str | None:
    """An adapt or bench config's `source` as its benchmark spells it (None without one), for tables and reports."""
    return None if config.source is None else source_domain(config.source, _kinds(config.data))


def _kinds(specs: list[str]) -> list[str]:
    return [named[0] for named in map(benchmark_of, specs) if named]


def _members_of(spec: str) -> tuple[list[str], list[str]]:
    """The values a benchmark ROOT stands for (its corruptions or domains), and the names of those it lacks;
    any other value as it is."""
    named = benchmark_of(spec)
    if named is None:
        return [spec], []
    kind, root = named
    if not root.exists():
        raise InputError(f"`data` {spec}: no such {'file or ' if BENCHMARKS[kind] == ARRAYS else ''}folder {root}")
    if BENCHMARKS[kind] == FOLDERS and not root.is_dir():
        raise InputError(
            f"`data` {spec}: {root} is a file; {kind} is folders, ROOT/<corruption>/<severity>/<class>/<images>: "
            f"give ROOT or one corruption's folder ({kind}:ROOT/fog)"
        )
    if BENCHMARKS[kind] == DOMAINS and not root.is_dir():
        raise InputError(
            f"`data` {spec}: {root} is a file; {kind} is folders, ROOT/<domain>/<class>/<images>: give ROOT "
            f"or one domain's folder ({kind}:ROOT/{DOMAIN_SETS[kind][0]})"
        )
    if BENCHMARKS[kind] == ONE:
        if not root.is_dir():
            raise InputError(f"`data` {spec}: {root} is a file; {kind} is one folder, ROOT/<class>/<images>")
        return [spec], []
    if _one_corruption(kind, root):
        return [spec], []
    if BENCHMARKS[kind] == DOMAINS:
        return domains_in(spec, kind, root)
    suffix = ".npy" if BENCHMARKS[kind] == ARRAYS else ""
    found = [c for c in CORRUPTIONS if (root / f"{c}{suffix}").exists()]
    if not found:
        layout = (
            "ROOT/<corruption>.npy and ROOT/labels.npy" if suffix else "ROOT/<corruption>/<severity>/<class>/<images>"
        )
        raise InputError(
            f"`data` {spec}: none of the 15 {kind} corruptions ({listing(CORRUPTIONS, 3)}) is in {root}; "
            f"give the folder laid out as {layout}, or one corruption ({kind}:ROOT/fog{suffix})"
        )
    return [f"{kind}:{root / (c + suffix)}" for c in found], [c for c in CORRUPTIONS if c not in found]


def _one_corruption(kind: str, path: Path) -> bool:
    """A corruption's .npy stack, or its folder of severity folders (1 ... 5); a benchmark's domain."""
    if BENCHMARKS[kind] == ARRAYS:
        return path.is_file()
    if BENCHMARKS[kind] == DOMAINS:
        return is_one_domain(kind, path)
    return any((path / str(s)).is_dir() for s in range(1, 6))


def open_benchmark(spec: str, labels: str | None, severity: int | None) -> Domain:
    """One corruption of a benchmark at `severity` (default 5), or one domain of a domain-adaptation benchmark."""
    kind, path = benchmark_of(spec)
    if BENCHMARKS[kind] == DOMAINS:
        return open_member(spec, kind, path, labels, severity)
    if BENCHMARKS[kind] == ONE:
        if labels is not None or severity is not None:
            given = "`labels`" if labels is not None else "`severity`"
            raise UsageError(f"{given} is not for {kind}, one folder labelled by its class folders: drop it")
        return _imagenet_v2(spec, path) if kind == "imagenet-v2" else _folder_domain(path)
    if labels is not None:
        raise UsageError(f"`labels` is for a plain .npy array; {kind} takes its labels from {kind}'s own labels.npy")
    severity = DEFAULT_SEVERITY if severity is None else severity
    if not 1 <= severity <= 5:
        raise UsageError(f"`severity` must be 1-5, not {severity}")
    if not path.exists():
        raise InputError(f"`data` {spec}: no such {'file' if BENCHMARKS[kind] == ARRAYS else 'folder'} {path}")
    if BENCHMARKS[kind] == FOLDERS:
        folder = path / str(severity)
        if not folder.is_dir():
            raise InputError(
                f"`data` {spec}: no severity folder {folder} (the {kind} layout is ROOT/<corruption>/<severity>/"
                f"<class>/<images>); give another `severity`, or the ROOT"
            )
        return _folder_domain(folder)
    if path.is_dir():
        raise InputError(
            f"`data` {spec}: a folder; give ROOT, the folder that holds <corruption>.npy and labels.npy, "
            f"or one corruption's {kind}:ROOT/fog.npy"
        )
    label_file = path.parent / "labels.npy"
    if not label_file.is_file():
        raise InputError(
            f"`data` {spec}: no labels.npy beside {path.name} (the {kind} layout); put {kind}'s labels.npy in "
            f"{path.parent}"
        )
    return _array_domain(path, str(label_file), severity)


def _imagenet_v2(spec: str, path: Path) -> Domain:
    """ImageNet-V2's folders are ImageNet output indices (0 ... 999): labelled by wnid, so that
    labels go through class names as every other folder's do."""
    domain = _folder_domain(path)
    wnids = list(imagenet_classes())
    strays = [name for name in domain.class_names if not (name.isdigit() and int(name) < len(wnids))]
    if strays:
        raise InputError(
            f"`data` {spec}: the class folder {strays[0]!r} is not an ImageNet output index (0 ... 999), as "
            f"ImageNet-V2's are; give its folder as released, or the folder as plain data"
        )
    index = np.asarray([int(name) for name in domain.class_names] + [UNLABELLED], dtype=np.int64)
    return replace(domain, labels=index[domain.labels], class_names=wnids)


def on_disk_benchmark(spec: str) -> str | None:
    """Where a benchmark value lies in the file system (its ROOT or corruption), else None."""
    named = benchmark_of(spec)
    return None if named is None else str(named[1])


def has_severities(spec: str) -> bool:
    """A corruption benchmark's value (its severity defaults to 5), not a domain-adaptation one's."""
    named = benchmark_of(spec)
    return named is not None and BENCHMARKS[named[0]] in (FOLDERS, ARRAYS)


def stages_of(spec: str) -> str:
    """The folder of one corruption that `gradual` visits at every severity: imagenet-c's;
    the arrays stack their severities in one file, which `gradual` does not take apart."""
    named = benchmark_of(spec)
    if named is None:
        return spec
    kind, path = named
    if BENCHMARKS[kind] in (DOMAINS, ONE):
        which = f"{kind}'s domains have" if BENCHMARKS[kind] == DOMAINS else f"{kind} has"
        raise UsageError(f"`gradual` visits the severities of a corruption; {which} none: drop `gradual`")
    if BENCHMARKS[kind] == ARRAYS:
        raise UsageError(
            f"`gradual` visits the severity folders of image folders; {kind} stacks its severities in one .npy "
            f"file: give `severity` instead, or the corruption as folders"
        )
    return str(path)
