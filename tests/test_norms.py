"""The normalisation settings (`norm`): the class-balanced correction against float64
computations on constructed batches, the skew gate, the running statistics' once-a-batch
update and reset, the artifact's class moments, and the command line around them."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import tiny_net
import torch
from conftest import PLAIN, TINY_NET, invoke, tiny_training_set, write_folder
from helpers import fails
from safetensors import safe_open

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.class_balanced import (
    balance_histogram,
    balanced_statistics,
    class_balanced_norms,
    class_mix_moments,
    correction_strength,
    iid_distance,
    use_class_balanced_norms,
)
from cafa_cli.engine.norms import BatchStatisticsNorm
from cafa_cli.engine.options import AdapterSettings, Norm
from cafa_cli.methods import create
from cafa_cli.model.features import FeatureClassifier


def moments64(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per channel of [n, channels] rows, float64."""
    return rows.mean(0), rows.var(0, unbiased=False)


def source_classes(seed: int = 0):
    """Three source classes of [n, 4] 'BatchNorm inputs' with different means and spreads,
    and their moments (float64), as cafa stats --norm-moments records them."""
    g = torch.Generator().manual_seed(seed)
    classes = [
        torch.randn(n, 4, generator=g, dtype=torch.float64) * s + m
        for n, s, m in ((12, 1.0, -2.0), (9, 0.5, 1.0), (6, 2.0, 3.0))
    ]
    means = torch.stack([c.mean(0) for c in classes])
    variances = torch.stack([c.var(0, unbiased=False) for c in classes])
    return classes, means, variances


def balanced_population(classes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of the mixture that weights every class equally, computed from the rows."""
    means = [c.mean(0) for c in classes]
    second = [c.square().mean(0) for c in classes]
    mean = sum(means) / len(classes)
    return mean, sum(second) / len(classes) - mean.square()


MIXES = {
    "one class": [(12, 1), (0, 0), (0, 0)],
    "two classes 9:1": [(9, 3), (3, 1), (0, 0)],
    "another class": [(0, 0), (0, 0), (6, 1)],
}


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_the_correction_gives_a_balanced_batch_under_the_same_shift(mix):
    """A batch of source rows, (rows, copies) of each class (class 0 alone; 9 rows of class
    0 three times to 3 of class 1, 9:1; class 2 alone), under the covariate shift
    x -> a·x + b, corrected with its true class shares: its statistics are those of the
    class-balanced population under that shift, computed directly from the transformed rows."""
    classes, _, _ = source_classes()
    classes = [c[:rows] if rows else c for c, (rows, _) in zip(classes, mix)]  # the source moments are of the rows used
    a, b = (
        torch.tensor([2.0, 0.5, 1.5, 3.0], dtype=torch.float64),
        torch.tensor([1.0, -4.0, 0.0, 2.5], dtype=torch.float64),
    )
    shifted = [c * a + b for c in classes]
    batch = torch.cat([torch.cat([c] * copies) for c, (_, copies) in zip(shifted, mix) if copies])
    shares = torch.tensor([rows * copies for rows, copies in mix], dtype=torch.float64) / len(batch)
    means = torch.stack([c.mean(0) for c in classes])
    variances = torch.stack([c.var(0, unbiased=False) for c in classes])
    balanced_mean, balanced_var = balanced_population(classes)
    mean_b, var_b = moments64(batch)
    mix = class_mix_moments(shares, means, variances + means.square(), balanced_mean, balanced_var)
    mean, var = balanced_statistics(mean_b, var_b, *mix, balanced_mean, balanced_var, eps=0.0)
    want_mean, want_var = balanced_population(shifted)
    torch.testing.assert_close(mean, want_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, want_var, rtol=1e-12, atol=1e-12)


def test_with_uniform_shares_the_batch_keeps_its_own_statistics():
    _, means, variances = source_classes()
    balanced_mean = means.mean(0)
    balanced_var = (variances + means.square()).mean(0) - balanced_mean.square()
    mean_b, var_b = (
        torch.tensor([0.3, 7.0, -1.0, 2.0], dtype=torch.float64),
        torch.tensor([0.2, 4.0, 1.0, 9.0], dtype=torch.float64),
    )
    for eps in (0.0, 1e-5):
        mix = class_mix_moments(
            torch.full((3,), 1 / 3, dtype=torch.float64), means, variances + means.square(), balanced_mean, balanced_var
        )
        mean, var = balanced_statistics(mean_b, var_b, *mix, balanced_mean, balanced_var, eps)
        torch.testing.assert_close(mean, mean_b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(var, var_b, rtol=1e-12, atol=1e-12)


def test_the_expected_histogram_distance_of_an_iid_batch_matches_a_simulation():
    rng = np.random.default_rng(0)
    for classes, n in ((10, 200), (10, 16), (3, 30)):
        labels = rng.integers(0, classes, size=(20000, n))
        counts = np.stack([(labels == k).sum(1) for k in range(classes)], 1) / n
        simulated = 0.5 * np.abs(counts - 1 / classes).sum(1).mean()
        assert iid_distance(classes, n) == pytest.approx(simulated, rel=0.01)
    assert iid_distance(1, 5) == 0.0


def test_the_gate_leaves_iid_batches_alone_and_corrects_one_class_batches_fully():
    uniform = torch.full((10,), 0.1)
    assert float(correction_strength(uniform, 200)) == 0.0
    torch.testing.assert_close(balance_histogram(uniform, 200), uniform)
    one = torch.nn.functional.one_hot(torch.tensor(4), 10).float()
    assert float(correction_strength(one, 200)) == 1.0
    torch.testing.assert_close(balance_histogram(one, 200), one)
    # a batch of 200 drawn i.i.d.: its histogram's own noise does not open the gate
    labels = torch.from_numpy(np.random.default_rng(1).integers(0, 10, 200))
    assert float(correction_strength(torch.bincount(labels, minlength=10).float() / 200, 200)) == 0.0
    # the same distance counts as less skew in a small batch, whose i.i.d. histograms are noisier
    half = torch.tensor([0.35, 0.35] + [0.0375] * 8)  # 0.5 from uniform
    assert float(correction_strength(half, 8)) < float(correction_strength(half, 200))


def test_the_class_balanced_layer_normalises_with_the_corrected_statistics():
    """The layer's fused form (a change of the affine parameters) against normalising with
    balanced_statistics' mean and variance explicitly, in float64; gradients too."""
    torch.manual_seed(0)
    _, means, variances = source_classes()
    bn = bn_with_source()
    bn.weight.data.uniform_(0.5, 2)
    bn.bias.data.uniform_(-1, 1)
    net = torch.nn.Sequential(bn)
    use_class_balanced_norms(net, {"0": (means.float(), variances.float())})
    layer, balanced = net[0], class_balanced_norms(net)
    x = (torch.randn(12, 4, 3, 3) * 3 + 2).requires_grad_(True)
    shares = torch.tensor([0.7, 0.3, 0.0])
    balanced.new_batch()
    balanced.histogram = shares
    out = net(x)
    x64 = x.detach().double().requires_grad_(True)
    weight, bias = bn.weight.detach().double().requires_grad_(True), bn.bias.detach().double().requires_grad_(True)
    var_b, mean_b = torch.var_mean(x64, [0, 2, 3], unbiased=False)
    balanced_mean = means.mean(0)
    balanced_var = (variances + means.square()).mean(0) - balanced_mean.square()
    mix = class_mix_moments(shares.double(), means, variances + means.square(), balanced_mean, balanced_var)
    mean, var = balanced_statistics(mean_b, var_b, *mix, balanced_mean, balanced_var, bn.eps)
    want = (x64 - mean.view(1, -1, 1, 1)) / (var.view(1, -1, 1, 1) + bn.eps).sqrt() * weight.view(
        1, -1, 1, 1
    ) + bias.view(1, -1, 1, 1)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    probe = torch.randn_like(want)
    (out.double() * probe).sum().backward()
    (want * probe).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(bn.weight.grad.double(), weight.grad, rtol=1e-3, atol=1e-3)
    # the running statistics moved (first batch: 1/t = 1) to the corrected ones
    torch.testing.assert_close(layer.running_mean.double(), mean.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.running_var.double(), var.detach(), rtol=1e-4, atol=1e-4)


def test_every_layer_is_corrected_with_its_own_moments_when_all_are_corrected_at_once():
    """Layers of different widths and ε, corrected together (their channels laid end to
    end): each layer's output and running statistics against its own correction, float64,
    from the input that reached it; a second batch moves them by 1/2 from the first's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        bn_with_source(4),
        torch.nn.Conv2d(4, 6, 1),
        bn_with_source(6, eps=1e-3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(6, 3, 1),
        bn_with_source(3, eps=0.1),
    )
    moments = {
        str(i): (torch.randn(5, m.num_features), torch.rand(5, m.num_features) + 0.5)
        for i, m in enumerate(net)
        if isinstance(m, torch.nn.BatchNorm2d)
    }
    use_class_balanced_norms(net, moments)
    balanced = class_balanced_norms(net)
    inputs, outputs = {}, {}

    def seen(module, args, out, name):
        inputs[name], outputs[name] = args[0].detach().double(), out.detach().double()

    for name in moments:
        net[int(name)].register_forward_hook(lambda m, a, out, name=name: seen(m, a, out, name))
    shares = torch.tensor([0.6, 0.1, 0.1, 0.2, 0.0])
    running = {}
    for t, x in enumerate((torch.randn(10, 4, 3, 3) * 2 + 1, torch.randn(10, 4, 3, 3) - 1), start=1):
        balanced.new_batch()
        balanced.histogram = shares
        net(x)
        for name, (means, variances) in moments.items():
            layer, means, variances = net[int(name)], means.double(), variances.double()
            var_b, mean_b = torch.var_mean(inputs[name], [0, 2, 3], unbiased=False)
            balanced_mean = means.mean(0)
            balanced_var = (variances + means.square()).mean(0) - balanced_mean.square()
            mix = class_mix_moments(shares.double(), means, variances + means.square(), balanced_mean, balanced_var)
            mean, var = balanced_statistics(mean_b, var_b, *mix, balanced_mean, balanced_var, layer.eps)
            want = (inputs[name] - mean.view(1, -1, 1, 1)) / (var.view(1, -1, 1, 1) + layer.eps).sqrt()
            want = want * layer.weight.double().view(1, -1, 1, 1) + layer.bias.double().view(1, -1, 1, 1)
            torch.testing.assert_close(outputs[name], want, rtol=1e-4, atol=1e-4)
            before = running.get(name, (layer.source_mean.double(), layer.source_var.double()))
            running[name] = ((1 - 1 / t) * before[0] + mean / t, (1 - 1 / t) * before[1] + var / t)
            torch.testing.assert_close(layer.running_mean.double(), running[name][0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(layer.running_var.double(), running[name][1], rtol=1e-4, atol=1e-4)


def bn_with_source(channels: int = 4, eps: float = 1e-5) -> torch.nn.BatchNorm2d:
    bn = torch.nn.BatchNorm2d(channels, eps=eps).eval()
    bn.running_mean.copy_(torch.linspace(-1, 1, channels))
    bn.running_var.copy_(torch.linspace(0.5, 2, channels))
    return bn


def test_ema_moves_on_every_pass_from_where_the_last_left_it():
    """As RoTTA's robust BN in train mode (and UnMixTNS2d): a second pass of the same batch
    (steps 2, SAR's second pass) moves the statistics again (until issue 60 it did not)."""
    torch.manual_seed(0)
    layer = BatchStatisticsNorm(bn_with_source(), "ema:0.25")
    x = torch.randn(8, 4, 3, 3) * 2 + 5
    first = layer(x)
    var, mean = torch.var_mean(x.double(), [0, 2, 3], unbiased=False)
    source_mean, source_var = layer.source_mean.double(), layer.source_var.double()
    torch.testing.assert_close(layer.running_mean.double(), 0.75 * source_mean + 0.25 * mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.running_var.double(), 0.75 * source_var + 0.25 * var, rtol=1e-6, atol=1e-6)
    second = layer(x)  # normalised with statistics moved twice toward the batch's
    assert not torch.allclose(first, second, atol=1e-3)
    torch.testing.assert_close(
        layer.running_mean.double(), 0.75**2 * source_mean + (1 - 0.75**2) * mean, rtol=1e-6, atol=1e-6
    )


def test_source_normalises_with_the_source_statistics_and_ema_1_with_the_batch():
    torch.manual_seed(0)
    bn = bn_with_source()
    x = torch.randn(8, 4, 3, 3) * 2 + 5
    torch.testing.assert_close(BatchStatisticsNorm(bn, "source")(x), bn(x))
    torch.testing.assert_close(
        BatchStatisticsNorm(bn, "ema:1")(x), BatchStatisticsNorm(bn, "batch")(x), rtol=1e-5, atol=1e-5
    )


def adapter(trained, norm: str, method: str = "tent", class_moments=None, **options):
    model, gaussians, _, _ = trained
    return Adapter(
        copy.deepcopy(model),
        create(method, gaussians if method == "cafa" else None),
        "cpu",
        norm=norm,
        class_moments=class_moments,
        **options,
    )


def class_moments_of(model: FeatureClassifier, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The classes' moments of every BatchNorm's input, straight from hooks, float64."""
    seen = {}
    layers = {name: m for name, m in model.model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    hooks = [
        m.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, a[0].double()))
        for name, m in layers.items()
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    out = {}
    for name, a in seen.items():
        rows = [a[y == k].transpose(0, 1).reshape(a.shape[1], -1) for k in range(int(y.max()) + 1)]
        out[name] = (torch.stack([r.mean(1) for r in rows]), torch.stack([r.var(1, unbiased=False) for r in rows]))
    return out


def test_class_balanced_with_uniform_shares_is_batch_and_reset_goes_back_to_the_source(trained):
    """A batch whose class mix looks i.i.d. is normalised with its own statistics; the
    running statistics (for the next batch's mix) start again from the source's on reset."""
    model, _, x, y = trained
    moments = class_moments_of(model, x, y)
    name, bn = next((n, m) for n, m in model.model.named_modules() if isinstance(m, torch.nn.BatchNorm2d))
    net, batch = torch.nn.Sequential(copy.deepcopy(bn)), BatchStatisticsNorm(bn, "batch")
    use_class_balanced_norms(net, {"0": moments[name]})
    inputs = torch.randn(16, bn.num_features, 5, 5) * 3 + 1
    class_balanced_norms(net).new_batch()
    class_balanced_norms(net).histogram = balance_histogram(torch.full((3,), 1 / 3), 16)
    torch.testing.assert_close(net(inputs), batch(inputs), rtol=1e-5, atol=1e-5)
    balanced = adapter(trained, "class-balanced", class_moments=moments)
    for images in x[:120].split(60):
        balanced.step(images)
    first = balanced.norms[0]
    assert balanced.balanced.batches == 2 and not torch.equal(first.running_mean, first.source_mean.float())
    balanced.reset()
    assert balanced.balanced.batches == 0 and torch.equal(first.running_mean, first.source_mean.float())


def test_class_balanced_resists_a_batch_of_one_class_that_batch_statistics_break(trained):
    """One class a batch: batch statistics normalise the class away; the class-balanced
    correction keeps most predictions right (bn, so that no update blurs the comparison)."""
    model, _, x, y = trained
    moments = class_moments_of(model, x, y)
    errors = {}
    for norm in ("batch", "class-balanced", "source"):
        run = adapter(trained, norm, "bn", class_moments=moments if norm == "class-balanced" else None)
        wrong = 0
        for k in range(3):
            images = x[y == k]
            wrong += int((run.step(images).argmax(1) != k).sum())
        errors[norm] = wrong / len(x)
    assert errors["class-balanced"] < errors["batch"] - 0.2, errors


def test_class_balanced_needs_the_class_moments_and_cotta_cannot_keep_running_statistics(trained):
    with pytest.raises(UsageError, match="cafa stats --norm-moments"):
        adapter(trained, "class-balanced")
    with pytest.raises(UsageError, match="`norm` ema:0.05 keeps statistics from batch to batch, which cotta cannot"):
        adapter(trained, "ema:0.05", "cotta")
    # each method says its own reason: memo copies nothing, it is episodic
    with pytest.raises(UsageError, match=r"which memo cannot \(it is episodic: no statistics pass"):
        adapter(trained, "ema:0.05", "memo")
    prior = adapter(trained, "prior:4", "cotta")  # settings without running statistics are fine, and are used
    assert [(m.kind, m.prior) for m in prior.model.modules() if isinstance(m, BatchStatisticsNorm)] == [
        ("prior", 4.0)
    ] * 3


@pytest.mark.parametrize(
    "text",
    ["prior", "prior:-1", "prior:inf", "prior:1e39", "prior:1.5e9", "ema:0", "ema:1.5", "ema", "batch:1", "balanced"],
)
def test_norm_values_are_checked(text):
    with pytest.raises(UsageError, match="`norm` must be batch, prior:N"):
        Norm.parse(text)


def test_a_norm_is_parsed_once_into_a_value_that_gives_its_text_back():
    """Issue 61: `norm` is parsed where its text enters and passed down as a Norm, which says what
    the code asks of it, and whose text is the canonical one the records keep."""
    forms = {
        "batch": ("batch", None),
        " prior:16 ": ("prior", 16.0),
        "prior:16.0": ("prior", 16.0),
        "ema:.05": ("ema", 0.05),
        "alpha:1": ("alpha", 1.0),
        "unmix:16": ("unmix", 16.0),
        "class-balanced": ("class-balanced", None),
        "source": ("source", None),
    }
    for text, (kind, value) in forms.items():
        norm = Norm.parse(text)
        assert (norm.kind, norm.value) == (kind, value) and Norm.parse(str(norm)) == norm
    assert [str(Norm.parse(text)) for text in ("prior:16.0", "ema:.05", "prior:1e9")] == [
        "prior:16",
        "ema:0.05",
        "prior:1000000000",
    ]
    running = ["ema:0.1", "class-balanced", "unmix:4"]
    assert all(Norm.parse(t).running for t in running)
    assert not any(Norm.parse(t).running for t in ["batch", "prior:4", "alpha:0.5", "source"])
    alone = ["batch", "class-balanced", "prior:0", "alpha:1"]
    assert all(Norm.parse(t).batch_alone for t in alone)
    assert not any(Norm.parse(t).batch_alone for t in ["prior:4", "alpha:0.5", "ema:1", "source", "unmix:2"])
    assert Norm.parse("class-balanced").class_balanced and not Norm().class_balanced
    parsed = Norm.parse("prior:4")
    assert Norm.parse(parsed) is parsed and AdapterSettings(norm=parsed).norm is parsed  # passed down as it is


def test_the_adapter_takes_the_norm_as_its_text_or_parsed(trained):
    """The Python API keeps taking the text; a saved state records the text, as before issue 61."""
    text, parsed = adapter(trained, "prior:16"), adapter(trained, Norm("prior", 16.0))
    assert text.settings.norm == parsed.settings.norm == Norm("prior", 16.0)
    assert text.state_dict()["adaptation"]["norm"] == "prior:16"


@pytest.fixture(scope="module")
def stats_with_moments(tmp_path_factory):
    root = tmp_path_factory.mktemp("norm")
    train, weights = tiny_training_set(root)
    artifacts = {}
    for name, extra in (("plain", []), ("moments", ["--norm-moments"])):
        artifacts[name] = root / f"{name}.safetensors"
        result = invoke(
            "stats",
            "--model",
            TINY_NET,
            "--weights",
            weights,
            "--data",
            train,
            *PLAIN,
            "--fraction",
            "1",
            "--out",
            artifacts[name],
            "--quiet",
            *extra,
        )
        assert result.exit_code == 0, result.stderr
    test = write_folder(root / "test", per_class=8, seed=3, shift=0.3)
    return {"root": root, "train": train, "weights": weights, "test": test, **artifacts}


def test_stats_records_each_class_moments_of_every_batch_norm_input(stats_with_moments):
    """The artifact's norm tensors equal the moments computed here from the same images,
    through hooks on the tiny net, in float64."""
    from cafa_cli.artifact.store import read_artifact
    from cafa_cli.data.sources import open_domain

    s = stats_with_moments
    artifact = read_artifact(s["moments"])
    net = tiny_net.build()
    net.load_state_dict(torch.load(s["weights"], weights_only=True))
    model = FeatureClassifier(net).eval()
    domain = open_domain(str(s["train"]), None)
    names = artifact.class_names
    x = torch.stack(
        [torch.from_numpy(np.asarray(domain.read(i), dtype=np.float32) / 255)[None] for i in range(len(domain))]
    )  # PLAIN: pixels / 255
    y = torch.as_tensor([names.index(domain.class_names[label]) for label in domain.labels])
    want = class_moments_of(model, x, y)
    assert set(artifact.norm_moments) == set(want) and want
    for name, (mean, var) in artifact.norm_moments.items():
        torch.testing.assert_close(mean.double(), want[name][0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(var.double(), want[name][1], rtol=1e-4, atol=1e-3)
    with safe_open(s["moments"], "pt") as f:
        assert json.loads(f.metadata()["norm_layers"]) == {name: int(m.shape[1]) for name, (m, _) in want.items()}
    assert read_artifact(s["plain"]).norm_moments is None  # optional: an artifact without them reads as before


def test_adapt_with_class_balanced_runs_and_without_the_moments_says_how_to_get_them(stats_with_moments, tmp_path):
    s = stats_with_moments
    base = [
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        s["weights"],
        "--data",
        s["test"],
        "--batch-size",
        "6",
        "--method",
        "tent",
        "--order",
        "label-shift:1.0",
        "--quiet",
    ]
    metrics = tmp_path / "m.json"
    ok = invoke(*base, "--stats", s["moments"], "--norm", "class-balanced", "--metrics-json", metrics)
    assert ok.exit_code == 0, ok.stderr
    assert (
        len(ok.stdout.splitlines()) == 1 + 24
        and json.loads(metrics.read_text())["settings"]["norm"] == "class-balanced"
    )
    plain = invoke(*base, "--stats", s["plain"], "--norm", "class-balanced")
    assert plain.exit_code == 3 and plain.stdout == ""
    assert "holds no class moments" in plain.stderr and "cafa stats --norm-moments" in plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1
    no_stats = invoke(*[a for a in base], "--norm", "class-balanced")  # no artifact: the default file is missing
    assert no_stats.exit_code != 0 and "Traceback" not in no_stats.stderr


def test_a_norm_that_the_method_ignores_gets_a_warning(stats_with_moments):
    s = stats_with_moments
    result = invoke(
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        s["weights"],
        "--data",
        s["test"],
        "--batch-size",
        "6",
        "--method",
        "t3a",
        "--norm",
        "source",
        "--stats",
        s["plain"],
    )
    assert result.exit_code == 0, result.stderr
    assert (
        "`norm`" not in result.stderr
        and "--norm source changes nothing here: --method t3a keeps its own" in result.stderr
    )


def test_the_old_bn_prior_option_is_gone_with_a_one_line_error(stats_with_moments):
    s = stats_with_moments
    result = invoke("adapt", "--model", TINY_NET, "--weights", s["weights"], "--data", s["test"], "--bn-prior", "4")
    fails(result, 2, "No such option: --bn-prior", "--norm")  # one line, and it points to the option that replaced it


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t, m: m.update(norm_layers='{"stem.1": 0}'), "metadata 'norm_layers' must map"),
        (lambda t, m: m.update(norm_layers="[1, 2]"), "metadata 'norm_layers' must map"),
        (lambda t, m: t.pop("norm.stem.1.var"), "tensors missing: norm.stem.1.var"),
        (
            lambda t, m: t.update({"norm.stem.1.mean": t["norm.stem.1.mean"][:, :2].contiguous()}),
            "tensor 'norm.stem.1.mean' has shape",
        ),
        (lambda t, m: t["norm.stem.1.var"].sub_(100), "tensor 'norm.stem.1.var' has negative variances"),
        (lambda t, m: t["norm.stem.1.mean"].fill_(float("nan")), "tensor 'norm.stem.1.mean' holds NaN"),
    ],
    ids=["zero channels", "not a map", "a tensor missing", "another shape", "negative variance", "nan"],
)
def test_damaged_class_moments_are_refused_when_the_artifact_is_read(stats_with_moments, tmp_path, damage, message):
    from safetensors.torch import save_file

    from cafa_cli.artifact.store import read_artifact
    from cafa_cli.core.errors import InputError

    with safe_open(stats_with_moments["moments"], "pt") as f:
        tensors, metadata = {k: f.get_tensor(k).clone() for k in f.keys()}, dict(f.metadata())
    damage(tensors, metadata)
    path = tmp_path / "damaged.safetensors"
    save_file(tensors, path, metadata=metadata)
    with pytest.raises(InputError, match=message):
        read_artifact(path)


def test_inspect_says_whether_the_artifact_holds_class_moments(stats_with_moments):
    with_moments = invoke("inspect", stats_with_moments["moments"], "--json")
    assert with_moments.exit_code == 0, with_moments.stderr
    assert json.loads(with_moments.stdout)["norm_layers"] == {"stem.1": 8, "block.bn": 16, "block.downsample.1": 16}
    assert json.loads(invoke("inspect", stats_with_moments["plain"], "--json").stdout)["norm_layers"] is None
    text = invoke("inspect", stats_with_moments["moments"]).stdout
    assert "3 BatchNorm inputs" in text


def test_class_balanced_with_batches_of_one_image_is_warned_as_batch_statistics_are(stats_with_moments):
    s = stats_with_moments
    result = invoke(
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        s["weights"],
        "--data",
        s["test"],
        "--batch-size",
        "1",
        "--method",
        "bn",
        "--norm",
        "class-balanced",
        "--stats",
        s["moments"],
    )
    assert result.exit_code == 0, result.stderr
    assert "--batch-size 1 normalises each image by its own statistics" in result.stderr


def test_class_balanced_reads_the_default_artifact_and_does_not_call_it_unread(
    stats_with_moments, tmp_path, monkeypatch
):
    import shutil

    s = stats_with_moments
    monkeypatch.chdir(tmp_path)
    shutil.copy(s["moments"], tmp_path / "cafa-stats.safetensors")
    result = invoke(
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        s["weights"],
        "--data",
        s["test"],
        "--batch-size",
        "6",
        "--method",
        "bn",
        "--norm",
        "class-balanced",
        *PLAIN,
    )
    assert result.exit_code == 0, result.stderr
    assert "not read" not in result.stderr
    unread = invoke(
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        s["weights"],
        "--data",
        s["test"],
        "--batch-size",
        "6",
        "--method",
        "bn",
        *PLAIN,
    )
    assert "cafa-stats.safetensors is here but not read" in unread.stderr
