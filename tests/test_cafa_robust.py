"""cafa-robust (methods/cafa_robust.py) against its float64 definition (methods/reference_robust.py),
and the behaviour its design rests on: the batch's share of the statistics, the bank's schedule
at any batch size, and the source state after a reset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.class_balanced import correction_strength
from cafa_cli.methods import create, reference, reference_robust
from cafa_cli.methods.cafa_robust import SharedStatisticsNorm
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments

C, D_IN, D = 3, 5, 4
SHRINKAGE = 0.2


def tiny_net(seed: int = 0) -> FeatureClassifier:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(D_IN, D), nn.BatchNorm1d(D), nn.ReLU(), nn.Linear(D, C))
    with torch.no_grad():  # source statistics that differ from the test batches'
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
        net[3].weight.mul_(3)
    return FeatureClassifier(net)


def class_statistics(seed: int = 0):
    """Gaussians of features like the tiny net's, and the reference's dense means and covariances."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(C).repeat_interleave(40)
    z = (
        torch.randn(len(labels), D, generator=g) + 2 * torch.randn(C, D, generator=g)[labels]
    ).relu() + 0.1 * torch.rand(len(labels), D, generator=g)
    moments = ClassMoments(C, D)
    moments.update(z, labels)
    means, sigmas = reference.class_gaussians(z, labels, C, SHRINKAGE)
    return estimate(moments, "full", SHRINKAGE), means, sigmas


def forward64(net: FeatureClassifier, x: torch.Tensor, mean, var, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    layers = net.model
    h = nn.functional.linear(x.double(), layers[0].weight.double(), layers[0].bias.double())
    z = reference_robust.normalise(h, mean, var, weight, bias, layers[1].eps).relu()
    return nn.functional.linear(z, layers[3].weight.double(), layers[3].bias.double()), z


def hidden64(net: FeatureClassifier, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x.double(), net.model[0].weight.double(), net.model[0].bias.double())


def predicted64(net: FeatureClassifier, x: torch.Tensor, mean, var, weight, bias, prior, power) -> torch.Tensor:
    """The reference's logits of a batch: the gate's pass with the global statistics (mean,
    var) alone, then the batch normalised with its share ρ of the statistics."""
    with torch.no_grad():
        global_logits, _ = forward64(net, x, mean, var, weight, bias)
        share = reference_robust.batch_share(len(x), reference_robust.skew(global_logits.softmax(1)), prior, power)
        m, v = reference_robust.shared_statistics(hidden64(net, x), mean, var, share)
        return forward64(net, x, m, v, weight, bias)[0]


@pytest.mark.parametrize("pull", [0.0, 0.1])
def test_a_stream_with_steps_on_the_bank_matches_the_float64_definition(pull):
    """Three batches of 6, a step on the bank after every 8 images (inside the second and
    third batches), a bank that holds every image: the reported logits, the trained affines
    (pulled back toward the source's by β after each step) and the global statistics follow
    the reference's equations step by step. No change of domain here (τ = 0; below)."""
    gaussians, means, sigmas = class_statistics()
    net = tiny_net()
    source = net.model[1]
    initial = source.weight.detach().clone()
    initial_bias = source.bias.detach().clone()
    mean, var = source.running_mean.double().clone(), source.running_var.double().clone()
    weight = source.weight.detach().double().clone().requires_grad_(True)
    bias = source.bias.detach().double().clone().requires_grad_(True)
    K, every, prior, power, alpha, lr = 60, 8, 4.0, 8.0, 0.3, 0.05
    method = create(
        "cafa-robust",
        gaussians,
        memory_size=K,
        update_every=every,
        statistics_momentum=alpha,
        prior=prior,
        gate_power=power,
        source_pull=pull,
        change_threshold=0,
        laplacian_weight=0,
    )
    adapter = Adapter(net, method, "cpu", optimizer="sgd", lr=lr, momentum=0.0)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(6, D_IN, generator=g) * 1.5 + 0.7 for _ in range(3)]
    seen: list[torch.Tensor] = []
    for x in batches:
        reported = adapter.step(x)
        expected = predicted64(net, x, mean, var, weight, bias, prior, power)
        torch.testing.assert_close(reported.double(), expected, rtol=1e-4, atol=1e-5)
        for image in x:
            seen.append(image)
            if len(seen) % every:
                continue
            bank = torch.stack(seen)  # the bank holds every image so far, in arrival order
            t = len(bank)
            ages = torch.arange(t, 0, -1, dtype=torch.float64) / K  # offers since each entered, its own included
            m, v = reference_robust.shared_statistics(hidden64(net, bank), mean, var, t / (t + prior))
            logits, z = forward64(net, bank, m, v, weight, bias)
            loss = reference_robust.bank_loss(z, logits, means, sigmas, ages, torch.ones(t))
            grads = torch.autograd.grad(loss, (weight, bias))
            with torch.no_grad():
                weight.copy_(reference_robust.pulled(weight - lr * grads[0], initial, pull))
                bias.copy_(reference_robust.pulled(bias - lr * grads[1], initial_bias, pull))
                bank_mean, bank_var = reference_robust.batch_statistics(hidden64(net, bank))
                mean, var = reference_robust.moved(mean, bank_mean, alpha), reference_robust.moved(var, bank_var, alpha)
    layer = net.model[1]
    assert isinstance(layer, SharedStatisticsNorm)
    torch.testing.assert_close(layer.weight.detach().double(), weight.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.bias.detach().double(), bias.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.global_mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.global_var.double(), var, rtol=1e-5, atol=1e-5)
    assert (layer.weight.detach() - initial).abs().max() > 1e-3  # two steps were taken


@pytest.mark.parametrize("n", [1, 2, 8, 64, 200])
def test_the_skew_strength_is_the_reference_one(n):
    g = torch.Generator().manual_seed(n)
    for probabilities in (
        torch.rand(n, 10, generator=g).softmax(1),  # a mixed batch
        nn.functional.one_hot(torch.zeros(n, dtype=torch.long), 10).float() * 0.9 + 0.01,
    ):  # one class
        got = correction_strength(probabilities.mean(0), n)
        torch.testing.assert_close(got.double(), reference_robust.skew(probabilities), rtol=1e-5, atol=1e-6)


def test_a_one_class_batch_is_normalised_with_the_global_statistics_and_an_iid_one_mostly_with_its_own():
    """ρ = n(1 − s)^p / (n(1 − s)^p + N₀): 0 for a batch whose class mix is one class, n/(n + N₀)
    for one whose mix is what sampling gives."""
    one_class = nn.functional.one_hot(torch.zeros(64, dtype=torch.long), 10).float()
    iid = nn.functional.one_hot(torch.arange(64) % 10, 10).float()
    assert float(reference_robust.batch_share(64, reference_robust.skew(one_class), 16, 8)) == 0
    assert float(reference_robust.batch_share(64, reference_robust.skew(iid), 16, 8)) == pytest.approx(64 / 80)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_global_statistics_move_once_every_update_every_images_at_any_batch_size(batch):
    gaussians, _, _ = class_statistics()
    net = tiny_net()
    adapter = Adapter(net, create("cafa-robust", gaussians, update_every=6), "cpu")
    layer = net.model[1]
    g = torch.Generator().manual_seed(0)
    moves = []
    for _ in range(12 // batch):
        before = layer.global_mean.clone()
        logits = adapter.step(torch.randn(batch, D_IN, generator=g) + 1)
        assert logits.shape == (batch, C) and logits.isfinite().all()
        moves.append(not torch.equal(before, layer.global_mean))
    images_at_each_move = [(k + 1) * batch for k, moved in enumerate(moves) if moved]
    assert images_at_each_move == [6, 12]


def test_reset_brings_back_the_source_statistics_and_an_empty_bank():
    gaussians, _, _ = class_statistics()
    net = tiny_net()
    source_mean = net.model[1].running_mean.clone()
    method = create("cafa-robust", gaussians, update_every=4)
    adapter = Adapter(net, method, "cpu")
    adapter.step(torch.randn(8, D_IN) + 2)
    assert not torch.equal(net.model[1].global_mean, source_mean)
    adapter.reset()
    assert torch.equal(net.model[1].global_mean, source_mean)
    assert method.bank.filled == 0 and method.offered == 0


def test_a_batch_norm_without_running_statistics_is_named():
    gaussians, _, _ = class_statistics()
    net = tiny_net()
    net.model[1] = nn.BatchNorm1d(D, track_running_stats=False)
    with pytest.raises(
        InputError, match="cafa-robust needs the running statistics of every BatchNorm, and the one at 1"
    ):
        Adapter(net, create("cafa-robust", gaussians), "cpu")


def test_the_features_read_after_the_stream_are_those_it_predicts_with():
    """Adapter.features (cafa plot features) goes through the gate and the batch's share, as
    a step's prediction does, and changes nothing."""
    gaussians, _, _ = class_statistics()
    net = tiny_net()
    adapter = Adapter(net, create("cafa-robust", gaussians, update_every=1000), "cpu")  # no step on the bank
    x = torch.randn(16, D_IN, generator=torch.Generator().manual_seed(1)) + 1
    before = {name: value.clone() for name, value in net.state_dict().items()}
    logits, features = adapter.features(x)
    assert all(torch.equal(value, before[name]) for name, value in net.state_dict().items())
    assert torch.equal(adapter.step(x), logits) and features.shape == (16, D)


def test_a_prior_of_zero_is_refused_for_a_one_class_batch_would_divide_zero_by_zero():
    gaussians, _, _ = class_statistics()
    with pytest.raises(
        UsageError, match=r"^cafa-robust's option prior must be a number from 0.000001 to 1,000,000, not 0$"
    ):
        create("cafa-robust", gaussians, prior=0)


@pytest.mark.parametrize("mix_reference, window", [(3.0, 50), (3.0, 2), (0.0, 50)])
def test_the_gate_compares_a_batch_with_the_streams_typical_class_mix(mix_reference, window):
    """mix_reference B > 0: each batch's skew is measured from the mean class mix of the gate's
    predictions before it, started uniform with B batches' weight and averaging at most the
    last `mix_window` (reference_robust.typical_mixes, float64); B = 0 measures it from uniform,
    as before; a reset starts again."""
    gaussians, _, _ = class_statistics()
    net = tiny_net()
    method = create("cafa-robust", gaussians, update_every=1000, mix_reference=mix_reference, mix_window=window)
    adapter = Adapter(net, method, "cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, D_IN, generator=g) + t for t in range(1, 6)]
    with torch.no_grad():  # the gate's pass: the global statistics alone (update_every keeps them)
        probabilities = [net(images)[0].softmax(1) for images in batches]
    typical = reference_robust.typical_mixes([p.mean(0) for p in probabilities], mix_reference, window)
    for t, (images, p) in enumerate(zip(batches, probabilities)):
        s = reference_robust.skew(p, typical[t] if mix_reference else None)
        share = method.batch_share(adapter, images)
        torch.testing.assert_close(share.double(), reference_robust.batch_share(8, s, 16.0, 8.0), rtol=1e-5, atol=1e-7)
        adapter.step(images)
        if mix_reference:
            torch.testing.assert_close(method.typical_mix.double(), typical[t + 1], rtol=1e-5, atol=1e-7)
        else:
            assert method.typical_mix is None
    adapter.reset()
    assert method.typical_mix is None and method.gated == 0


@pytest.mark.parametrize("kept", [0.0, 0.5, 1.0])
def test_a_skewed_batch_keeps_its_skew_as_far_as_its_own_statistics_make_it_less_certain(kept):
    """entropy_rise a > 0: a batch the gate reads as skewed is predicted again with its own
    statistics, and its skew is scaled by clamp((ΔH − a)/a, 0, 1) (reference_robust.few_classes,
    float64); a is set here from the batch's ΔH so that the scale is 0, ½ and 1."""
    gaussians, _, _ = class_statistics()
    net = tiny_net()
    g = torch.Generator().manual_seed(8)
    images = torch.randn(16, D_IN, generator=g) - 1  # where the source statistics predict mostly one class
    source = net.model[1]
    mean, var = source.running_mean.double(), source.running_var.double()
    weight, bias = source.weight.detach().double(), source.bias.detach().double()
    with torch.no_grad():
        global_logits = forward64(net, images, mean, var, weight, bias)[0]
        own_mean, own_var = reference_robust.batch_statistics(hidden64(net, images))
        own_logits = forward64(net, images, own_mean, own_var, weight, bias)[0]
    rise = float(reference.entropy(own_logits) - reference.entropy(global_logits))
    skew = reference_robust.skew(global_logits.softmax(1))
    assert rise > 0 and 0 < float(skew) < 1  # a skewed batch, less certain with its own statistics
    a = {0.0: 2 * rise, 0.5: rise / 1.5, 1.0: rise / 3}[kept]
    assert float(reference_robust.few_classes(global_logits, own_logits, a)) == pytest.approx(kept)
    method = create("cafa-robust", gaussians, entropy_rise=a, laplacian_weight=0)
    adapter = Adapter(net, method, "cpu")
    with torch.no_grad():
        share = method.batch_share(adapter, images, method.watch)
    torch.testing.assert_close(method.skew.double(), kept * skew, rtol=1e-5, atol=1e-6)
    expected = reference_robust.batch_share(16, kept * skew, 16.0, 8.0)
    torch.testing.assert_close(share.double(), expected, rtol=1e-5, atol=1e-7)
    assert method.layers[0].share is None  # the layers normalise with the global statistics again
    assert method.watch.images == 16  # the change detector took in the gate's pass alone


def test_a_jump_in_the_first_layers_variance_restarts_the_statistics_and_the_bank():
    """Windows of update_every = 32 images (a batch each): the detector's statistic is the
    reference's between each window and the one before; the batch whose window jumps (its
    inputs 5 times as spread) is predicted with the source statistics, not the moved ones,
    and the bank then holds its images alone; the windows before it restart nothing."""
    gaussians, _, _ = class_statistics()
    net = tiny_net()
    layer_before = net.model[1]
    source_mean, source_var = layer_before.running_mean.double().clone(), layer_before.running_var.double().clone()
    prior, power = 16.0, 8.0
    method = create(
        "cafa-robust", gaussians, update_every=32, statistics_momentum=0.3, change_threshold=1.0, laplacian_weight=0
    )
    adapter = Adapter(net, method, "cpu", optimizer="sgd", lr=0.01, momentum=0.0)
    layer = net.model[1]
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(32, D_IN, generator=g) * 1.5 + 0.7 for _ in range(3)]
    batches.append(torch.randn(32, D_IN, generator=g) * 7.5 + 0.7)
    for k, x in enumerate(batches):
        moved_mean, weight, bias = layer.global_mean.clone(), layer.weight.detach().clone(), layer.bias.detach().clone()
        reported = adapter.step(x)
        if k:
            jump = reference_robust.variance_jump(hidden64(net, batches[k - 1]), hidden64(net, x), layer.eps)
            assert method.watch.jump == pytest.approx(float(jump), rel=1e-6)
        assert method.domain_changes == (k == 3)
    assert jump > 1 and not torch.equal(moved_mean, layer.source_mean)  # the statistics had moved, and restart
    expected = predicted64(net, x, source_mean, source_var, weight, bias, prior, power)
    torch.testing.assert_close(reported.double(), expected, rtol=1e-4, atol=1e-5)
    arrivals = [a for a, c in zip(method.bank.host_arrivals, method.bank.host_labels) if c >= 0]
    assert arrivals and min(arrivals) >= 96  # the last batch's images alone
    adapter.reset()
    assert method.domain_changes == 1 and method.watch.before is None  # reset keeps the count


def own_statistics_loss64(net: FeatureClassifier, x: torch.Tensor, weight, bias, means, sigmas) -> float:
    """The reference's CAFA loss of a batch normalised with its own statistics alone."""
    h = hidden64(net, x)
    logits, z = forward64(net, x, h.mean(0), h.var(0, unbiased=False), weight, bias)
    return float(reference.cafa_loss(reference.mahalanobis(z, means, sigmas), logits))


def change_with_weights(choice: str, carried: list[torch.Tensor], source: list[torch.Tensor]):
    """Three batches of one domain (a step on the bank after each), the affines then set to
    `carried` and θ⁰ to `source`, and a batch whose inputs are 5 times as spread (a change):
    its reported logits, the float64 CAFA loss of each candidate on it, and the method."""
    gaussians, means, sigmas = class_statistics()
    net = tiny_net()
    method = create(
        "cafa-robust", gaussians, update_every=32, laplacian_weight=0, source_pull=0, restart_weights=choice
    )
    adapter = Adapter(net, method, "cpu", optimizer="adam", lr=0.01)
    layer = net.model[1]
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        adapter.step(torch.randn(32, D_IN, generator=g) * 1.5 + 0.7)
    assert method.domain_changes == 0 and method.source_restarts == 0
    assert adapter.optimizer.state[layer.weight]["step"] == 3
    with torch.no_grad():
        torch._foreach_copy_([layer.weight, layer.bias], carried)
    method.source = [t.clone() for t in source]
    x = torch.randn(32, D_IN, generator=g) * 7.5 + 0.7
    candidates = {"carry": carried, "source": source}
    losses64 = {name: own_statistics_loss64(net, x, *ws, means, sigmas) for name, ws in candidates.items()}
    expected = {
        name: predicted64(net, x, layer.source_mean.double(), layer.source_var.double(), *ws, 16.0, 8.0)
        for name, ws in candidates.items()
    }
    reported = adapter.step(x).double()
    assert method.domain_changes == 1
    kept = [name for name in candidates if torch.allclose(reported, expected[name], rtol=1e-4, atol=1e-5)]
    assert method.source_restarts == (kept == ["source"])  # the count says which set the change kept
    steps = int(adapter.optimizer.state[layer.weight]["step"])
    return kept, losses64, steps


def test_a_change_of_domain_keeps_the_weights_restart_weights_names():
    """At a detected change, carry keeps the trained affines, source returns to θ⁰ with a new
    optimiser state (one step after, not four), and fitter keeps whichever of the two gives
    the batch the lower float64 CAFA loss (normalised with its own statistics); the batch is
    predicted with the kept ones. Candidates: the source affines against random ones, so that
    fitter keeps each kind at least once."""
    source = [torch.ones(D), torch.zeros(D)]
    g = torch.Generator().manual_seed(0)
    others = [[torch.rand(D, generator=g) * 2, torch.randn(D, generator=g)] for _ in range(6)]
    kept, _, steps = change_with_weights("carry", others[0], source)
    assert kept == ["carry"] and steps == 4
    kept, _, steps = change_with_weights("source", others[0], source)
    assert kept == ["source"] and steps == 1
    choices = set()
    for carried in others:
        kept, losses64, steps = change_with_weights("fitter", carried, source)
        fitter = min(losses64, key=losses64.get)
        assert kept == [fitter] and steps == (1 if fitter == "source" else 4)
        choices.add(fitter)
    assert choices == {"carry", "source"}  # both branches taken


def test_zero_switches_off_the_pull_and_the_detector():
    """β = 0 and τ = 0 switch both off: no source copy is pulled toward, no window is watched."""
    gaussians, _, _ = class_statistics()
    method = create("cafa-robust", gaussians, source_pull=0, change_threshold=0)
    Adapter(tiny_net(), method, "cpu")
    assert method.watch is None and method.source_pull == 0


def test_a_skewed_batch_is_reported_with_lames_correction_and_an_iid_one_as_it_is():
    """λ = λ₀·s^q from the gate's skew s: a batch the gate reads as one class is reported as
    the reference's LAME correction of its plain logits; one it reads as mixed (s = 0) as the
    plain logits, bit for bit (each against the same method with λ₀ = 0, on the same batch)."""
    gaussians, _, _ = class_statistics()
    g = torch.Generator().manual_seed(2)
    mixed = torch.randn(24, D_IN, generator=g)
    skewed = torch.randn(24, D_IN, generator=g) * 0.3
    skewed[:, 2] += 2  # toward one class, not all the way: 0 < s < 1
    for x, one_class in ((skewed, True), (mixed, False)):
        plain = create("cafa-robust", gaussians, laplacian_weight=0, update_every=1000)
        corrected = create("cafa-robust", gaussians, laplacian_power=4.0, update_every=1000)
        plain_logits = Adapter(tiny_net(), plain, "cpu").step(x)
        reported = Adapter(tiny_net(), corrected, "cpu").step(x)
        s = float(corrected.skew)
        assert (0.3 < s < 1) if one_class else s == 0
        if one_class:
            _, features = plain.reported
            expected = reference_robust.reported(plain_logits, features, s, 1.0, 4.0)
            torch.testing.assert_close(reported.double(), expected, rtol=1e-4, atol=1e-4)
            assert not torch.allclose(reported, plain_logits.log_softmax(1), atol=1e-3)  # the correction moved them
        else:
            assert torch.equal(reported, plain_logits)


def test_the_gate_trace_writes_each_batchs_skew_scale_and_share(monkeypatch, tmp_path):
    """benchmarks/robust_gate_trace.py (a diagnosis of a stream): a line a batch, in order,
    whose share is ρ of its skew, and whose scale is set only where the batch read as skewed."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from robust_gate_trace import traced

    from cafa_cli.methods.cafa_robust import CafaRobust

    for name in ("update", "few_classes"):  # put back after the test
        monkeypatch.setattr(CafaRobust, name, getattr(CafaRobust, name))
    gaussians, _, _ = class_statistics()
    method = create("cafa-robust", gaussians, entropy_rise=0.01, laplacian_weight=0)
    adapter = Adapter(tiny_net(), method, "cpu")
    g = torch.Generator().manual_seed(8)
    batches = [torch.randn(16, D_IN, generator=g) + shift for shift in (-1, 1, -1)]
    with open(tmp_path / "trace.jsonl", "w") as out:
        traced(out)
        for x in batches:
            adapter.step(x)
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [line["images"] for line in lines] == [0, 16, 32]
    for line in lines:  # the bank after each batch: images offered so far, each once, its own among them
        arrivals = line["bank_arrivals"]
        assert arrivals == sorted(set(arrivals)) and 0 < len(arrivals) <= 64
        assert arrivals[-1] < line["images"] + 16 and arrivals[-1] >= line["images"]
    for line in lines:
        assert line["share"] == pytest.approx(
            float(reference_robust.batch_share(16, line["skew"], 16.0, 8.0)), abs=1e-4
        )
        if line["scale"] is None:  # not read as skewed: no second pass
            assert line["skew"] == 0
    assert any(line["scale"] is not None for line in lines)
