"""The domain-adaptation benchmarks by name (`office-home:ROOT`, `domainnet:ROOT`,
`domainnet126:ROOT`) and `--source`, on small synthetic trees laid out as the real ones are."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PLAIN, TINY_NET, invoke, tiny_net, write_folder
from helpers import fails, rows

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.benchmarks import expand_benchmarks
from cafa_cli.data.domain_sets import DOMAINNET126_CLASSES
from cafa_cli.data.sources import open_domain

# named so that the sorted order (Alarm_Clock, Bike, Mop) is not the order written
CLASSES = ("Mop", "Alarm_Clock", "Bike")
# Product is missing; Real_World is spelled as Office-Home's archive spells it
FOUND = ("Art", "Clipart", "Real World")


@pytest.fixture
def office_home(tmp_path) -> Path:
    """ROOT/<domain>/<class>/*.png: 3 of the 4 domains, 3 classes of 2 images, each domain shifted otherwise."""
    root = tmp_path / "OfficeHome"
    for k, domain in enumerate(FOUND):
        write_folder(root / domain, per_class=2, classes=CLASSES, seed=k, shift=0.2 * k)
    return root


@pytest.fixture
def art_model(office_home, tmp_path) -> dict:
    """The tiny net's seeded weights as the source model, and its statistics from the Art images (cafa stats --data ROOT/Art)."""
    torch.manual_seed(0)
    weights, artifact = tmp_path / "art.pt", tmp_path / "art.safetensors"
    torch.save(tiny_net.build().state_dict(), weights)
    made = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        weights,
        "--data",
        office_home / "Art",
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        artifact,
        "--quiet",
    )
    assert made.exit_code == 0, made.stderr
    return {"weights": weights, "artifact": artifact}


def test_office_home_root_is_its_domains_in_the_benchmarks_order(office_home):
    domains, notes = expand_benchmarks([f"office-home:{office_home}"])
    assert domains == [f"office-home:{office_home / d}" for d in FOUND]
    assert notes == [
        f"`data` office-home:{office_home}: 3 of the 4 office-home domains found (no Product); those found are used"
    ]
    assert expand_benchmarks([f"office-home:{office_home}/Clipart"]) == ([f"office-home:{office_home}/Clipart"], [])
    art = open_domain(domains[0])
    assert art.class_names == ["Alarm_Clock", "Bike", "Mop"]  # sorted, as torchvision's ImageFolder numbers them
    assert [Path(art.refs[i]).parent.name for i in np.flatnonzero(art.labels == 2)] == ["Mop", "Mop"]
    # the model's class list (an artifact's, `classes`) orders them as its outputs, by name
    assert open_domain(domains[0], list(CLASSES)).labels.tolist() == [1, 1, 2, 2, 0, 0]
    with pytest.raises(UsageError, match="office-home's domains have none"):
        open_domain(domains[0], severity=3)
    (office_home / "Art" / "Mop").rename(
        office_home / "painting"
    )  # one of DomainNet's domains (its Clipart is one too)
    (office_home / "Clipart").rename(office_home / "Clip")
    with pytest.raises(
        InputError, match="none of the 6 domainnet domains .* is in .*OfficeHome/Art; give the folder laid out"
    ):
        expand_benchmarks([f"domainnet:{office_home}/Art"])
    assert expand_benchmarks([f"domainnet:{office_home}"])[0] == [f"domainnet:{office_home}/painting"]


def test_domains_whose_class_folders_differ_are_refused(office_home):
    (office_home / "Clipart" / "Bike").rename(office_home / "Clipart" / "Bicycle")
    with pytest.raises(
        InputError, match="the domains hold different class folders: Clipart lacks Bike and adds Bicycle against Art"
    ):
        expand_benchmarks([f"office-home:{office_home}"])


def test_source_leaves_the_source_out_and_takes_the_benchmarks_spelling(office_home, tmp_path):
    spec = f"office-home:{office_home}"
    assert expand_benchmarks([spec], "Art")[0] == [f"{spec}/Clipart", f"{spec}/Real World"]
    assert expand_benchmarks([spec], "real_world")[0] == [
        f"{spec}/Art",
        f"{spec}/Clipart",
    ]  # Real_World is `Real World` on disk
    with pytest.raises(
        UsageError,
        match=r"`source` Artt: office-home has no such domain \(its domains: Art, Clipart, Product, "
        r"Real_World\) \(did you mean Art for Artt\?\)",
    ):
        expand_benchmarks([spec], "Artt")
    with pytest.raises(UsageError, match="`source` Art names the source domain of a domain-adaptation benchmark"):
        expand_benchmarks([str(office_home / "Clipart")], "Art")
    with pytest.raises(UsageError, match="`source` Art leaves no target domain"):
        expand_benchmarks([f"{spec}/Art"], "Art")


def test_bench_with_a_source_runs_on_the_targets_and_names_the_source(office_home, art_model, tmp_path):
    report = tmp_path / "r.json"
    result = invoke(
        "bench",
        f"office-home:{office_home}",
        "--source",
        "Art",
        "--model",
        TINY_NET,
        "--weights",
        art_model["weights"],
        "--train",
        office_home / "Art",
        *PLAIN,
        "--fraction",
        "1",
        "--methods",
        "source,bn,cafa",
        "--batch-size",
        "4",
        "--workdir",
        tmp_path / "w",
        "--metrics-json",
        report,
    )
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == ["source: Art", "", "| method | Clipart | Real World | mean |"]
    assert [line.split(" | ")[0] for line in lines[4:]] == ["| source", "| bn", "| cafa"]
    payload = json.loads(report.read_text())
    assert payload["settings"]["source"] == "Art" and payload["settings"]["severity"] is None
    assert [d["label"] for d in payload["domains"]] == ["Clipart", "Real World"]
    assert {run["data"] for run in payload["runs"]} == {str(office_home / "Clipart"), str(office_home / "Real World")}


def test_adapt_with_a_source_reads_the_targets_through_the_source_statistics(office_home, art_model, tmp_path):
    metrics = tmp_path / "m.json"
    result = invoke(
        "adapt",
        f"office-home:{office_home}",
        "--source",
        "Art",
        "--stats",
        art_model["artifact"],
        "--model",
        TINY_NET,
        "--batch-size",
        "4",
        "--metrics-json",
        metrics,
    )
    assert result.exit_code == 0, result.stderr
    assert "cafa adapt --method cafa, source: Art" in result.stderr
    assert {Path(r["path"]).parent.parent.name for r in rows(result)} == {"Clipart", "Real World"}
    # labelled as the artifact lists the classes: the sorted names of Art's folders
    assert all(r["label"] == Path(r["path"]).parent.name for r in rows(result)) and len(rows(result)) == 12
    settings = json.loads(metrics.read_text())["settings"]
    assert settings["source"] == "Art" and settings["severity"] is None
    # the same predictions as the target folders given one by one
    plain = invoke(
        "adapt",
        office_home / "Clipart",
        office_home / "Real World",
        "--stats",
        art_model["artifact"],
        "--model",
        TINY_NET,
        "--batch-size",
        "4",
        "--quiet",
    )
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout == result.stdout


def test_a_wrong_source_or_setting_is_one_line_and_a_usage_error(office_home, art_model, tmp_path):
    base = ["adapt", "--stats", art_model["artifact"], "--model", TINY_NET]
    fails(
        invoke(*base, f"office-home:{office_home}", "--gradual"),
        2,
        "--gradual visits the severities of a corruption; office-home's domains have none: drop --gradual",
    )
    fails(
        invoke(*base, f"office-home:{office_home}", "--severity", "5"),
        2,
        "office-home's domains have none: drop --severity",
    )
    fails(
        invoke(*base, f"office-home:{office_home}", "--source", "Sketch"),
        2,
        "--source Sketch: office-home has no such domain (its domains: Art, Clipart, Product, Real_World)",
    )
    fails(
        invoke(*base, office_home / "Clipart", "--source", "Art"),
        2,
        "--source Art names the source domain",
        "office-home:ROOT",
    )
    fails(
        invoke(
            "bench", f"domainnet:{office_home}", "--source", "Art", "--model", TINY_NET, "--workdir", tmp_path / "w"
        ),
        2,
        "domainnet has no such domain (its domains: clipart, infograph, painting, quickdraw, real, sketch)",
    )
    fails(
        invoke(
            "stats",
            "--model",
            TINY_NET,
            "--data",
            f"office-home:{office_home}",
            *PLAIN,
            "--out",
            tmp_path / "s.safetensors",
        ),
        3,
        "OfficeHome is not one of the office-home domains",
        "office-home:ROOT/Art",
    )
    assert not (tmp_path / "w").exists()


def _domainnet_folders(root: Path, domain: str, classes: tuple[str, ...]) -> Path:
    """ROOT/<domain>/<class>/<domain>_NNN_MMMMMM.png, DomainNet's file names (NNN: its class number)."""
    write_folder(root / domain, per_class=2, classes=classes)
    for folder in (root / domain).iterdir():
        for k, image in enumerate(sorted(folder.iterdir())):
            image.rename(
                folder / f"{domain}_{DOMAINNET126_CLASSES.index(folder.name) + 1:03d}_{k:06d}.png"
                if folder.name in DOMAINNET126_CLASSES
                else folder / f"{domain}_999_{k:06d}.png"
            )
    return root / domain


def test_domainnet126_reads_the_benchmark_lists_in_the_subsets_class_order(tmp_path):
    """The test-time-adaptation benchmark's layout: all of DomainNet's class folders, and ROOT/<domain>_list.txt (\\r\\n lines)
    naming the subset's images with their labels."""
    root = tmp_path / "domainnet"
    chosen = ("The_Eiffel_Tower", "cello", "cell_phone")
    clipart = _domainnet_folders(root, "clipart", (*chosen, "zigzag"))  # zigzag: one of the 345, not of the 126
    listed = sorted((image, image.parent.name) for name in chosen for image in (clipart / name).iterdir())
    (root / "clipart_list.txt").write_bytes(
        b"".join(
            f"{image.relative_to(root).as_posix()} {DOMAINNET126_CLASSES.index(name)}\r\n".encode()
            for image, name in reversed(listed)
        )
    )
    domains, notes = expand_benchmarks([f"domainnet126:{root}"], None)
    assert domains == [f"domainnet126:{clipart}"] and "1 of the 4 domainnet126 domains found" in notes[0]
    domain = open_domain(domains[0])
    assert domain.class_names == list(DOMAINNET126_CLASSES)
    assert domain.refs == sorted(str(image) for image, _ in listed)  # the list's images only, in the folders' order
    assert sorted(set(domain.labels.tolist())) == [
        30,
        31,
        115,
    ]  # cello, cell_phone, The_Eiffel_Tower: not the sorted names' order
    assert all(DOMAINNET126_CLASSES[label] == Path(ref).parent.name for ref, label in zip(domain.refs, domain.labels))
    (root / "clipart_list.txt").write_text(f"clipart/cello/{os.listdir(clipart / 'cello')[0]} 31\n")
    with pytest.raises(InputError, match="clipart_list.txt line 1: cello is class 30 in DomainNet-126's order, not 31"):
        open_domain(domains[0])
    (root / "clipart_list.txt").write_text("clipart/cello/gone.jpg 30\n")
    with pytest.raises(InputError, match="1 of the 1 images clipart_list.txt lists are not under"):
        open_domain(domains[0])
    # issue 40 §5: a line stays below ROOT, in its own class, once; its label is ASCII digits
    cello = os.listdir(clipart / "cello")[0]
    for line in (
        "clipart/cello/../../../outside.png 30",  # climbs out of ROOT
        f"clipart/cell_phone/../cello/{cello} 31",  # relabels an image
        f"clipart/./cello/{cello} 30",
        f"clipart/cello/{cello} ³⁰",
    ):
        (root / "clipart_list.txt").write_text(f"{line}\n")
        with pytest.raises(InputError, match="line 1: expected .* without . or .."):
            open_domain(domains[0])
    (root / "clipart_list.txt").write_text(f"clipart/cello/{cello} 30\nclipart/cello/{cello} 30\n")
    with pytest.raises(InputError, match=f"line 2: clipart/cello/{cello} is listed twice \\(line 1 too\\)"):
        open_domain(domains[0])
    (root / "clipart_list.txt").unlink()  # the folders of DomainNet's classes, without the list: not the subset
    with pytest.raises(
        InputError, match="has 4 class folders, and DomainNet-126 has 126 .*; put the benchmark's clipart_list.txt in"
    ):
        open_domain(domains[0])


def test_domainnet126_folders_of_the_126_classes_take_the_subsets_order(tmp_path):
    sketch = _domainnet_folders(tmp_path / "dn126", "sketch", DOMAINNET126_CLASSES[:1])
    for name in DOMAINNET126_CLASSES[1:]:  # an empty image each: the order is what is checked, nothing is read
        (sketch / name).mkdir()
        (sketch / name / "x.png").write_bytes(b"")
    domain = open_domain(f"domainnet126:{sketch}")
    assert domain.class_names == list(DOMAINNET126_CLASSES)
    assert domain.labels[[Path(ref).parent.name for ref in domain.refs].index("The_Eiffel_Tower")] == 115


def test_a_link_sideways_out_of_a_class_folder_is_refused_and_other_links_are_followed(office_home, tmp_path):
    """Issue 40 §5: `Art/Bike/clip -> ../../Clipart` labelled every Clipart image Bike, silently;
    so did a link to another class's folder. A link elsewhere (more images of the class) stays."""
    bike = office_home / "Art" / "Bike"
    for target, what in (
        (office_home / "Clipart", "a folder of class folders \\(another domain\\)"),
        (office_home / "Art" / "Mop", "the class folder Mop"),
        (office_home / "Clipart" / "Mop", "a folder of the class Mop"),
    ):
        link = bike / "linked"
        link.symlink_to(os.path.relpath(target, bike), target_is_directory=True)
        with pytest.raises(
            InputError, match=f"linked links to .*{target.name}, {what}; its images would be labelled Bike"
        ):
            open_domain(str(office_home / "Art"))
        link.unlink()
    (bike / "linked").symlink_to(office_home / "Clipart", target_is_directory=True)
    fails(
        invoke("adapt", f"office-home:{office_home / 'Art'}", "--model", TINY_NET, *PLAIN, "--method", "bn"),
        3,
        "would be labelled Bike",
    )
    (bike / "linked").unlink()
    more = tmp_path / "more-bikes"
    write_folder(more, per_class=1, classes=("x",))
    (bike / "more").symlink_to(more, target_is_directory=True)
    assert len(open_domain(str(office_home / "Art")).refs) == 6 + 1


def test_a_domain_spelled_two_ways_an_option_twice_and_a_bom_are_named(office_home, tmp_path):
    """Issue 40 §5: `Real World` beside `Real_World` took one silently; `--source Art --source
    Clipart` kept the last without a word (the last is still taken, as shells expect, and said);
    a DomainNet list saved with a byte-order mark failed on '\\ufeffclipart'."""
    write_folder(office_home / "Real_World", per_class=2, classes=CLASSES, seed=9)
    with pytest.raises(InputError, match="holds 'Real World' and 'Real_World', one domain spelled two ways"):
        expand_benchmarks([f"office-home:{office_home}"], None)
    for repeated, taken in (
        (["--source", "Art", "--source", "Clipart"], "--source is given 2 times; the last is taken (Clipart)"),
        (["--lr", "1", "--lr=2"], "--lr is given 2 times; the last is taken (2)"),
        (["--shuffle", "--no-shuffle"], "--shuffle/--no-shuffle is given 2 times; the last is taken (off)"),
    ):
        result = invoke("adapt", f"office-home:{office_home}", "--method", "bn", *repeated)
        assert f"warning: {taken}\n" in result.stderr, result.stderr
    root = tmp_path / "domainnet"
    clipart = _domainnet_folders(root, "clipart", ("cello",))
    image = sorted((clipart / "cello").iterdir())[0]
    (root / "clipart_list.txt").write_bytes(f"\ufeffclipart/cello/{image.name} 30\r\n".encode())
    assert open_domain(f"domainnet126:{clipart}").refs == [str(image)]
