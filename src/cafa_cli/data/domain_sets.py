"""The domain-adaptation benchmarks by name, as `data` values; data/benchmarks.py expands
and opens them through the same paths as the corruption benchmarks:

- `office-home:ROOT`: Office-Home (Venkateswara et al., CVPR 2017), ROOT/<domain>/<class>/<images>,
  domains Art, Clipart, Product, Real_World (found also as the archive's `Real World`, or
  `RealWorld`), 65 classes;
- `domainnet:ROOT`: DomainNet (Peng et al., ICCV 2019), ROOT/<domain>/<class>/<images>,
  domains clipart, infograph, painting, quickdraw, real, sketch, 345 classes;
- `domainnet126:ROOT`: the 126 classes of 4 domains (clipart, painting, real, sketch) that
  AdaContrast and the test-time-adaptation benchmark use. Either their layout, the DomainNet
  folders with ROOT/<domain>_list.txt beside them (lines `real/bird/real_032_000265.jpg 11`:
  a path under ROOT and the class in the subset's order), or ROOT/<domain>/<class> holding
  those 126 classes only.

A ROOT stands for the domains it holds, in the order above; `KIND:ROOT/Art` (a folder named
as one of the domains) for one. The classes are the sorted folder names, as torchvision's
ImageFolder numbers them, unless the model's list is given (an artifact, `classes`), and
every domain of a ROOT must hold the same ones. DomainNet-126's are the subset's own order
(DomainNet's numbering, where The_Eiffel_Tower is class 115 and cello comes before cell_phone),
whatever the layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cafa_cli.core.errors import InputError, UsageError, listing, printable
from cafa_cli.core.files import read_small_text
from cafa_cli.data.domain import Domain, did_you_mean, relabel
from cafa_cli.data.folders import _folder_domain, _path_order, read_image

DOMAIN_SETS = {
    "office-home": ("Art", "Clipart", "Product", "Real_World"),
    "domainnet": ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
    "domainnet126": ("clipart", "painting", "real", "sketch"),
}
LAYOUT = "ROOT/<domain>/<class>/<images>"
# The most a DomainNet-126 list (ROOT/<domain>_list.txt) may hold: the benchmark's biggest,
# real_list.txt (about 70,000 images), is under 3 MB, and DomainNet's own biggest list, of all
# 345 classes, about 5 MB; a file over 32 MiB is no such list (a link to /dev/zero, a sparse
# file) and is refused unread.
DOMAIN_LIST_LIMIT = 32 << 20

# DomainNet-126's classes in its label order: read off the labels of the 4 domain lists of the
# test-time-adaptation benchmark (mariodoebler/test-time-adaptation, datasets/domainnet126_lists),
# which all 4 agree on
DOMAINNET126_CLASSES = (
    "aircraft_carrier",
    "alarm_clock",
    "ant",
    "anvil",
    "asparagus",
    "axe",
    "banana",
    "basket",
    "bathtub",
    "bear",
    "bee",
    "bird",
    "blackberry",
    "blueberry",
    "bottlecap",
    "broccoli",
    "bus",
    "butterfly",
    "cactus",
    "cake",
    "calculator",
    "camel",
    "camera",
    "candle",
    "cannon",
    "canoe",
    "carrot",
    "castle",
    "cat",
    "ceiling_fan",
    "cello",
    "cell_phone",
    "chair",
    "chandelier",
    "coffee_cup",
    "compass",
    "computer",
    "cow",
    "crab",
    "crocodile",
    "cruise_ship",
    "dog",
    "dolphin",
    "dragon",
    "drums",
    "duck",
    "dumbbell",
    "elephant",
    "eyeglasses",
    "feather",
    "fence",
    "fish",
    "flamingo",
    "flower",
    "foot",
    "fork",
    "frog",
    "giraffe",
    "goatee",
    "grapes",
    "guitar",
    "hammer",
    "helicopter",
    "helmet",
    "horse",
    "kangaroo",
    "lantern",
    "laptop",
    "leaf",
    "lion",
    "lipstick",
    "lobster",
    "microphone",
    "monkey",
    "mosquito",
    "mouse",
    "mug",
    "mushroom",
    "onion",
    "panda",
    "peanut",
    "pear",
    "peas",
    "pencil",
    "penguin",
    "pig",
    "pillow",
    "pineapple",
    "potato",
    "power_outlet",
    "purse",
    "rabbit",
    "raccoon",
    "rhinoceros",
    "rifle",
    "saxophone",
    "screwdriver",
    "sea_turtle",
    "see_saw",
    "sheep",
    "shoe",
    "skateboard",
    "snake",
    "speedboat",
    "spider",
    "squirrel",
    "strawberry",
    "streetlight",
    "string_bean",
    "submarine",
    "swan",
    "table",
    "teapot",
    "teddy-bear",
    "television",
    "The_Eiffel_Tower",
    "The_Great_Wall_of_China",
    "tiger",
    "toe",
    "train",
    "truck",
    "umbrella",
    "vase",
    "watermelon",
    "whale",
    "zebra",
)


def _key(name: str) -> str:
    """A domain's name as compared: `Real World`, `Real_World`, `RealWorld` and `real-world` are one."""
    return "".join(ch for ch in name.lower() if ch not in " _-")


def is_one_domain(kind: str, path: Path) -> bool:
    """`KIND:ROOT/Art`: a folder named as one of the benchmark's domains."""
    return _key(path.name) in {_key(domain) for domain in DOMAIN_SETS[kind]}


def domains_in(spec: str, kind: str, root: Path) -> tuple[list[str], list[str]]:
    """The `KIND:ROOT/<domain>` values of the domains ROOT holds, in the benchmark's order, and
    the names of those it lacks; an error when the domains' class folders differ."""
    folders: dict[str, Path] = {}
    domains = {_key(domain) for domain in DOMAIN_SETS[kind]}
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.name.startswith(".") or _key(entry.name) not in domains:
            continue
        if _key(entry.name) in folders:  # `Real World` beside `Real_World`: one would be taken, unsaid
            raise InputError(
                f"`data` {spec}: {root} holds {printable(folders[_key(entry.name)].name)!r} and "
                f"{printable(entry.name)!r}, one domain spelled two ways; keep one of them"
            )
        folders[_key(entry.name)] = entry
    found = [folders[_key(domain)] for domain in DOMAIN_SETS[kind] if _key(domain) in folders]
    if not found:
        raise InputError(
            f"`data` {spec}: none of the {len(DOMAIN_SETS[kind])} {kind} domains ({listing(DOMAIN_SETS[kind])}) "
            f"is in {root}; give the folder laid out as {LAYOUT}, or one domain ({kind}:ROOT/{DOMAIN_SETS[kind][0]})"
        )
    if kind != "domainnet126":  # its domains are each checked against the subset's 126 classes when opened
        _check_same_classes(spec, found)
    return [f"{kind}:{folder}" for folder in found], [d for d in DOMAIN_SETS[kind] if _key(d) not in folders]


def _check_same_classes(spec: str, folders: list[Path]) -> None:
    """Every domain holds the same class folders: else the sorted names would number the
    classes of one domain otherwise than the model's outputs."""
    classes = {
        folder: {entry.name for entry in folder.iterdir() if entry.is_dir() and not entry.name.startswith(".")}
        for folder in folders
    }
    first = folders[0]
    for folder in folders[1:]:
        lacks, extra = sorted(classes[first] - classes[folder]), sorted(classes[folder] - classes[first])
        if lacks or extra:
            differences = [
                *([f"lacks {listing(lacks)}"] if lacks else []),
                *([f"adds {listing(extra)}"] if extra else []),
            ]
            raise InputError(
                f"`data` {spec}: the domains hold different class folders: {folder.name} "
                f"{' and '.join(differences)} against {first.name} ({len(classes[first])} classes); every "
                f"domain must hold the model's classes, one folder each: fix or rename them"
            )


def open_member(spec: str, kind: str, path: Path, labels: str | None, severity: int | None) -> Domain:
    """One domain of a domain-adaptation benchmark, labelled by its class folders (DomainNet-126:
    by its list file when ROOT has one), its classes in the benchmark's order."""
    if labels is not None:
        raise UsageError(f"`labels` is for a plain .npy array; {kind} takes its labels from its class folders")
    if severity is not None:
        raise UsageError(f"`severity` picks a corruption's severity; {kind}'s domains have none: drop `severity`")
    if not path.is_dir():
        raise InputError(f"`data` {spec}: no such folder {path} (the {kind} layout is {LAYOUT})")
    if not is_one_domain(kind, path):
        raise InputError(
            f"`data` {spec}: {path.name} is not one of the {kind} domains ({listing(DOMAIN_SETS[kind])}); "
            f"give one domain's folder ({kind}:ROOT/{DOMAIN_SETS[kind][0]}); the ROOT stands for its domains "
            f"in cafa adapt and cafa bench only"
        )
    if kind != "domainnet126":
        return _folder_domain(path)
    listed = list_file(path)
    if os.path.lexists(listed):  # a folder, a pipe or a dangling link by that name is refused, not passed over
        return _listed_domain(path, listed)
    domain = _folder_domain(path)
    if set(domain.class_names) != set(DOMAINNET126_CLASSES):
        missing = [name for name in DOMAINNET126_CLASSES if name not in domain.class_names]
        raise InputError(
            f"`data` {spec}: {path} has {len(domain.class_names)} class folders, and DomainNet-126 has 126"
            + (f" ({listing(missing)} missing)" if missing else "")
            + f"; put the benchmark's {path.name}_list.txt in {path.parent} (the test-time-adaptation "
            f"benchmark's layout), or give domainnet:{path.parent} for all of DomainNet's classes"
        )
    return relabel(domain, list(DOMAINNET126_CLASSES))


def list_file(folder: Path) -> Path:
    """Where DomainNet-126's list of a domain's images lies: ROOT/<domain>_list.txt."""
    return folder.parent / f"{folder.name}_list.txt"


def _listed_domain(folder: Path, listed: Path) -> Domain:
    """The images a DomainNet-126 list names, each line `<domain>/<class>/<file> <label>` with
    the path under ROOT and the label in the subset's order (checked against the class folder)."""
    text = read_small_text(
        listed, "", DOMAIN_LIST_LIMIT, f"give the benchmark's list of {folder.name}'s images, a UTF-8 text file"
    )
    refs, labels, lines = [], [], {}
    for number, line in enumerate(text.splitlines(), 1):  # the published lists end their lines with \r\n
        if not line.strip():
            continue
        fields = line.split()
        parts = fields[0].split("/") if fields else []
        # exactly domain/class/file below ROOT: a `..` would climb out of it or relabel an image,
        # and `²` passes isdigit() but not int()
        plain = len(parts) == 3 and all(part not in ("", ".", "..") for part in parts)
        if len(fields) != 2 or not (fields[1].isascii() and fields[1].isdigit()) or not plain:
            raise InputError(
                f"{listed} line {number}: expected `{folder.name}/<class>/<image> <label>`, the path below ROOT "
                f"without . or .., not {line.strip()!r}"
            )
        if parts[0] != folder.name:
            raise InputError(f"{listed} line {number}: {fields[0]} is not an image of {folder.name}")
        if fields[0] in lines:
            raise InputError(
                f"{listed} line {number}: {fields[0]} is listed twice (line {lines[fields[0]]} too), and would be "
                f"predicted twice; give the benchmark's own list"
            )
        lines[fields[0]] = number
        label, name = int(fields[1]), parts[1]
        if label >= len(DOMAINNET126_CLASSES) or DOMAINNET126_CLASSES[label] != name:
            said = (
                f"class {DOMAINNET126_CLASSES.index(name)} in DomainNet-126's order, not {label}"
                if name in DOMAINNET126_CLASSES
                else "not one of DomainNet-126's classes"
            )
            raise InputError(f"{listed} line {number}: {name} is {said}; give the benchmark's own list")
        refs.append(os.path.join(folder.parent, *parts))
        labels.append(label)
    if not refs:
        raise InputError(f"{listed} lists no images; give the benchmark's list of {folder.name}'s images")
    absent = [ref for ref in refs if not os.path.isfile(ref)]
    if absent:
        raise InputError(
            f"{len(absent)} of the {len(refs)} images {listed.name} lists are not under {folder.parent} (the "
            f"first: {absent[0]}); its paths are below ROOT, the folder that holds {folder.name}/ and the list"
        )
    order = sorted(range(len(refs)), key=lambda i: _path_order(refs[i]))  # as a folder lists them: the same stream
    refs = [refs[i] for i in order]
    return Domain(
        str(folder),
        refs,
        np.asarray(labels, dtype=np.int64)[order],
        list(DOMAINNET126_CLASSES),
        lambda i: read_image(refs[i]),
    )


def source_domain(source: str, kinds: list[str]) -> str:
    """`source` as the benchmarks of `kinds` (those of the `data` values) spell it (`real world`
    → Real_World); an error when no domain-adaptation benchmark is among them, or one has no
    such domain."""
    sets = list(dict.fromkeys(kind for kind in kinds if kind in DOMAIN_SETS))
    if not sets:
        raise UsageError(
            f"`source` {source} names the source domain of a domain-adaptation benchmark "
            f"({', '.join(kind + ':ROOT' for kind in DOMAIN_SETS)}), and `data` holds none; give one, "
            f"or drop `source`"
        )
    for kind in sets:
        known = {_key(domain): domain for domain in DOMAIN_SETS[kind]}
        if _key(source) not in known:
            raise UsageError(
                f"`source` {source}: {kind} has no such domain (its domains: {listing(DOMAIN_SETS[kind], 6)})"
                f"{did_you_mean([source], list(DOMAIN_SETS[kind]))}"
            )
    return next(domain for domain in DOMAIN_SETS[sets[0]] if _key(domain) == _key(source))


def targets(domains: list[tuple[str, str | None, Path | None]], source: str) -> list[str]:
    """The domains, (value, kind, path) each, without those of a domain-adaptation benchmark
    named `source`; an error when none is left."""
    kept = [spec for spec, kind, path in domains if kind not in DOMAIN_SETS or _key(path.name) != _key(source)]
    if not kept:
        raise UsageError(
            f"`source` {source} leaves no target domain in `data`; give the benchmark's ROOT (its other "
            f"domains are the targets), or the target domains"
        )
    return kept
