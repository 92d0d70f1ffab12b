"""`--reset every:N`: any method back to the source weights after every N updates, counted
across domains (RDumb's schedule, issue 41), and rdumb as ETA under that schedule."""

from __future__ import annotations

import csv
import io
import json

import pytest
from conftest import TINY_NET, invoke

from cafa_cli.core.errors import UsageError
from cafa_cli.data.values import parse_reset
from cafa_cli.jobs.config.settings import StreamSettings
from cafa_cli.methods.recipes import shipped


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("domain", ("domain", None)),
        ("never", ("never", None)),
        ("every:1", ("every", 1)),
        ("every:1000", ("every", 1000)),
    ],
)
def test_a_reset_is_a_policy_or_a_period(text, parsed):
    assert parse_reset(text) == parsed


@pytest.mark.parametrize(
    "text",
    [
        "every:0", "every:-3", "every:1.5", "every:", "every", "sometimes", "never:2",
        # read by int() they were a ValueError traceback (over 4,300 digits, '²') or a number ('١٢')
        "every:" + "9" * 5000, "every:" + "1" * 21, "every:²", "every:١٢", "every:+5", "every:1e3",
    ],
)  # fmt: skip
def test_a_reset_that_is_no_policy_is_refused_with_the_forms(text):
    with pytest.raises(UsageError, match="every:N"):
        parse_reset(text)


class Counting:
    """An Adapter's stand-in that records where the stream resets it."""

    device = "cpu"

    def __init__(self):
        self.batches, self.resets = 0, []

    def reset(self):
        self.resets.append(self.batches)


def test_every_n_resets_after_each_nth_batch_across_domains(monkeypatch):
    from cafa_cli.jobs.adapt import stream

    adapter = Counting()

    def step(adapter, domain, preprocess, batch, first, oracle, pace, typed_options, outliers_from):
        adapter.batches += 1
        return []

    monkeypatch.setattr(stream, "_step", step)
    monkeypatch.setattr(stream, "_counts", lambda adapter: {})
    monkeypatch.setattr(stream, "_add_counts", lambda *args: None)
    monkeypatch.setattr(stream, "stream_order", lambda labels, *args: list(range(len(labels))))

    class Batch:
        images, indices, failures = object(), [], []

    monkeypatch.setattr(stream, "batches", lambda domain, preprocess, size, positions, *args: [Batch] * len(positions))

    class Domain:
        ordered = False  # streamed in `order`, as a data set is

        def __init__(self, n):
            self.name, self.labels = f"d{n}", [0] * n

        def __len__(self):
            return len(self.labels)

    stream.adapt_domains(adapter, [Domain(5), Domain(4)], None, StreamSettings(batch_size=1, reset="every:3"))
    assert adapter.resets == [3, 6, 9]  # 9 batches, one stream of updates: the domain boundary does not reset
    adapter.batches, adapter.resets = 0, []
    stream.adapt_domains(adapter, [Domain(5), Domain(4)], None, StreamSettings(batch_size=1, reset="domain"))
    assert adapter.resets == [5]


def test_rdumb_is_eta_under_its_recipes_reset_every_1000():
    for family in ("imagenet-c", "cifar10-c", "cifar100-c"):
        assert shipped("rdumb", family).settings["reset"] == "every:1000"
        eta, rdumb = shipped("eta", family), shipped("rdumb", family)
        # on ImageNet both are their authors' plain SGD momentum (RDumb's oripress/CCC, EATA's own)
        assert {k: v for k, v in rdumb.settings.items() if k != "reset"} == eta.settings
        assert rdumb.options["entropy_margin"] == eta.options["entropy_margin"]


def test_rdumb_through_cafa_adapt_is_eta_with_every_n(setup, tmp_path):
    common = [
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--data",
        setup["train"],
    ]
    common += ["--batch-size", "6", "--recipe", "cifar10-c", "-q", "--no-shuffle"]
    rdumb = invoke(*common, "--method", "rdumb", "--reset", "every:2", "--metrics-json", tmp_path / "r.json")
    assert rdumb.exit_code == 0, rdumb.stderr
    eta = invoke(*common, "--method", "eta", "--reset", "every:2")
    assert eta.exit_code == 0, eta.stderr
    assert len(list(csv.DictReader(io.StringIO(rdumb.stdout)))) == 36
    assert rdumb.stdout == eta.stdout  # the method is eta's
    # the schedule changes the stream (TENT: ETA keeps few of this tiny set's samples)
    tent = {reset: invoke(*common, "--method", "tent", "--reset", reset).stdout for reset in ("every:2", "never")}
    assert tent["every:2"] != tent["never"]
    settings = json.loads((tmp_path / "r.json").read_text())["settings"]
    assert settings["reset"] == "every:2" and settings["method"] == "rdumb"
    by_recipe = invoke(*common, "--method", "rdumb", "--metrics-json", tmp_path / "d.json")
    assert by_recipe.exit_code == 0, by_recipe.stderr
    assert json.loads((tmp_path / "d.json").read_text())["settings"]["reset"] == "every:1000"  # its recipe's


def test_a_state_cannot_follow_a_periodic_reset(setup, tmp_path):
    result = invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--reset",
        "every:5",
        "--state",
        tmp_path / "s.safetensors",
    )
    assert result.exit_code == 2 and "count of updates" in result.stderr and "give --reset never" in result.stderr
    assert not (tmp_path / "s.safetensors").exists()


def test_a_recipe_may_set_the_normalisation_and_the_users_choice_wins(setup, tmp_path):
    """ttaug and memo run one image a batch, where the test batch's statistics would
    normalise an image to nothing: their recipes normalise as their authors did (α-BN, a
    prior), a run records it, and `--norm` given by the user wins over it."""
    assert {shipped(name, "cifar10-c").settings.get("norm") for name in ("ttaug", "memo")} == {"alpha:0.1"}
    assert shipped("memo", "imagenet-c").settings["norm"] == "prior:16"
    common = ["adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--data", setup["train"], "--method", "ttaug"]
    common += ["-q", "--no-shuffle", "--recipe", "cifar10-c", "--method-option", "copies=2"]
    runs = {}
    for norm in (None, "alpha:0.1", "batch"):
        chosen = [] if norm is None else ["--norm", norm]
        result = invoke(*common, *chosen, "--metrics-json", tmp_path / f"{norm}.json")
        assert result.exit_code == 0, result.stderr
        runs[norm] = (result.stdout, json.loads((tmp_path / f"{norm}.json").read_text())["settings"]["norm"])
    assert runs[None] == (runs["alpha:0.1"][0], "alpha:0.1")  # the recipe's, applied
    assert runs["batch"][1] == "batch" and runs["batch"][0] != runs[None][0]  # the user's wins
    recipe = tmp_path / "mine.toml"
    recipe.write_text('[ttaug]\nbatch_size = 1\nnorm = "alpha:2"\n')
    bad = invoke(*common[:-4], "--recipe", recipe)
    assert bad.exit_code == 3 and str(recipe) in bad.stderr and "'alpha:2'" in bad.stderr, bad.stderr  # a bad file


def test_bench_says_when_a_rows_recipe_replaces_its_reset(setup, tmp_path):
    """RDumb's recipe runs it under every:1000 where the bench resets per domain: its "i.i.d."
    column is one stream through the domains. Said once on stderr; a typed --reset wins, unsaid."""
    from conftest import PLAIN

    base = ["bench", setup["train"], "--methods", "rdumb,eta", "--model", TINY_NET, "--weights", setup["weights"]]
    base += [*PLAIN, "--workdir", tmp_path / "w"]
    said = "rdumb runs under its recipe's reset every:1000, not the bench's domain (its authors' protocol)"
    result = invoke(*base)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count(said) == 1 and "eta runs under" not in result.stderr
    typed = invoke(*base, "--reset", "domain")
    assert typed.exit_code == 0 and "runs under its recipe's reset" not in typed.stderr


@pytest.mark.parametrize("period", ["9" * 5000, "²", "1" * 21])
def test_a_period_no_number_can_be_is_one_line_on_the_command_line_and_in_a_recipe(setup, tmp_path, period):
    """A 5,000-digit N was a ValueError traceback (exit 1), typed or in a recipe file."""
    from helpers import adapt, fails

    fails(adapt(setup, setup["train"], "--reset", f"every:{period}"), 2, "--reset must be domain, episodic")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[tent]\nsource = "mine"\nreset = "every:{period}"\n', encoding="utf-8")
    line = fails(adapt(setup, setup["train"], "--method", "tent", "--recipe", recipe), 3, "--reset must be")
    assert str(recipe) in line
