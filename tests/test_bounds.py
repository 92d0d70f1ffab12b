"""One bound for every number, wherever it is written (issue 40, §2): every whole-number
option of every method has an upper bound that keeps memory and time sane, and a recipe's
batch size is a whole number, not 10.0, true or "10"."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import adapt, bench, fails

from cafa_cli.core.errors import UsageError
from cafa_cli.data.values import parse_order
from cafa_cli.engine.options import MOST_COUNT, Norm
from cafa_cli.methods import REGISTRY, options_of

COUNTS = [
    (method, option)
    for method in REGISTRY
    for option in options_of(method)
    if option.kind in ("count", "count0", "count_or_all")
]


def test_every_method_has_whole_number_options_to_bound():
    assert {"rotta", "t3a", "lame", "cotta", "memo", "ttaug", "adacontrast"} <= {m for m, _ in COUNTS}


@pytest.mark.parametrize("method, option", COUNTS, ids=[f"{m}.{o.name}" for m, o in COUNTS])
def test_a_whole_number_option_takes_up_to_its_bound_and_refuses_beyond(method, option):
    assert 0 < option.largest() <= MOST_COUNT
    assert option.default == "all" or option.default <= option.largest()  # the default is a value it takes
    assert option.value(method, str(option.largest())) == option.largest()
    for beyond in (option.largest() + 1, 10**21, "1" + "0" * 5000, "²", "1.0", "true"):
        with pytest.raises(UsageError, match=f"{option.name} must be a whole number from"):
            option.value(method, beyond)


NUMBERS = [
    (method, option)
    for method in REGISTRY
    for option in options_of(method)
    if option.kind in ("weight", "positive", "positive_or_auto")
]


@pytest.mark.parametrize("method, option", NUMBERS, ids=[f"{m}.{o.name}" for m, o in NUMBERS])
def test_a_number_option_takes_every_sane_magnitude_and_refuses_the_extremes(method, option):
    """A temperature or LAME's σ of 1e-300 divided the logits to infinity, and the NaN was blamed on
    --mean/--std; a weight of 1e300 overflows float32. The bounds hold every default."""
    assert option.default == "auto" or option.value(method, option.default) == option.default
    assert option.value(method, "1e6") == 1e6 and option.value(method, "0.000001") == 1e-6
    for beyond in ("1e300", 1e7, "1e-300" if option.kind != "weight" else "-1e-300", "nan", "inf", "-1"):
        with pytest.raises(UsageError, match=f"{option.name} must be a number from"):
            option.value(method, beyond)


def test_nan_outputs_name_the_methods_options_set_away_from_their_defaults():
    """A method option is as likely a cause as the preprocessing; both are named, options first."""
    import torch

    from cafa_cli.core.errors import InputError
    from cafa_cli.data.domain import Domain
    from cafa_cli.data.loading import Batch
    from cafa_cli.jobs.adapt.stream import _records
    from cafa_cli.methods import create

    domain = Domain("d", ["a.png", "b.png"], np.array([0, 1]), ["x", "y"], lambda i: None)
    batch = Batch(None, [0, 1], [])
    nan = torch.tensor([[0.0, float("nan")], [1.0, 0.0]])
    with pytest.raises(
        InputError, match=r"options set away from their defaults \(sigma=0.5, bound_lambda=3.0\), `mean`"
    ):
        _records(domain, batch, nan, create("lame", None, sigma=0.5, bound_lambda=3.0))
    with pytest.raises(InputError, match="NaN or infinite; check `mean` and `std`"):
        _records(domain, batch, nan, create("lame", None))


@pytest.mark.parametrize(
    "typed, named",
    [
        ([], None),
        (["--method-option", "update_every=8"], "(update_every=8)"),
        (
            ["--method-option", "update_every=8", "--method-option", "source_pull=0.5"],
            "(update_every=8, source_pull=0.5)",
        ),
        (["--method-option", "cafa-robust.update_every=8", "--method-option", "prior=16"], "(update_every=8)"),
    ],
    ids=["none-typed", "one-typed", "two-typed", "scoped-and-at-its-default"],
)
def test_nan_outputs_name_only_the_options_the_user_gave_not_the_recipes(setup, tmp_path, typed, named):
    """cafa-robust's recipe sets six options away from the class defaults: outputs that turned NaN
    named them all as options "set away from their defaults", though the user set none of them."""
    data = write_folder(tmp_path / "d", per_class=14)  # 42 images: an update at 32 (the recipe's), or every 8
    result = adapt(
        setup, data, "--method", "cafa-robust", "--recipe", "cifar10-c", "--lr", "1e30", "--batch-size", "8", *typed
    )
    line = fails(result, 3, "the model's outputs are NaN or infinite; check ")
    assert "mix_reference" not in line and "memory_expiry" not in line and "restart_weights" not in line
    if named is None:
        assert "options" not in line and "check --mean and --std" in line
    else:
        assert f"the method's options set away from their defaults {named}, --mean" in line


FLOORED = [
    ("--order", "dirichlet:1e-310"),
    ("--order", "dirichlet:4.9e-324"),
    ("--order", "dirichlet:1E-7"),
    ("--order", "dirichlet:1e7"),
    ("--order", "label-shift:1e-310"),
    ("--norm", "ema:1e-310"),
    ("--norm", " ema:0.0000001 "),
    ("--norm", "alpha:1e-310"),
    ("--norm", "alpha:5e-324"),
    ("--norm", "prior:1e-310"),
]


@pytest.mark.parametrize("flag, text", FLOORED, ids=[text.strip() for _, text in FLOORED])
def test_a_norm_or_order_number_below_the_floor_is_refused_before_anything_is_written(setup, tmp_path, flag, text):
    """`dirichlet:1e-310`, `ema:1e-310` and `alpha:1e-310` passed where every other number a user
    writes is read from 0.000001 (numbers.py): float32 reads 1e-310 as 0, so ema ran as the ema:0
    its forms refuse while the JSON said 1e-310. A 0 that is a setting of its own (alpha:0 the
    source's statistics, prior:0 the batch's, label-shift:0 an i.i.d. stream) stays one."""
    out = tmp_path / "p.csv"
    result = adapt(setup, setup["train"], "--method", "bn", flag, text, "--predictions", out)
    fails(result, 2, f"{flag} must be", "from 0.000001", f"not {text!r}")
    assert result.stdout == "" and not out.exists()


def test_the_norm_and_order_floors_take_their_bounds_and_the_zeros_that_are_settings():
    assert Norm.parse("ema:0.000001") == Norm("ema", 1e-6) and Norm.parse("ema:1") == Norm("ema", 1.0)
    assert Norm.parse("alpha:0") == Norm("alpha", 0.0) and Norm.parse("alpha:1e-6") == Norm("alpha", 1e-6)
    assert Norm.parse("prior:0") == Norm("prior", 0.0) and Norm.parse("prior:1e9") == Norm("prior", 1e9)
    assert parse_order("dirichlet:0.000001") == ("dirichlet", 1e-6) and parse_order("dirichlet:1e6")[1] == 1e6
    assert parse_order("label-shift:0") == ("label-shift", 0.0)
    for order in ("dirichlet:1e-310", "label-shift:5e-324"):
        with pytest.raises(UsageError, match="order"):
            parse_order(order)


def test_a_bench_order_or_recipe_norm_below_the_floor_is_refused_before_statistics(setup, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[bn]\nnorm = "alpha:1e-310"\n')
    for extra, code in ((["--orders", "iid,dirichlet:1e-310"], 2), (["--recipe", recipe], 3)):
        work = tmp_path / "work"
        result = invoke(
            "bench", setup["train"], "--methods", "bn", "--model", TINY_NET, "--weights", setup["weights"],
            "--train", setup["train"], *PLAIN, "--workdir", work, "--quiet", *extra,
        )  # fmt: skip
        fails(result, code, "from 0.000001", "1e-310")
        assert not work.exists() and result.stdout == ""


@pytest.mark.parametrize("table", ["[cafa]\nbatch_size = 10.5", "[cafa]\nlr = -1", "[cafa.options]\nnot_an_option = 1"])
def test_a_bench_recipe_file_is_checked_before_statistics_or_the_workdir_are_made(setup, tmp_path, table):
    """Statistics can take hours: a recipe file's mistake was found only after they were written."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(table + "\n")
    work = tmp_path / "work"
    result = bench(
        setup["train"],
        methods="cafa",
        weights=setup["weights"],
        train=setup["train"],
        fraction=1,
        recipe=recipe,
        workdir=work,
        quiet=True,
    )
    assert result.exit_code == 3 and str(recipe) in result.stderr, result.stderr
    assert not work.exists() and result.stdout == ""


@pytest.mark.parametrize("written", ["10.0", "true", '"10"', "0", "-3"])
def test_a_recipes_batch_size_is_a_whole_number(setup, tmp_path, written):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[tent]\nbatch_size = {written}\n")
    result = invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--method",
        "tent",
        "--recipe",
        recipe,
    )
    assert result.exit_code == 3, result.stderr
    assert str(recipe) in result.stderr and "batch-size must be a whole number" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_an_integer_too_long_to_read_in_a_config_or_recipe_is_one_line(setup, tmp_path):
    """tomllib raises a ValueError past Python's 4,300-digit limit, not its decode error:
    every command failed with a traceback on such a cafa.toml."""
    huge = "9" * 5000
    recipe = tmp_path / "big.toml"
    recipe.write_text(f"[tent]\nbatch_size = {huge}\n")
    result = invoke("adapt", "--model", TINY_NET, "--data", setup["train"], "--method", "tent", "--recipe", recipe)
    assert result.exit_code == 3 and "not valid TOML (an integer of more than 4,300 digits)" in result.stderr
    from cafa_cli.cli.app import command_options
    from cafa_cli.cli.defaults import read_defaults

    (tmp_path / "cafa.toml").write_text(f"[adapt]\nbatch_size = {huge}\n")
    with pytest.raises(UsageError, match=r"cafa.toml: not valid TOML \(an integer of more than 4,300 digits\)"):
        read_defaults(tmp_path, command_options())


@pytest.mark.parametrize("frozen", ["layr2", "layer1,nothere", "layer"])
def test_a_frozen_module_name_that_matches_nothing_is_refused(trained, frozen):
    """§6: a typo in sar's `frozen` froze nothing, silently; each name a user gives must hold
    some module (whole dotted components: `layer` is no component of `layer1`)."""
    import copy

    from cafa_cli.engine.adapter import Adapter
    from cafa_cli.methods import create

    model, gaussians, _, _ = trained
    names = [name for name, _ in model.named_modules()]
    with pytest.raises(UsageError, match="sar's option frozen: .* names no module of the model"):
        Adapter(copy.deepcopy(model), create("sar", gaussians, frozen=frozen))
    chosen = next(name.split(".")[-1] for name in names if name.split(".")[-1] not in ("", "model"))
    Adapter(copy.deepcopy(model), create("sar", gaussians, frozen=chosen))  # a name that holds a module is taken


def test_cafa_methods_prints_only_a_recipe_that_validates_and_escapes_control_characters(tmp_path):
    """§6: it printed `lr = -5` and exited 0, and wrote a `source` with ESC raw to the terminal."""
    bad = tmp_path / "bad.toml"
    for written in ("lr = -5", 'batch_size = "x"', "momentum = 1.5", 'norm = "alpha:2"'):
        bad.write_text(f"[tent]\n{written}\n")
        result = invoke("methods", "tent", "--recipe", bad)
        assert result.exit_code == 3 and str(bad) in result.stderr and result.stdout == "", (written, result.stderr)
    escaped = tmp_path / "esc.toml"
    escaped.write_text('[tent]\nlr = 0.5\nsource = "a\\u001b[31mred\\u0007"\n')
    result = invoke("methods", "tent", "--recipe", escaped)
    assert result.exit_code == 0 and "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert 'source = "a\\u001b[31mred\\u0007"' in result.stdout
    again = tmp_path / "again.toml"
    again.write_text(result.stdout)
    assert invoke("methods", "tent", "--recipe", again).stdout == result.stdout  # it reads back as it was


def test_the_users_preprocessing_replaces_the_models_before_anything_is_checked(monkeypatch):
    """§6: a timm model made with in_chans=1 declares its three-channel mean; with the user's
    --channels 1 --mean 0.5 --std 0.5 the declared values were checked first, and refused."""
    from cafa_cli.jobs.shared import inputs
    from cafa_cli.model import libraries

    declared = {"resize": 248, "crop": 224, "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    monkeypatch.setattr(libraries, "declared_preprocessing", lambda model, weights, args: {**declared, "channels": 1})
    ours = {"channels": 1, "mean": (0.5,), "std": (0.5,)}
    made = inputs.default_preprocessing("timm:vit_tiny_patch16_224", None, {"in_chans": 1}, ours)
    assert (made.channels, made.mean, made.std, made.resize, made.crop) == (1, (0.5,), (0.5,), 248, 224)
    with pytest.raises(UsageError, match="mean"):  # without the user's values the declaration is still checked
        inputs.default_preprocessing("timm:vit_tiny_patch16_224", None, {"in_chans": 1})
