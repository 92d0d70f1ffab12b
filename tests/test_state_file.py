"""A saved adaptation state is untrusted input (issue 60): it restores data into what the
Adapter built and nothing else. A crafted one constructs nothing, deletes nothing and
changes nothing; a foreign or damaged one is one InputError; a state of other settings,
options, weights or statistics is refused naming each difference; a second run on one
`--state` is refused while the first holds it."""

from __future__ import annotations

import copy
import fcntl
import zipfile

import pytest
import torch
from test_cli_adapt import setup  # noqa: F401  (its trained net, artifact and shifted test folder)
from test_deployment import adapter_of, saved_and_loaded

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.engine.state import MODULE, OBJECT
from cafa_cli.methods import create

# an object of the standard library reached from a cafa_cli module: dropping it deletes `name`
CLOSER = "cafa_cli.core.files:tempfile._TemporaryFileCloser"


def stepped(trained, name: str, batches: int = 3, **settings):
    adapter = adapter_of(trained, name, **settings)
    for batch in trained[2].split(25)[:batches]:
        adapter.step(batch)
    return adapter


def weights_of(adapter) -> dict:
    return {key: value.clone() for key, value in adapter.model.state_dict().items()}


def crafted_states(state: dict, victim: str) -> dict:
    """Each place a state can name a class or hold a value of the wrong kind, filled so."""
    # dropped, it closes its `file` (a second closer, already closed: no-op) and unlinks `name`;
    # the loader before issue 60 made both and the victim was gone
    inner = {OBJECT: CLOSER, "attributes": {"close_called": True}}
    closer = {OBJECT: CLOSER, "attributes": {"name": victim, "file": inner, "delete": True}}

    def edited(change) -> dict:
        copied = copy.deepcopy(state)
        change(copied)
        return copied

    return {
        "a new method attribute naming a class": edited(lambda s: s["method_state"].update(evil=closer)),
        "an object replaced by another class": edited(lambda s: s["method_state"].update(selection=closer)),
        "a class into an empty place": edited(
            lambda s: s["method_state"]["selection"]["attributes"].update(mean_probs=closer)
        ),  # fmt: skip
        "a class in a list": edited(lambda s: s["method_state"].update(params=[closer] * 6)),
        "a network where a tensor is": edited(
            lambda s: s["method_state"]["selection"]["attributes"].update(mean_probs={MODULE: {}})
        ),  # fmt: skip
        "a dunder attribute": edited(lambda s: s["method_state"].update(__class__="x")),
        "a method's method": edited(lambda s: s["method_state"].update(loss=1.0)),
        "a string where a tensor is": edited(lambda s: s["method_state"].update(params=["x"] * 6)),
        "a tensor of another dtype": edited(lambda s: s["method_state"].update(params=[torch.zeros(8).long()] * 6)),
        "a sparse tensor": edited(lambda s: s["method_state"].update(params=[torch.zeros(8).to_sparse()] * 6)),
        "a number where a string is": edited(lambda s: s["method_state"].update(params=[1.0] * 6)),
        "an option in the method's state": edited(lambda s: s["method_state"].update(entropy_margin=0.0)),
        "no adaptation entry": edited(lambda s: s.pop("adaptation")),
        "an entry too many": edited(lambda s: s.update(extra=1)),
        "another model's weights": edited(lambda s: s.update(model={"weight": torch.zeros(3)})),
        "a weight of another shape": edited(lambda s: s["model"].update({next(iter(s["model"])): torch.zeros(99)})),
        "the running statistics of another model": edited(lambda s: s["model"].popitem()),
        "other optimiser groups": edited(lambda s: s["optimizer"]["param_groups"].append({})),
        "another learning rate in the optimiser": edited(lambda s: s["optimizer"]["param_groups"][0].update(lr=9.0)),
        "the optimiser state of other parameters": edited(lambda s: s["optimizer"]["state"].update({99: {}})),
        "a bad random number generator state": edited(lambda s: s.update(rng=torch.zeros(3, dtype=torch.uint8))),
        "a generator state of floats": edited(lambda s: s.update(rng=s["rng"].float())),
        "a list where the weights are": edited(lambda s: s.update(model=[1, 2])),
        "the skipped count as a string": edited(lambda s: s.update(skipped="0")),
        "a scaler where there is none": edited(lambda s: s.update(scaler={"scale": 1.0})),
    }


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
def test_a_crafted_state_constructs_nothing_deletes_nothing_and_leaves_the_adapter_as_it_was(trained, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    state = saved_and_loaded(stepped(trained, "eata").state_dict())
    for what, crafted in crafted_states(state, str(victim)).items():
        adapter = stepped(trained, "eata", batches=2)
        before, method_before = weights_of(adapter), adapter.method.state_dict()
        with pytest.raises(InputError, match="not a state of this adaptation|not a saved Adapter state"):
            adapter.load_state_dict(saved_and_loaded(crafted))
        import gc

        gc.collect()  # what the file named would act when it is dropped
        assert victim.read_text() == "keep me", what
        assert all(torch.equal(before[k], v) for k, v in adapter.model.state_dict().items()), what
        after = adapter.method.state_dict()
        assert after.keys() == method_before.keys(), what  # no attribute added, none taken away
        assert torch.equal(after["selection"]["attributes"]["mean_probs"],
                           method_before["selection"]["attributes"]["mean_probs"]), what  # fmt: skip


def test_a_refused_state_leaves_an_adapter_that_steps_as_one_never_given_it(trained):
    """A state that fails halfway (its weights and optimiser fit, its method state does not)
    leaves the Adapter's weights, optimiser, generator and method as they were."""
    x = trained[2]
    state = saved_and_loaded(stepped(trained, "eata", batches=5).state_dict())
    state["method_state"]["selection"] = {OBJECT: CLOSER, "attributes": {}}
    untouched, refused = stepped(trained, "eata", batches=2), stepped(trained, "eata", batches=2)
    torch.manual_seed(1)
    generator = torch.get_rng_state()
    with pytest.raises(InputError, match="method_state.selection"):
        refused.load_state_dict(state)  # its weights and optimiser were poured in before the method's state
    assert torch.equal(torch.get_rng_state(), generator)
    for batch in x.split(25)[2:5]:
        assert torch.equal(refused.step(batch), untouched.step(batch))


@pytest.mark.parametrize(
    ("name", "saved", "typed", "difference"),
    [
        ("deyo", {"plpd_threshold": 0.2}, {"plpd_threshold": 0.9}, "option plpd_threshold 0.2 (here 0.9)"),
        ("eata", {"entropy_margin": 0.5}, {}, "option entropy_margin 0.5 (here"),
        ("tent", {}, {"lr": 0.5}, "lr 0.01 (here 0.5)"),
    ],
)
def test_a_state_of_other_options_or_settings_is_refused_naming_each(trained, name, saved, typed, difference):
    model, gaussians, x, _ = trained
    adapter_settings = {key: typed.pop(key) for key in list(typed) if key == "lr"}

    def made(options: dict, **settings):
        method = create(name, None, "cpu", **options)
        from cafa_cli.engine.adapter import Adapter

        return Adapter(copy.deepcopy(model), method, "cpu", **{"lr": 1e-2, **settings})

    state = saved_and_loaded(made(saved).state_dict())
    with pytest.raises(UsageError, match="another adaptation") as refused:
        made(typed, **adapter_settings).load_state_dict(state)
    assert difference in str(refused.value)


def test_a_state_of_other_weights_statistics_or_fisher_is_refused(trained):
    model, gaussians, x, _ = trained
    from cafa_cli.engine.adapter import Adapter

    state = saved_and_loaded(adapter_of(trained, "cafa").state_dict())
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    with pytest.raises(UsageError, match="weights sha256 [0-9a-f]{12}… \\(here [0-9a-f]{12}…\\)"):
        Adapter(other, create("cafa", gaussians, "cpu"), "cpu", lr=1e-2).load_state_dict(state)
    shifted = copy.deepcopy(gaussians)
    shifted.means += 1
    with pytest.raises(UsageError, match="gaussians sha256"):
        Adapter(copy.deepcopy(model), create("cafa", shifted, "cpu"), "cpu", lr=1e-2).load_state_dict(state)
    # EATA with a Fisher (clean source images) and without it (it runs as ETA) are two adaptations
    batches = [x[:20]]
    with_fisher = Adapter(copy.deepcopy(model), create("eata", None, "cpu", fisher_batches=batches), "cpu", lr=1e-2)
    without = Adapter(copy.deepcopy(model), create("eata"), "cpu", lr=1e-2)
    with pytest.raises(UsageError, match="fisher sha256 [0-9a-f]{12}… \\(here none\\)"):
        without.load_state_dict(saved_and_loaded(with_fisher.state_dict()))


def test_a_state_of_an_earlier_format_is_named_so(trained):
    state = saved_and_loaded(adapter_of(trained, "tent").state_dict())
    state["format"] = "cafa-adapter-state-1"
    with pytest.raises(InputError, match="saved by another version of cafa \\(cafa-adapter-state-1"):
        adapter_of(trained, "tent").load_state_dict(state)


def resume_args(setup):
    return [setup["test"], "--method", "eata", "--reset", "never", "-q"]


def test_cafa_adapt_refuses_a_crafted_state_before_any_record_and_deletes_nothing(setup, tmp_path):
    from helpers import adapt, fails

    state = tmp_path / "s.pt"
    made = adapt(setup, *resume_args(setup), "--state", state)
    assert made.exit_code == 0, made.stderr
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    saved = torch.load(state, weights_only=True)
    cases = crafted_states(saved, str(victim))  # the library test above tries them all; here one of each layer
    for what in ("a new method attribute naming a class", "a class in a list", "another model's weights"):
        crafted = cases[what]
        evil = tmp_path / "evil.pt"
        torch.save(crafted, evil)
        written = evil.read_bytes()
        result = adapt(setup, *resume_args(setup), "--state", evil)
        line = fails(result, 3, f"--state {evil}:", "remove it to start from the source model")
        assert result.stdout == "", what  # refused before the first record
        assert victim.read_text() == "keep me", (what, line)
        assert evil.read_bytes() == written, what  # not overwritten by the refused run


def test_cafa_adapt_refuses_a_state_typed_over_and_one_that_would_inflate(setup, tmp_path):
    from helpers import adapt, fails

    state = tmp_path / "s.pt"
    assert adapt(setup, *resume_args(setup), "--state", state).exit_code == 0
    fails(
        adapt(setup, *resume_args(setup), "--method-option", "entropy_margin=0.3", "--state", state),
        2,
        "another adaptation: option entropy_margin",
    )
    # a zip whose deflated entry announces a thousandfold its size
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("bomb/data.pkl", b"\0" * (8 << 20))
    fails(adapt(setup, *resume_args(setup), "--state", bomb), 3, "decompression bomb", "remove it")


def test_a_second_run_on_a_state_in_use_is_refused_at_once(setup, tmp_path):
    from helpers import adapt, fails

    state = tmp_path / "s.pt"
    lock = open(tmp_path / ".s.pt.lock", "w")  # another run holds it
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fails(adapt(setup, *resume_args(setup), "--state", state), 2, f"--state {state} is in use by another run")
        assert not state.exists()
    finally:
        lock.close()
    assert adapt(setup, *resume_args(setup), "--state", state).exit_code == 0  # once it is free
