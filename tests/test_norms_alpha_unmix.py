"""`norm` alpha:A (α-BN) and unmix:K (UnMix-TNS), norms.py, against float64 transcriptions:

- α-BN as the benchmark collection computes it (mariodoebler/test-time-adaptation,
  classification/methods/bn.py, AlphaBatchNorm: the source statistics weighted 1 − α, the
  test batch's α, the batch's variance as a BatchNorm of momentum 1 keeps it, unbiased);
- UnMix-TNS as its authors do (devavratTomar/unmixtns, tta_experiments/unmixtns.py:
  BaseNormLayer.__init__ for the components' start, UnMixTNS2d.forward for the
  normalisation and the components' update, UnMixTNS1d for BatchNorm1d; replace_bn_layers
  for the momentum, 1 − (1 − 0.1)^(bs/bs_max) = 0.1 in all their runs, where bs = bs_max).

Each on the fidelity tests' tiny BatchNorm net, forward passes and TENT steps through the
Adapter; then what every running setting must keep: changes in place (a CUDA graph replays
the step), no host reads, reset, export.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_fidelity import batches, entropy, tiny
from test_host_sync import steady_reads
from test_step_graph import Emulated, Uncapturable, adapter_pair, run_both, stream_of
from torch import nn

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.norms import UNMIX_SEED, BatchStatisticsNorm, norm_layers, use_test_batch_norm
from cafa_cli.engine.options import Norm
from cafa_cli.engine.step_graph import WARMUP
from cafa_cli.methods import create
from cafa_cli.model.features import FeatureClassifier

# --- float64 transcriptions ------------------------------------------------------------------


class AlphaReference(nn.Module):
    """The collection's AlphaBatchNorm in float64: (1 − α)·source + α·test, the test statistics
    those a BatchNorm of momentum 1 records from the batch (its variance unbiased), which
    carry no gradient: in a training step (MEMO's in the collection, the TENT steps below) it
    flows through the normalised input alone."""

    def __init__(self, bn: nn.BatchNorm2d, alpha: float):
        super().__init__()
        self.weight = nn.Parameter(bn.weight.detach().double().clone())
        self.bias = nn.Parameter(bn.bias.detach().double().clone())
        self.mean, self.var = bn.running_mean.double(), bn.running_var.double()
        self.alpha, self.eps = alpha, bn.eps
        self.norm = nn.BatchNorm2d(bn.num_features, affine=False, momentum=1.0).double()

    def forward(self, x):
        self.norm.train()(x)  # records the batch's mean and unbiased variance, as buffers
        mean = (1 - self.alpha) * self.mean + self.alpha * self.norm.running_mean
        var = (1 - self.alpha) * self.var + self.alpha * self.norm.running_var
        return F.batch_norm(x, mean, var, self.weight, self.bias, False, 0.0, self.eps)


class PriorReference(nn.Module):
    """MEMO's _modified_bn_forward in float64 (zhangmarvin/memo imagenet-exps/utils/
    train_helpers.py, from bethgelab/robustness): the source statistics weighted
    prior = N/(N + 1) against what a BatchNorm of momentum 1 records from the batch (its
    unbiased variance; no gradient), the batch counting as one sample. cafa's prior:N counts
    a batch of n as n samples: `samples` = n gives the same weights, N/(N + n)."""

    def __init__(self, bn: nn.BatchNorm2d, strength: float, samples: int = 1):
        super().__init__()
        self.weight = nn.Parameter(bn.weight.detach().double().clone())
        self.bias = nn.Parameter(bn.bias.detach().double().clone())
        self.running_mean, self.running_var = bn.running_mean.double(), bn.running_var.double()
        self.strength, self.samples, self.eps = strength, samples, bn.eps

    def forward(self, x):
        est_mean, est_var = torch.zeros_like(self.running_mean), torch.ones_like(self.running_var)
        F.batch_norm(x, est_mean, est_var, None, None, True, 1.0, self.eps)
        prior = self.strength / (self.strength + self.samples)
        mean = prior * self.running_mean + (1 - prior) * est_mean
        var = prior * self.running_var + (1 - prior) * est_var
        return F.batch_norm(x, mean, var, self.weight, self.bias, False, 0, self.eps)


class EmaReference(nn.Module):
    """RoTTA's RobustBN2d in train mode, float64 (the benchmark collection's methods/rotta.py):
    the statistics kept moved toward the batch's biased ones by the momentum on every forward
    pass, the batch normalised with the moved ones (the gradient through the batch's part)."""

    def __init__(self, bn: nn.BatchNorm2d, momentum: float):
        super().__init__()
        self.weight = nn.Parameter(bn.weight.detach().double().clone())
        self.bias = nn.Parameter(bn.bias.detach().double().clone())
        self.means, self.vars = bn.running_mean.double().clone(), bn.running_var.double().clone()
        self.momentum, self.eps = momentum, bn.eps

    def forward(self, x):
        b_var, b_mean = torch.var_mean(x, dim=[0, 2, 3], unbiased=False)
        mean = (1 - self.momentum) * self.means + self.momentum * b_mean
        var = (1 - self.momentum) * self.vars + self.momentum * b_var
        self.means, self.vars = mean.detach().clone(), var.detach().clone()
        out = (x - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + self.eps)
        return out * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


class UnmixReference(nn.Module):
    """UnMixTNS2d in float64, its [B, K, C] tensors as the authors write them. `noise`: the
    standard normal draw [K, C] of their randn_like, here the one cafa draws from its seed."""

    def __init__(self, bn: nn.BatchNorm2d, k: int, noise: torch.Tensor, momentum: float = 0.1):
        super().__init__()
        self.weight = nn.Parameter(bn.weight.detach().double().clone())
        self.bias = nn.Parameter(bn.bias.detach().double().clone())
        mean, var = bn.running_mean.double(), bn.running_var.double()
        coeff = 0.5 if k > 1 else 0.0  # their coefficient α of the start
        spread = math.sqrt(coeff * k / (k - 1)) * var.sqrt() * noise.double() if k > 1 else 0.0
        self.means = mean.repeat(k, 1) + spread
        self.vars = (1 - coeff) * var.repeat(k, 1)
        self.momentum, self.eps = momentum, bn.eps

    def forward(self, x):
        inst_mean, inst_var = x.mean((2, 3)), x.var((2, 3), unbiased=False)  # [B, C]
        with torch.no_grad():
            sim = F.normalize(inst_mean, dim=1) @ F.normalize(self.means, dim=1).T  # [B, K]
            probs = torch.softmax(sim / 0.07, dim=1)
        p = probs.unsqueeze(-1)  # [B, K, 1]
        mean_mat = (1 - p) * self.means.unsqueeze(0) + p * inst_mean.unsqueeze(1)  # [B, K, C]
        var_mat = (1 - p) * self.vars.unsqueeze(0) + p * inst_var.unsqueeze(1)
        mean = mean_mat.mean(1)
        var = var_mat.mean(1) + (mean_mat**2).mean(1) - mean_mat.mean(1) ** 2
        with torch.no_grad():
            self.means = self.means + self.momentum * (p * (inst_mean.unsqueeze(1) - self.means.unsqueeze(0))).mean(0)
            self.vars = self.vars + self.momentum * (p * (inst_var.unsqueeze(1) - self.vars.unsqueeze(0))).mean(0)
        out = (x - mean[..., None, None]) / torch.sqrt(var[..., None, None] + self.eps)
        return out * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def source_net(seed: int = 1, sharp: float = 80.0) -> nn.Module:
    """The fidelity tests' tiny BatchNorm net, with source statistics that are not 0 and 1."""
    net = tiny(seed, sharp)
    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 1.5 + 0.5)
            with torch.no_grad():
                m.weight.copy_(1 + 0.3 * torch.randn(m.num_features, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.num_features, generator=g))
    return net.eval()


def reference_net(net: nn.Module, norm: str, samples: int = 1) -> nn.Module:
    """A float64 copy of `net` with each BatchNorm2d replaced by the transcription, the unmix
    noise drawn as cafa draws it: one generator, seeded, layer after layer in module order.
    `samples`: what a batch counts as under prior:N (PriorReference)."""
    parsed = Norm.parse(norm)
    kind, value = parsed.kind, parsed.value
    model = copy.deepcopy(net).double()
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(UNMIX_SEED)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.BatchNorm2d):
            if kind == "alpha":
                layer = AlphaReference(m, value)
            elif kind == "prior":
                layer = PriorReference(m, value, samples)
            elif kind == "ema":
                layer = EmaReference(m, value)
            else:
                k = int(value)
                noise = torch.randn(k, m.num_features, generator=generator) if k > 1 else None
                layer = UnmixReference(m, k, noise)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
    return model


def swapped(net: nn.Module, norm: str) -> nn.Module:
    model = copy.deepcopy(net)
    use_test_batch_norm(model, norm)
    return model


def close(mine: torch.Tensor, reference: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-4) -> None:
    torch.testing.assert_close(mine.detach().double(), reference.detach(), rtol=rtol, atol=atol, msg=what)


# --- α-BN ------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.1, 0.3, 1.0])
def test_alpha_normalises_as_the_collections_alpha_batch_norm_on_a_tiny_net(alpha):
    net = source_net()
    mine, reference = swapped(net, f"alpha:{alpha}"), reference_net(net, f"alpha:{alpha}")
    for i, x in enumerate(batches(3, size=8)):  # small batches: α-BN's use (the collection runs batch 1)
        with torch.no_grad():
            close(mine(x), reference(x.double()), f"batch {i}")


def test_alpha_weighs_the_batch_and_one_minus_alpha_the_source():
    """The convention, built from torch's own layers as the collection builds it: a BatchNorm
    of momentum 1 in training mode records the batch's statistics, mixed 0.9 source, 0.1 batch.
    A shifted batch normalised with α on the wrong side would be nearly centred."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4).eval()
    bn.running_mean.copy_(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    bn.running_var.copy_(torch.tensor([1.0, 2.0, 0.5, 1.5]))
    x = torch.randn(2, 4, 5, 5) * 3 + 6  # far from the source statistics
    recorder = nn.BatchNorm2d(4, affine=False, momentum=1.0).train()
    recorder(x)
    mean = 0.9 * bn.running_mean + 0.1 * recorder.running_mean
    var = 0.9 * bn.running_var + 0.1 * recorder.running_var
    want = F.batch_norm(x, mean, var, bn.weight, bn.bias, False, 0.0, bn.eps)
    layer = BatchStatisticsNorm(bn, "alpha:0.1")
    with torch.no_grad():
        got = layer(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # mostly the source's: the shifted batch stays far from zero mean, as under `source`
        source = BatchStatisticsNorm(bn, "source")(x)
        swapped_sides = F.batch_norm(
            x,
            0.1 * bn.running_mean + 0.9 * recorder.running_mean,
            0.1 * bn.running_var + 0.9 * recorder.running_var,
            bn.weight,
            bn.bias,
            False,
            0.0,
            bn.eps,
        )
        assert (got - source).abs().mean() < (got - swapped_sides).abs().mean()
        assert got.mean() > 0.5 * source.mean() > 1.0
        # the ends: 0 is the source's, 1 the batch's (its unbiased variance)
        torch.testing.assert_close(BatchStatisticsNorm(bn, "alpha:0")(x), source)
        n = x.numel() / 4
        batch_var = x.var((0, 2, 3), unbiased=False) * n / (n - 1)
        torch.testing.assert_close(
            BatchStatisticsNorm(bn, "alpha:1")(x),
            F.batch_norm(x, x.mean((0, 2, 3)), batch_var, bn.weight, bn.bias, False, 0.0, bn.eps),
            rtol=1e-5,
            atol=1e-5,
        )


# --- UnMix-TNS ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4])
def test_unmix_starts_its_components_as_the_authors_around_the_source_statistics(k):
    net = source_net()
    mine, reference = swapped(net, f"unmix:{k}"), reference_net(net, f"unmix:{k}")
    layers = norm_layers(mine)
    references = [m for m in reference.modules() if isinstance(m, UnmixReference)]
    assert len(layers) == len(references) == 3
    for i, (layer, ref) in enumerate(zip(layers, references)):
        close(layer.component_means, ref.means, f"layer {i} means", rtol=1e-6, atol=1e-6)
        close(layer.component_vars, ref.vars, f"layer {i} variances", rtol=1e-6, atol=1e-6)
    if k > 1:  # the layers draw in turn, so no two share their noise
        noise = [(layer.component_means - layer.source_mean) / layer.source_var.sqrt() for layer in layers[:2]]
        assert not torch.allclose(noise[0], noise[1])


@pytest.mark.parametrize("k", [2, 4, 16])
def test_unmix_normalises_and_moves_its_components_as_the_authors_on_a_tiny_net(k):
    net = source_net()
    mine, reference = swapped(net, f"unmix:{k}"), reference_net(net, f"unmix:{k}")
    layers = norm_layers(mine)
    references = [m for m in reference.modules() if isinstance(m, UnmixReference)]
    for i, x in enumerate(batches(4, size=16, seed=2)):
        before = layers[-1].component_means.clone()
        with torch.no_grad():
            close(mine(x), reference(x.double()), f"batch {i}")
        for j, (layer, ref) in enumerate(zip(layers, references)):
            close(layer.component_means, ref.means, f"batch {i}, layer {j} means")
            close(layer.component_vars, ref.vars, f"batch {i}, layer {j} variances")
        assert (layers[-1].component_means - before).abs().max() > 1e-3  # they moved


@pytest.mark.parametrize("norm", ["unmix:4", "ema:0.1"])
def test_every_forward_pass_moves_the_kept_statistics_from_where_the_last_left_them(norm):
    """As UnMixTNS2d.forward and RoTTA's robust BN in train mode: a batch's second pass (steps
    2, SAR's, ROID's views) moves them again. Until issue 60 it moved them from where they
    were before the batch, so the second pass normalised as the first and left them as it had."""
    net = source_net()
    mine, reference = swapped(net, norm), reference_net(net, norm)
    kept = "component_means" if norm.startswith("unmix") else "running_mean"
    layer = norm_layers(mine)[0]
    ref = next(m for m in reference.modules() if hasattr(m, "means"))
    x, views = batches(2, size=8)
    with torch.no_grad():
        for i, images in enumerate((x, views, x)):  # the batch, its views, the batch again
            close(mine(images), reference(images.double()), f"pass {i}")
            close(getattr(layer, kept), ref.means, f"pass {i}: the kept means", atol=1e-5)
    first = swapped(net, norm)
    with torch.no_grad():
        once = first(x)
    assert not torch.allclose(getattr(norm_layers(first)[0], kept), getattr(layer, kept), atol=1e-4)
    with torch.no_grad():
        assert not torch.allclose(mine(x), once, atol=1e-4)  # the same images, normalised anew


def test_unmix_computes_in_float32_under_autocast():
    """Its [B, K] @ [K, C] products would run in bf16 under autocast, a ~1e-2 error."""
    bn = source_net().bn
    x = torch.randn(8, 6, 5, 5) * 2 + 1
    plain, cast = BatchStatisticsNorm(bn, "unmix:16"), BatchStatisticsNorm(bn, "unmix:16")
    with torch.no_grad():
        want = plain(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = cast(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cast.component_means, plain.component_means, rtol=1e-6, atol=1e-6)


def test_unmix_normalises_a_batch_norm_1d_with_the_source_statistics_as_the_authors():
    bn = nn.BatchNorm1d(5).eval()
    bn.running_mean.copy_(torch.linspace(-1, 1, 5))
    bn.running_var.copy_(torch.linspace(0.5, 2, 5))
    x = torch.randn(8, 5) * 3 + 2
    layer = BatchStatisticsNorm(bn, "unmix:4")
    with torch.no_grad():
        torch.testing.assert_close(layer(x), bn(x))


# --- TENT steps through the Adapter --------------------------------------------------------------


REFERENCES = (AlphaReference, PriorReference, EmaReference, UnmixReference)


def tent_reference(net: nn.Module, norm: str, xs: list[torch.Tensor], lr: float, steps: int = 1):
    """TENT (DequanWang/tent tent.py: `steps` times forward_and_adapt, entropy mean, one step) in
    float64 on the transcribed normalisation, plain SGD on the normalisation affines; the logits
    of each batch's last step, before it. prior:N weighs a batch of n as n samples."""
    model = reference_net(net, norm, samples=len(xs[0]))
    params = [p for m in model.modules() if isinstance(m, REFERENCES) for p in (m.weight, m.bias)]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params, lr=lr)
    logits = []
    for x in xs:
        for _ in range(steps):
            out = model(x.double())
            optimizer.zero_grad()
            entropy(out).mean().backward()
            optimizer.step()
        logits.append(out.detach())
    return logits, params


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("norm", ["alpha:0.3", "prior:4", "ema:0.1", "unmix:4"])
def test_tent_with_the_setting_steps_as_the_float64_transcription(norm, steps):
    """The gradient flows through each sample's statistics under unmix, through the batch's
    under ema (RoTTA's robust BN), and through neither under alpha and prior, whose batch
    statistics are a BatchNorm's records in the authors' code; under ema and unmix each of a
    batch's steps moves the kept statistics again. Before issue 60 alpha and prior let the
    gradient through the batch's part (1.8e-4 apart after 3 steps), prior mixed the biased
    variance, and a second step did not move ema's and unmix's statistics."""
    net, lr = source_net(sharp=3.0), 0.5
    xs = batches(3, size=16, seed=3)
    adapter = Adapter(
        FeatureClassifier(copy.deepcopy(net)),
        create("tent"),
        "cpu",
        optimizer="sgd",
        lr=lr,
        momentum=0.0,
        norm=norm,
        steps=steps,
    )
    want, params = tent_reference(net, norm, xs, lr, steps)
    for i, (x, logits) in enumerate(zip(xs, want)):
        close(adapter.step(x), logits, f"logits {i}", rtol=1e-4, atol=1e-4)
    mine = [p for layer in adapter.norms for p in (layer.weight, layer.bias)]
    for j, (p, q) in enumerate(zip(mine, params)):
        close(p, q, f"affine {j}", rtol=1e-4, atol=1e-5)
    start = [p.detach().double() for m in net.modules() if isinstance(m, nn.BatchNorm2d) for p in (m.weight, m.bias)]
    assert max(float((q.detach() - s).abs().max()) for q, s in zip(params, start)) > 1e-3  # the steps did move them


# --- what every setting that keeps state must keep ----------------------------------------------


NORMS = ["alpha:0.1", "unmix:4"]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("method", ["tent", "eata", "sar", "bn", "cafa"])
def test_a_replayed_step_with_the_setting_gives_the_eager_predictions_bit_for_bit(trained, method, norm):
    """Its state changes in place: what a CUDA graph replay needs (the emulated capture of test_step_graph)."""
    graphed, eager = adapter_pair(trained, method, norm=norm)
    batches_ = stream_of(trained[2])
    run_both(graphed, eager, batches_)
    assert graphed.step_runner == "graph"
    assert graphed.graph.replays == len(batches_) - WARMUP - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", NORMS)
def test_a_step_with_the_setting_is_captured_on_a_gpu_and_replays_the_eager_step(trained, norm):
    """As tests/test_step_graph_cuda.py for the other settings: CUDA's own capture and replay."""
    from test_step_graph_cuda import close as near
    from test_step_graph_cuda import pair

    graphed, eager = pair(trained, "tent", norm)
    batches_ = stream_of(trained[2])
    for i, images in enumerate(batches_):
        assert near(graphed.step(images), eager.step(images)), f"batch {i}: {graphed.step_runner}"
    assert graphed.step_runner == "graph", graphed.step_runner
    for name, value in graphed.model.state_dict().items():
        assert near(value, eager.model.state_dict()[name]), name


@pytest.mark.parametrize("norm", NORMS)
def test_no_step_with_the_setting_draws_random_numbers_makes_host_tensors_or_reads_the_device(trained, norm):
    graphed, _ = adapter_pair(trained, "tent", capture=Emulated, norm=norm)
    batches_ = stream_of(trained[2])
    for images in batches_[:WARMUP]:
        graphed.step(images)
    with Uncapturable() as mode:
        graphed._eager_step(batches_[WARMUP])
    assert mode.seen == []
    model, gaussians, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("cafa", gaussians), lr=1e-2, norm=norm)
    assert steady_reads(adapter, x) == []


@pytest.mark.parametrize("norm", NORMS)
def test_reset_starts_the_stream_again_bit_for_bit(trained, norm):
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"), lr=1e-2, norm=norm)
    first = [adapter.step(b) for b in x[:120].split(40)]
    adapter.reset()
    again = [adapter.step(b) for b in x[:120].split(40)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    fresh = Adapter(copy.deepcopy(model), create("tent"), lr=1e-2, norm=norm)  # the same start in a new run
    assert all(torch.equal(a, b) for a, b in zip(first, [fresh.step(b) for b in x[:120].split(40)]))


@pytest.mark.parametrize("norm", NORMS)
def test_an_exported_network_serves_the_statistics_the_stream_arrived_at(trained, norm):
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"), lr=1e-2, norm=norm)
    for b in x[:150].split(30):
        adapter.step(b)
    served = adapter.export()
    assert not any("cafa_cli" in type(m).__module__ for m in served.modules())
    layer = adapter.norms[0]
    plain = next(m for m in served.modules() if isinstance(m, nn.BatchNorm2d))
    if norm.startswith("unmix"):  # the components' mixture: mean of means, mean variance plus the means' spread
        mean = layer.component_means.mean(0)
        var = layer.component_vars.mean(0) + layer.component_means.var(0, unbiased=False)
    else:  # the test statistics' running estimate, mixed as a batch's
        started = 1 - 0.9 ** int(layer.served_passes)
        mean = 0.9 * layer.source_mean + 0.1 * layer.served_mean / started
        var = 0.9 * layer.source_var + 0.1 * layer.served_var / started
    torch.testing.assert_close(plain.running_mean, mean)
    torch.testing.assert_close(plain.running_var, var)
    with torch.no_grad():  # frozen statistics: one image is predicted as in a batch
        batch = served(x[:20])
        alone = torch.cat([served(image[None]) for image in x[:20]])
    torch.testing.assert_close(alone, batch, rtol=1e-4, atol=1e-5)


def test_cotta_takes_alpha_but_not_unmix_whose_components_its_teacher_would_copy(trained):
    model, gaussians, _, _ = trained
    with pytest.raises(UsageError, match="`norm` unmix:4 keeps statistics from batch to batch, which cotta cannot"):
        Adapter(copy.deepcopy(model), create("cotta", gaussians), norm="unmix:4")
    cotta = Adapter(copy.deepcopy(model), create("cotta", gaussians), norm="alpha:0.1")
    assert [(m.kind, round(float(m.rate), 6)) for m in cotta.norms] == [("alpha", 0.1)] * len(cotta.norms) != []


@pytest.mark.parametrize(
    "text",
    ["alpha", "alpha:-0.1", "alpha:1.5", "alpha:nan", "unmix", "unmix:0", "unmix:2.5", "unmix:1025", "unmix:inf"],
)
def test_wrong_values_are_refused_with_the_forms(text):
    with pytest.raises(
        UsageError, match=r"`norm` must be batch, prior:N .* alpha:A \(A 0 or from 0.000001 to 1\) or unmix:K"
    ):
        Norm.parse(text)


@pytest.mark.parametrize("text", ["unmix:1", "unmix:1.0", " unmix:01 ", "unmix:1e0"])
def test_one_unmix_component_is_refused_for_it_is_instance_normalisation(text):
    """The softmax over one component is 1: each image took its own statistics alone, and
    `bn --norm unmix:1` erred 90 % on the bundled model (the authors' code does the same)."""
    with pytest.raises(
        UsageError, match=r"one component normalises each image by its own statistics alone .* K from 2"
    ):
        Norm.parse(text)


def test_the_values_are_read():
    assert Norm.parse("alpha:0") == Norm("alpha", 0.0) and Norm.parse(" alpha:1 ") == Norm("alpha", 1.0)
    assert Norm.parse("unmix:16") == Norm("unmix", 16.0) and Norm.parse("unmix:1024") == Norm("unmix", 1024.0)
