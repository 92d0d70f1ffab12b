"""Losses, parameter selection, the online protocol, reset, and a synthetic shift."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import tiny_net
import torch
import torchvision
from helpers import classifier_methods

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.method import Method, select_parameters
from cafa_cli.engine.norms import BatchStatisticsNorm, use_test_batch_norm
from cafa_cli.methods import REGISTRY, create
from cafa_cli.methods.shared import losses
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments

NAMES = tuple(REGISTRY)


def reference_cafa(distances: np.ndarray, labels: np.ndarray) -> float:
    d = distances.astype(np.float64)
    return float(np.mean(np.log(d[np.arange(len(d)), labels] / d.sum(1))))


def test_cafa_loss_matches_float64_reference():
    rng = np.random.default_rng(0)
    distances = rng.gamma(2.0, 50.0, size=(32, 10))
    labels = rng.integers(0, 10, size=32)
    got = losses.cafa(torch.tensor(distances, dtype=torch.float32), torch.tensor(labels))
    assert got.item() == pytest.approx(reference_cafa(distances, labels), rel=1e-5)


def test_cafa_loss_gradient_matches_finite_differences():
    torch.manual_seed(0)
    distances = (torch.rand(6, 4, dtype=torch.float64) * 10 + 0.5).requires_grad_()
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    assert torch.autograd.gradcheck(lambda d: losses.cafa(d, labels), (distances,))


def test_cafa_loss_is_finite_at_zero_and_huge_distances():
    distances = torch.tensor([[0.0, 1.0, 2.0], [1e38, 3.0, float("inf")], [0.0, 0.0, 0.0]], requires_grad=True)
    loss = losses.cafa(distances, torch.tensor([0, 0, 1]))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(distances.grad).all()


def test_pseudo_labels_carry_no_gradient():
    logits = torch.randn(5, 3, requires_grad=True)
    distances = (torch.rand(5, 3) + 0.1).requires_grad_()
    losses.cafa(distances, logits.argmax(1)).backward()
    assert logits.grad is None
    assert distances.grad is not None and distances.grad.abs().sum() > 0


def test_global_alignment_is_zero_when_batch_matches_source():
    z = torch.randn(64, 5, dtype=torch.float64)
    mean = z.mean(0)
    covariance = (z - mean).T @ (z - mean) / len(z)
    assert losses.global_alignment(z, mean.float(), covariance.float()).item() == pytest.approx(0.0, abs=1e-5)
    assert losses.global_alignment(z + 1, mean.float(), covariance.float()).item() == pytest.approx(5.0, rel=1e-4)


def test_entropy_of_uniform_prediction_is_log_classes():
    assert losses.entropy(torch.zeros(4, 10)).item() == pytest.approx(np.log(10), rel=1e-6)


def test_trainable_set_is_exactly_the_norm_affines_including_downsample():
    net = FeatureClassifier(torchvision.models.resnet18(num_classes=4))
    swapped = use_test_batch_norm(net)
    params = select_parameters(net, "norm")
    batch_norms = [m for m in net.modules() if isinstance(m, BatchStatisticsNorm)]
    assert swapped == len(batch_norms) == 20  # 17 in the blocks + 3 in downsample branches
    assert {id(p) for p in params} == {id(p) for m in batch_norms for p in (m.weight, m.bias)}
    assert all(p.requires_grad == (id(p) in {id(q) for q in params}) for p in net.parameters())
    downsample_bn = net.model.layer2[0].downsample[1]
    assert isinstance(downsample_bn, BatchStatisticsNorm) and downsample_bn.weight.requires_grad


def test_params_all_frees_the_feature_extractor_but_not_the_classifier():
    net = FeatureClassifier(tiny_net.build())
    params = select_parameters(net, "all")
    assert not any(p.requires_grad for p in net.classifier.parameters())
    assert len(params) == len(list(net.parameters())) - 2


def test_layer_norm_affines_are_adapted():
    net = FeatureClassifier(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)))
    params = select_parameters(net, "norm")
    assert [tuple(p.shape) for p in params] == [(8,), (8,)]


@pytest.mark.parametrize("method", ["tent", "pl"])
def test_a_model_without_normalisation_layers_is_a_usage_error_for_gradient_methods(method):
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with pytest.raises(UsageError, match="no normalisation layers.*`params` all"):
        Adapter(FeatureClassifier(mlp), create(method))
    adapter = Adapter(FeatureClassifier(copy.deepcopy(mlp)), create(method), params="all")
    assert adapter.step(torch.randn(4, 3, 2, 2)).shape == (4, 3)
    bn = Adapter(FeatureClassifier(copy.deepcopy(mlp)), create("bn"))
    assert bn.step(torch.randn(4, 3, 2, 2)).shape == (4, 3) and bn.batch_norms == 0  # the CLI warns: bn = source here


def test_test_batch_norm_uses_batch_statistics_and_the_prior_mixes_them():
    bn = torch.nn.BatchNorm2d(3).eval()
    bn.running_mean.fill_(5.0)
    bn.running_var.fill_(4.0)
    x = torch.randn(8, 3, 4, 4) * 2 + 1
    out = BatchStatisticsNorm(bn)(x)
    assert out.mean((0, 2, 3)).abs().max() < 1e-5  # normalised by the batch, not by the source stats
    mixed = BatchStatisticsNorm(bn, "prior:8")(x)
    mean = (8 * 5.0 + 8 * x.mean((0, 2, 3))) / 16
    var = (8 * 4.0 + 8 * x.var((0, 2, 3), unbiased=True)) / 16  # the batch's unbiased variance, as the authors'
    expected = (x - mean.view(1, -1, 1, 1)) / (var.view(1, -1, 1, 1) + bn.eps).sqrt()
    torch.testing.assert_close(mixed, expected)


def test_batch_size_one_works_with_a_prior():
    net = FeatureClassifier(tiny_net.build()).eval()
    adapter = Adapter(net, create("tent"), norm="prior:16")
    logits = adapter.step(torch.randn(1, 1, 16, 16))
    assert logits.shape == (1, 3) and torch.isfinite(logits).all()


def stream_error(adapter: Adapter, x, y, batch=50) -> float:
    wrong = sum(
        (adapter.step(x[i : i + batch]).argmax(1) != y[i : i + batch]).sum().item() for i in range(0, len(x), batch)
    )
    return wrong / len(x)


def test_bn_tent_and_cafa_each_beat_source_on_a_synthetic_shift(trained):
    model, gaussians, x, y = trained
    errors = {
        m: stream_error(Adapter(copy.deepcopy(model), create(m, gaussians), lr=1e-2), x, y)
        for m in ("source", "bn", "tent", "cafa")
    }
    assert errors["source"] > 0.4, errors
    for method in ("bn", "tent", "cafa"):
        assert errors[method] < errors["source"] - 0.2, errors


def test_prediction_comes_from_the_forward_pass_before_the_update(trained):
    model, gaussians, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("cafa", gaussians), lr=1e-2)
    frozen = copy.deepcopy(adapter.model)
    with torch.no_grad():
        before, _ = frozen(x[:50])
    logits = adapter.step(x[:50])
    torch.testing.assert_close(logits, before)
    with torch.no_grad():
        after, _ = adapter.model(x[:50])
    assert not torch.allclose(after, before)  # the update did happen, after the prediction


def test_reset_restores_the_source_weights_bit_for_bit(trained):
    model, gaussians, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("cafa", gaussians), lr=1e-2)
    source = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    for i in range(0, 150, 50):
        adapter.step(x[i : i + 50])
    assert any(not torch.equal(v, adapter.model.state_dict()[k]) for k, v in source.items())
    adapter.reset()
    assert all(torch.equal(v, adapter.model.state_dict()[k]) for k, v in source.items())


@pytest.mark.parametrize("method", classifier_methods())
def test_every_method_runs_and_keeps_weights_finite(trained, method):
    """Gradient methods move the weights (finitely); source, bn and the output-only ones (t3a, lame) never touch them."""
    model, gaussians, x, _ = trained
    # rotta, cafa-robust and sotta step on their memory every 64 samples by default (sotta's stores p̂ ≥ 0.99 alone)
    options = {"update_every": 50} if method in ("rotta", "cafa-robust", "sotta") else {}
    if method == "sotta":
        options["threshold"] = 0.5
    adapter = Adapter(copy.deepcopy(model), create(method, gaussians, **options), lr=1e-2, steps=2)
    before = [p.detach().clone() for p in adapter.model.parameters()]
    logits = adapter.step(x[:50])
    assert logits.shape == (50, 3) and torch.isfinite(logits).all()
    assert all(torch.isfinite(p).all() for p in adapter.model.parameters())
    moved = any(not torch.equal(b, p) for b, p in zip(before, adapter.model.parameters()))
    assert moved == adapter.method.trains == (method not in ("source", "bn", "t3a", "lame", "ttaug", "neo"))


def test_non_finite_loss_skips_the_step_and_is_counted(trained):
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"))
    adapter.method.loss = lambda logits, features: logits.sum() * float("nan")
    before = weights_of(adapter)
    adapter.step(x[:10])
    assert adapter.skipped_steps == 1
    assert all(torch.equal(v, adapter.model.state_dict()[k]) for k, v in before.items())


def weights_of(adapter) -> dict:
    """The model's state but the test statistics a served model would take (norms.py's served_*),
    which every forward pass moves, whether its update is taken or not."""
    return {k: v.clone() for k, v in adapter.model.state_dict().items() if ".served_" not in k}


def nan_loss(logits, features):
    return logits.sum() * float("nan")


def nan_gradient(logits, features):
    """Finite (0), with NaN gradients: sqrt's infinite slope at 0 times abs's zero one."""
    return (logits - logits.detach()).abs().sqrt().sum()


@pytest.mark.parametrize("bad_loss", [nan_loss, nan_gradient], ids=["loss", "gradient"])
@pytest.mark.parametrize("first", [True, False], ids=["first-batch", "later-batch"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd", "nesterov"])
@pytest.mark.parametrize("fused", [False, True], ids=["undone", "fused"])
def test_a_skipped_update_leaves_weights_and_optimiser_state_as_if_the_batch_had_not_come(
    trained, bad_loss, first, optimizer, fused
):
    """Decided on the device (no host synchronisation) and still exact: the weights, the
    moments, the momentum and Adam's step count after good, bad, good batches are bit for
    bit those after the two good ones; with two steps a batch, the bad batch counts once."""
    model, gaussians, x, _ = trained

    def adapter():
        made = Adapter(copy.deepcopy(model), create("cafa", gaussians), optimizer=optimizer, lr=1e-2, steps=2)
        made._fused = fused  # CUDA's way, torch's fused optimisers, which the CPU has too
        made.optimizer = made._new_optimizer()
        return made

    def state(made):
        tensors = [p.detach() for p in made.model.parameters()]
        tensors += [t for s in made.optimizer.state_dict()["state"].values() for t in s.values()]
        return [t.clone() for t in tensors]

    with_bad, without = adapter(), adapter()
    good = [x[:50], x[50:100]]
    loss = with_bad.method.loss
    for i, images in enumerate(good):
        if i == (0 if first else 1):
            with_bad.method.loss = bad_loss
            with_bad.step(x[100:150])
            with_bad.method.loss = loss
        with_bad.step(images)
        without.step(images)
    assert with_bad.skipped_steps == 1 and without.skipped_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(state(with_bad), state(without)))


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_reset_and_steps_under_inference_mode(trained, optimizer):
    """An evaluation loop under torch.inference_mode may reset the Adapter too: the fresh
    optimiser state, made before the first step, must still take the steps' updates."""
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"), optimizer=optimizer, lr=1e-2)
    with torch.inference_mode():
        adapter.step(x[:50])
        adapter.reset()
        first = adapter.step(x[50:100])
        second = adapter.step(x[50:100])
    assert not torch.equal(first, second) and adapter.skipped_steps == 0


def test_fp16_loss_scaling_steps_like_fp32_and_an_overflow_skips_and_halves_the_scale(trained):
    """fp16 is CUDA-only, so the scaler's logic is checked here with a CPU GradScaler."""
    model, gaussians, x, _ = trained
    plain = Adapter(copy.deepcopy(model), create("cafa", gaussians), optimizer="sgd", lr=1e-2)
    scaled = Adapter(copy.deepcopy(model), create("cafa", gaussians), optimizer="sgd", lr=1e-2)
    assert plain.scaler is None
    scaled.scaler = torch.amp.GradScaler("cpu")
    for i in range(0, 100, 50):
        plain.step(x[i : i + 50])
        scaled.step(x[i : i + 50])
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(scaled.model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert scaled.skipped_steps == 0

    before = weights_of(scaled)
    loss = scaled.method.loss
    scaled.method.loss = lambda logits, features: loss(logits, features) * 1e30  # finite, until scaled
    scaled.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    scaled.step(x[:50])
    assert scaled.skipped_steps == 1 and scaled.scaler.get_scale() == 2.0**126
    assert all(torch.equal(v, scaled.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("method", ["cafa", "global-fa", "intra", "euclidean"])
def test_a_method_that_needs_statistics_without_them_is_a_usage_error(method):
    with pytest.raises(UsageError, match=f"the method {method} needs class statistics: give it the gaussians"):
        create(method)


def test_the_device_may_be_named_by_a_string():
    adapter = Adapter(FeatureClassifier(tiny_net.build()), create("tent"), device="cpu")
    assert adapter.device == torch.device("cpu") and adapter.step(torch.randn(4, 1, 16, 16)).shape == (4, 3)
    auto = Adapter(FeatureClassifier(tiny_net.build()), create("tent"), device="auto")  # as cafa adapt --device auto
    assert auto.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_statistics_of_another_shape_than_the_model_are_a_usage_error():
    moments = ClassMoments(4, 6)
    moments.update(torch.randn(100, 6), torch.arange(100) % 4)
    with pytest.raises(UsageError, match="4 classes of 6-dimensional features but the model has 3 outputs"):
        Adapter(FeatureClassifier(tiny_net.build()), create("cafa", estimate(moments)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"optimizer": "rmsprop"}, "`optimizer` must be one of adam, sgd, nesterov, adamw, not rmsprop"),
        ({"steps": 0}, "`steps`"),
        ({"lr": 0}, "`lr` must be a positive number, not 0"),
        ({"params": "some"}, "`params`"),
        ({"optimizer": "nesterov", "momentum": 0}, "`optimizer` nesterov needs a momentum above 0, not 0"),
    ],
)
def test_bad_settings_are_usage_errors(kwargs, match):
    with pytest.raises(UsageError, match=match):
        Adapter(FeatureClassifier(tiny_net.build()), create("tent"), **kwargs)


def test_an_unknown_method_name_is_a_usage_error_in_library_words():
    """`method` in backticks: the command line shows it as --method."""
    with pytest.raises(
        UsageError,
        match=f"`method` must be one of {', '.join(NAMES)}, or a plug-in module:factory, not nope",
    ):
        create("nope")
    with pytest.raises(UsageError, match="the Adapter takes a method object, not 'tent'"):
        Adapter(FeatureClassifier(tiny_net.build()), "tent")


def test_nesterov_is_sgd_with_nesterov_momentum(trained):
    """TENT's reference code adapts ImageNet-C with SGD, momentum 0.9, Nesterov."""
    model, gaussians, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"), optimizer="nesterov", lr=1e-2)
    reference = copy.deepcopy(adapter)
    reference.optimizer = torch.optim.SGD(reference.params, lr=1e-2, momentum=0.9, nesterov=True)
    plain = Adapter(copy.deepcopy(model), create("tent"), optimizer="sgd", lr=1e-2)
    for i in range(0, 150, 50):  # momentum acts from the second update on
        first, second, third = adapter.step(x[i : i + 50]), reference.step(x[i : i + 50]), plain.step(x[i : i + 50])
    torch.testing.assert_close(first, second)
    assert not torch.allclose(first, third)


def test_compiled_model_predicts_and_adapts_like_the_eager_one(trained):
    model, gaussians, x, _ = trained
    eager = Adapter(copy.deepcopy(model), create("cafa", gaussians), lr=1e-2)
    compiled = Adapter(copy.deepcopy(model), create("cafa", gaussians), lr=1e-2, compile=True)
    for i in range(0, 100, 50):  # the second batch shows the update went through the compiled graph
        torch.testing.assert_close(compiled.step(x[i : i + 50]), eager.step(x[i : i + 50]), rtol=1e-4, atol=1e-5)
    compiled.reset()
    torch.testing.assert_close(
        compiled.step(x[:50]),
        Adapter(copy.deepcopy(model), create("cafa", gaussians)).step(x[:50]),
        rtol=1e-4,
        atol=1e-5,
    )


def test_a_model_that_already_belongs_to_an_adapter_is_refused(trained):
    """A second Adapter on it would start from the first one's adapted weights and swapped
    BatchNorms, and compare methods on the wrong model without a word."""
    model, gaussians, x, _ = trained
    shared = copy.deepcopy(model)
    Adapter(shared, create("cafa", gaussians), lr=1e-2).step(x[:50])
    with pytest.raises(UsageError, match="already belongs to an Adapter; give each Adapter its own copy"):
        Adapter(shared, create("source"))


def test_the_adapter_runs_where_the_model_is_unless_told(trained):
    model, gaussians, _, _ = trained
    assert Adapter(copy.deepcopy(model), create("cafa", gaussians)).device == torch.device("cpu")
    meta = copy.deepcopy(model).to("meta")  # a stand-in for a model on another device: nothing runs here
    assert Adapter(meta, create("tent"), device=None).device == torch.device("meta")


def test_a_model_is_taken_by_its_first_adapter_whatever_the_method_and_norm_layers(trained):
    """source swaps no BatchNorm and a LayerNorm net has none: the model is still taken,
    else a second Adapter on it would silently change the first one's baseline."""
    model, gaussians, x, _ = trained
    shared = copy.deepcopy(model)
    Adapter(shared, create("source"))
    with pytest.raises(UsageError, match="already belongs to an Adapter"):
        Adapter(shared, create("cafa", gaussians))
    layer_norm_net = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(256, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3)
    )
    Adapter(FeatureClassifier(layer_norm_net), create("tent"))
    with pytest.raises(UsageError, match="already belongs to an Adapter"):
        Adapter(FeatureClassifier(layer_norm_net), create("tent"))  # a second wrapper of the same net


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_step_adapts_inside_a_callers_no_grad_or_inference_mode(trained, context):
    model, gaussians, x, _ = trained
    plain, inside = (Adapter(copy.deepcopy(model), create("cafa", gaussians), lr=1e-2) for _ in range(2))
    for i in range(0, 100, 50):
        expected = plain.step(x[i : i + 50])
        with context():
            got = inside.step(x[i : i + 50])
        torch.testing.assert_close(got, expected)  # the second batch shows the first update was made


def test_predictions_of_every_method_are_ordinary_tensors(trained):
    model, gaussians, x, _ = trained
    for method in ("source", "bn", "tent"):
        logits = Adapter(copy.deepcopy(model), create(method)).step(x[:10])
        assert not logits.is_inference() and logits.add_(1).shape == (10, 3)  # a caller may change them in place


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"lr": "1e-3"}, "`lr` must be a number, not '1e-3'"),
        ({"steps": 2.5}, "`steps` must be a whole number, not 2.5"),
        ({"momentum": None}, "`momentum` must be a number"),
        ({"norm": "prior:x"}, "`norm` must be batch, prior:N"),
    ],
)
def test_adapter_options_of_the_wrong_type_are_usage_errors(trained, options, needle):
    model, gaussians, _, _ = trained
    with pytest.raises(UsageError, match=re.escape(needle)):
        Adapter(copy.deepcopy(model), create("tent"), **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_torch_device_without_cuda_is_a_usage_error(trained):
    model, _, _, _ = trained
    with pytest.raises(UsageError, match="CUDA is not available"):
        Adapter(copy.deepcopy(model), create("bn"), device=torch.device("cuda"))


class Recording(Method):
    """A method of one's own: TENT's loss, and every hook call written down."""

    name = "recording"

    def __init__(self):
        self.calls: list[str] = []

    def loss(self, logits, features):
        self.calls.append("loss")
        return losses.entropy(logits)

    def before_step(self, images):
        self.calls.append(f"before {len(images)}")

    def after_step(self, logits):
        self.calls.append(f"after {tuple(logits.shape)}")

    def reset(self):
        self.calls.append("reset")


def test_a_method_of_ones_own_runs_through_the_protocol_like_a_registered_one(trained):
    model, _, x, _ = trained
    mine, tent = Recording(), Adapter(copy.deepcopy(model), create("tent"), lr=1e-2, steps=2)
    adapter = Adapter(copy.deepcopy(model), mine, lr=1e-2, steps=2)
    torch.testing.assert_close(adapter.step(x[:50]), tent.step(x[:50]))
    torch.testing.assert_close(adapter.step(x[50:100]), tent.step(x[50:100]))  # the same updates in between
    adapter.reset()
    assert mine.calls == ["before 50", "loss", "loss", "after (50, 3)"] * 2 + ["reset"]


def test_the_registry_builds_each_method_with_the_attributes_the_adapter_reads(trained):
    _, gaussians, _, _ = trained
    for name in classifier_methods():
        method = create(name, gaussians)
        assert isinstance(method, Method) and method.name == name
        assert method.needs_statistics == (
            name in ("cafa", "global-fa", "intra", "euclidean", "cafa-eata", "cafa-robust", "rmt", "santa", "owttt")
        )
        output_only = ("source", "t3a", "lame", "neo")  # the source model's BatchNorm statistics, no gradient
        # BatchNorms of their own, or moved by their own steps
        own_normalisation = ("rotta", "cafa-robust", "sotta", "owttt")
        assert method.trains == (name not in ("bn", "ttaug", *output_only))  # ttaug: views, no training
        assert method.adapts_normalisation == (name not in (*output_only, *own_normalisation))


def test_statistics_kept_on_another_kind_of_device_are_a_usage_error(trained):
    model, gaussians, _, _ = trained
    method = create("cafa", gaussians, device=torch.device("meta"))  # a stand-in for statistics put on a GPU
    with pytest.raises(
        UsageError, match="the method cafa keeps its statistics on meta but adapts on cpu; create it with device='cpu'"
    ):
        Adapter(copy.deepcopy(model), method, device="cpu")


@pytest.mark.parametrize("method", ["tent", "sar"])  # a plain step, and one that owns its update
def test_with_several_steps_the_last_steps_pass_is_reported(trained, method):
    """TENT's, EATA's, SAR's and CoTTA's code return the outputs of a batch's last step, made
    after its earlier steps: two steps on a batch report what a second visit of one step sees."""
    model, gaussians, x, _ = trained
    two = Adapter(copy.deepcopy(model), create(method, gaussians), lr=1e-2, steps=2)
    one = Adapter(copy.deepcopy(model), create(method, gaussians), lr=1e-2)
    first = one.step(x[:50])
    reported = two.step(x[:50])
    torch.testing.assert_close(reported, one.step(x[:50]))
    assert not torch.allclose(reported, first)  # not the pass before any update
    assert all(torch.equal(a, b) for a, b in zip(two.model.parameters(), one.model.parameters()))
