"""The Adapter as an engineer deploys it (issue 44): a network exported for serving one
image at a time, a state saved and resumed bit for bit, weights whose precision cannot be
ruined silently, and one thread at a time."""

from __future__ import annotations

import copy
import inspect
import io
import threading

import pytest
import torch
from helpers import classifier_methods
from test_cli_adapt import setup  # noqa: F401  (its trained net, artifact and shifted test folder)

from cafa_cli.core.errors import CafaError, UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import REGISTRY, create
from cafa_cli.methods.tent import Tent

NAMES = tuple(REGISTRY)
OPTIONS = {
    "cotta": {"augmentations": 2},
    "rotta": {"memory_size": 12, "update_every": 12},
    "cafa-robust": {"memory_size": 12, "update_every": 12},
    "lame": {},
    "t3a": {"filter_k": 5},
    "sotta": {"memory_size": 12, "update_every": 12, "threshold": 0.5},
    "stamp": {"augmentations": 2, "memory_size": 12},
}


def adapter_of(trained, name: str, **settings) -> Adapter:
    model, gaussians, _, _ = trained
    method = create(name, gaussians, "cpu", **OPTIONS.get(name, {}))  # ignored by the methods that need none
    return Adapter(copy.deepcopy(model), method, "cpu", lr=1e-2, **settings)


def error(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(1) != labels).float().mean())


@pytest.mark.parametrize("norm", ["batch", "prior:16", "ema:0.05", "source"])
def test_an_exported_network_predicts_one_image_as_a_batch_and_near_the_adapted_error(trained, norm):
    _, _, x, y = trained
    adapter = adapter_of(trained, "tent", norm=norm)
    streamed = torch.cat([adapter.step(batch) for batch in x.split(30)])
    served = adapter.export()
    assert not any("cafa_cli" in type(m).__module__ for m in served.modules())  # plain torch layers only
    with torch.no_grad():
        batch = served(x)
        alone = torch.cat([served(image[None]) for image in x])
    assert error(alone, y) == error(batch, y)  # frozen statistics: the batch does not matter
    torch.testing.assert_close(alone, batch, rtol=1e-4, atol=1e-5)
    # the statistics the stream arrived at serve about as well as the stream's own batches did
    assert error(batch, y) <= error(streamed, y) + 0.05, (error(batch, y), error(streamed, y))


def test_export_loads_into_the_plain_architecture_and_leaves_the_adapter_as_it_was(trained):
    model, _, x, _ = trained
    adapter = adapter_of(trained, "cafa")
    for batch in x.split(30):
        adapter.step(batch)
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    served = adapter.export()
    plain = copy.deepcopy(model.model)
    plain.load_state_dict(served.state_dict())  # no missing or unexpected keys: the source architecture's
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), served(x))
    assert all(torch.equal(before[k], v) for k, v in adapter.model.state_dict().items())


def test_a_teacher_serves_for_a_teacher_student_method_and_batch_methods_refuse(trained):
    _, _, x, _ = trained
    rotta = adapter_of(trained, "rotta")
    for batch in x.split(30):
        rotta.step(batch)
    with torch.no_grad():
        served = rotta.export()(x[:5])
    assert served.shape == (5, 3) and torch.isfinite(served).all()
    for name in ("t3a", "lame", "neo"):
        with pytest.raises(UsageError, match=f"{name} predicts with more than its network"):
            adapter_of(trained, name).export()


def saved_and_loaded(state: dict) -> dict:
    """Through a file, as a restart reads it: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", classifier_methods())
def test_a_saved_state_goes_on_in_a_new_adapter_bit_for_bit(trained, name):
    """N batches, save, load into a fresh Adapter: its next M batches are those of N + M in one go."""
    _, _, x, _ = trained
    batches = x.split(25)
    first = adapter_of(trained, name, norm="ema:0.05" if name in ("tent", "sar") else "batch")
    for batch in batches[:6]:
        first.step(batch)
    state = saved_and_loaded(first.state_dict())
    went_on = [first.step(batch) for batch in batches[6:]]
    second = adapter_of(trained, name, norm="ema:0.05" if name in ("tent", "sar") else "batch")
    second.load_state_dict(state)
    resumed = [second.step(batch) for batch in batches[6:]]
    assert all(torch.equal(a, b) for a, b in zip(went_on, resumed))
    assert all(torch.equal(a, b) for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()))


def test_a_state_of_another_adaptation_is_refused(trained):
    state = adapter_of(trained, "tent").state_dict()
    with pytest.raises(UsageError, match="another adaptation: lr 0.01 \\(here 0.001\\)"):
        model, _, _, _ = trained
        Adapter(copy.deepcopy(model), create("tent"), "cpu").load_state_dict(state)
    with pytest.raises(CafaError, match="not a saved Adapter state"):
        adapter_of(trained, "tent").load_state_dict({"model": {}})


def test_float16_weights_with_adam_are_refused_and_never_written_non_finite(trained):
    model, _, x, _ = trained
    with pytest.raises(UsageError, match="float16, and Adam's update underflows"):
        Adapter(copy.deepcopy(model).half(), create("tent"), "cpu")
    for dtype, optimizer in [(torch.float16, "sgd"), (torch.bfloat16, "adam"), (torch.bfloat16, "sgd")]:
        adapter = Adapter(copy.deepcopy(model).to(dtype), create("tent"), "cpu", optimizer=optimizer, lr=1e-2)
        for batch in x.split(50):
            adapter.step(batch.to(dtype))
        assert all(torch.isfinite(p).all() for p in adapter.params) and adapter.skipped_steps == 0, (dtype, optimizer)


class Overflowing(Tent):
    """Finite losses and gradients whose update overflows the weights (lr 1e10 · 1e30)."""

    def loss(self, logits, features):
        return logits.sum() * 1e30


def test_an_update_that_writes_a_value_that_is_not_finite_is_undone_and_counted(trained):
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), Overflowing(), "cpu", optimizer="sgd", lr=1e10, momentum=0.0)
    before = [p.clone() for p in adapter.params]
    for batch in x.split(50):
        adapter.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, adapter.params))
    assert adapter.skipped_steps == len(x.split(50))


def test_one_thread_at_a_time(trained):
    _, _, x, _ = trained
    adapter = adapter_of(trained, "tent")
    failures = []
    adapter._in_use.acquire()  # a step under way in this thread
    try:
        worker = threading.Thread(target=lambda: failures.append(pytest.raises(UsageError, adapter.step, x[:4])))
        worker.start()
        worker.join()
    finally:
        adapter._in_use.release()
    assert "already in a call from another thread" in str(failures[0].value)
    assert adapter.step(x[:4]).shape == (4, 3)  # free again


def _public_calls() -> list[str]:
    """Every public method of the Adapter, its own and those of its serving base (its properties
    aside): each reads or changes the adaptation's state, but adapted(), which reads the parameters'
    shapes only."""
    return [
        name
        for name in dir(Adapter)
        if not name.startswith("_") and callable(inspect.getattr_static(Adapter, name)) and name != "adapted"
    ]


def test_every_public_call_is_one_thread_at_a_time(trained, tmp_path):
    """reset() was not guarded (issue 60): each public call, while another thread is in one,
    is a one-line error that changes nothing; apply() inside a method's own step is the same thread."""
    _, _, x, _ = trained
    adapter = adapter_of(trained, "tent")
    state, before = adapter.state_dict(), copy.deepcopy(adapter.model.state_dict())
    arguments = {
        "step": (x[:4],),
        "features": (x[:4],),
        "load_state_dict": (state,),
        "apply": (torch.ones(()),),
        "export_onnx": (tmp_path / "net.onnx", x[:1]),
    }
    inside, leave = threading.Event(), threading.Event()

    def in_a_call():
        with adapter._one_thread():
            inside.set()
            leave.wait(60)

    holder = threading.Thread(target=in_a_call)
    holder.start()
    inside.wait(60)
    try:
        assert set(_public_calls()) >= {"reset", "step", "features", "export", "export_onnx", "state_dict"}
        for name in _public_calls():
            with pytest.raises(UsageError, match="already in a call from another thread"):
                getattr(adapter, name)(*arguments.get(name, ()))
    finally:
        leave.set()
        holder.join()
    assert all(torch.equal(before[k], v) for k, v in adapter.model.state_dict().items())
    adapter.reset()  # free again
    assert adapter.step(x[:4]).shape == (4, 3)
    sar = adapter_of(trained, "sar")  # its own update calls apply() from inside its step
    assert sar.step(x[:4]).shape == (4, 3)


def test_a_reset_during_a_step_in_another_thread_is_refused_and_the_step_is_whole(trained):
    """A reset() between a step's forward pass and its backward pass corrupted the step (a raw
    autograd error) and left weights that were neither the source's nor the step's."""
    _, _, x, _ = trained
    adapter, alone = adapter_of(trained, "tent"), adapter_of(trained, "tent")
    expected = alone.step(x[:8])
    loss, in_step, go = adapter.method.loss, threading.Event(), threading.Event()

    def waiting_loss(*args):
        in_step.set()  # the forward pass is done; the backward pass and the update come next
        go.wait(60)
        return loss(*args)

    adapter.method.loss = waiting_loss
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(logits=adapter.step(x[:8])))
    worker.start()
    in_step.wait(60)
    try:
        with pytest.raises(UsageError, match="already in a call from another thread"):
            adapter.reset()
    finally:
        go.set()
        worker.join()
    assert torch.equal(outcome["logits"], expected)
    assert all(torch.equal(v, alone.model.state_dict()[k]) for k, v in adapter.model.state_dict().items())


def test_rough_edges_get_one_line_errors(trained):
    model, _, x, _ = trained
    with pytest.raises(UsageError, match="takes a FeatureClassifier, not a bare"):
        Adapter(copy.deepcopy(model.model), create("tent"), "cpu")
    adapter = adapter_of(trained, "tent")
    with pytest.raises(UsageError, match="one image or more"):
        adapter.step(x[:0])
    with pytest.raises(UsageError, match="one image or more"):
        adapter.features(x[:0])


def test_cafa_adapt_state_goes_on_with_a_continual_stream_across_runs(setup, tmp_path):
    """Two runs with --state, domain A then domain B, predict B as one continual run of A and B."""
    from conftest import write_folder
    from helpers import adapt, rows

    other = write_folder(tmp_path / "other", per_class=6, seed=9, shift=0.5)
    common = ["--method", "tent", "--reset", "never", "-q"]
    both = adapt(setup, setup["test"], "--data", other, *common)
    state = tmp_path / "s.pt"
    first = adapt(setup, setup["test"], *common, "--state", state)
    assert first.exit_code == 0 and state.is_file(), first.stderr
    second = adapt(setup, other, *common, "--state", state)
    assert both.exit_code == second.exit_code == 0, second.stderr
    tail = rows(both)[len(rows(first)) :]
    assert rows(second) == tail and len(tail) == 18
    assert torch.load(state, weights_only=True)["adaptation"]["method"] == "tent"  # no pickled code in it


def test_a_recipes_reset_goes_with_a_state_and_a_reset_not_typed_is_named_by_where_it_came_from(setup, tmp_path):
    """A recipe's reset = "never" with --state was refused, blaming --reset domain, which was
    not typed: the check ran before the recipe was applied."""
    from helpers import adapt, fails

    never, every = tmp_path / "never.toml", tmp_path / "every.toml"
    never.write_text('[tent]\nsource = "mine"\nreset = "never"\n', encoding="utf-8")
    every.write_text('[tent]\nsource = "mine"\nreset = "every:5"\n', encoding="utf-8")
    state = tmp_path / "s.pt"
    made = adapt(setup, setup["test"], "--method", "tent", "--recipe", never, "--state", state)
    assert made.exit_code == 0 and state.is_file(), made.stderr
    fails(adapt(setup, setup["test"], "--method", "tent", "--state", state), 2, "--reset domain (the default) starts")
    fails(adapt(setup, setup["test"], "--reset", "episodic", "--state", state), 2, "--reset episodic starts each batch")
    fails(
        adapt(setup, setup["test"], "--method", "tent", "--recipe", every, "--state", state),
        2,
        f"the count of updates of --reset every:5 (from the recipe {every})",
    )
    fails(
        adapt(setup, setup["test"], "--method", "rdumb", "--recipe", "cifar10-c", "--state", state),
        2,
        "--reset every:1000 (from rdumb's cifar10-c recipe)",
    )


def test_cafa_adapt_state_needs_a_continual_stream_and_refuses_another_adaptations(setup, tmp_path):
    from helpers import adapt, fails

    fails(adapt(setup, setup["test"], "--state", tmp_path / "s.pt"), 2, "--state goes on with a continual stream")
    state = tmp_path / "s.pt"
    made = adapt(setup, setup["test"], "--method", "tent", "--reset", "never", "-q", "--state", state)
    assert made.exit_code == 0, made.stderr
    fails(
        adapt(setup, setup["test"], "--method", "tent", "--reset", "never", "--lr", "0.5", "--state", state),
        2,
        "another adaptation: lr 0.001 (here 0.5)",
    )
    # given where an artifact or weights go, it is named as what it is, with the option that takes it
    from conftest import TINY_NET
    from helpers import invoke

    assert "--weights" not in fails(invoke("inspect", state), 3, "an adaptation state cafa adapt saved", "--state")
    fails(adapt(setup, setup["test"], "--stats", state), 3, "not a cafa artifact: give it as --state")
    fails(
        invoke("adapt", setup["test"], "--method", "source", "--model", TINY_NET, "--weights", state),
        3,
        f"--weights {state}: an adaptation state cafa adapt saved, not weights: give it as --state",
    )
    state.write_bytes(b"not a state")
    fails(adapt(setup, setup["test"], "--method", "tent", "--reset", "never", "--state", state), 3, "not a state")


def test_cafa_adapt_export_writes_a_network_that_serves_one_image_as_a_batch(setup, tmp_path):
    import tiny_net
    from helpers import adapt
    from safetensors.torch import load_file

    exported = tmp_path / "served.safetensors"
    result = adapt(setup, setup["test"], "--method", "tent", "-q", "--export", exported)
    assert result.exit_code == 0, result.stderr
    net = tiny_net.build().eval()
    net.load_state_dict(load_file(exported))  # the plain architecture, no key missing or left over
    x = torch.rand(8, 1, 16, 16) * 255
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([net(image[None]) for image in x]), net(x), rtol=1e-4, atol=1e-3)


def test_a_signal_during_a_step_waits_for_it_and_a_second_one_does_not():
    import signal

    from cafa_cli.core.interrupts import interrupt, whole

    done = []
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        with whole():
            interrupt(signal.SIGINT)  # deferred: the step goes on
            done.append("step")
    assert done == ["step"]
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with whole():
            interrupt(signal.SIGINT)
            interrupt(signal.SIGTERM)  # a second one while the first waits: at once
            done.append("never")
    assert done == ["step"]


def test_cafa_adapt_export_of_a_batch_method_is_refused_before_any_record(setup, tmp_path):
    from helpers import adapt, fails

    exported = tmp_path / "served.safetensors"
    refused = adapt(setup, setup["test"], "--method", "lame", "--export", exported)
    fails(refused, 2, "lame predicts with more than its network")
    assert refused.stdout == "" and not exported.exists()
