"""The baselines of issue 20 (EATA, ETA, SAR, T3A, LAME, cafa-eata), each against an
independent float64 computation of its update on a tiny case, written from the papers'
rules with Python loops and lists (as the official code filters), not from the methods'
tensor forms."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create, reference
from cafa_cli.methods.eata import Eata, Eta
from cafa_cli.methods.lame import Lame
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.sar import Sar
from cafa_cli.methods.t3a import T3A
from cafa_cli.model.features import FeatureClassifier


def entropy64(logits: torch.Tensor) -> torch.Tensor:
    p = logits.double().softmax(1)
    return -(p * p.log()).sum(1)


def tiny_net(seed: int = 0) -> FeatureClassifier:
    torch.manual_seed(seed)
    return FeatureClassifier(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3)))


def eata_reference(batches: list[torch.Tensor], margin_factor: float = 0.4, eps: float = 0.05) -> list[float]:
    """EATA's loss per batch, as the paper states it: filter, then the moving mean, sample by sample."""
    mean, values = None, []
    for logits in batches:
        C = logits.shape[1]
        e0 = margin_factor * math.log(C)
        probs, ents = logits.double().softmax(1), entropy64(logits)
        kept = [n for n in range(len(logits)) if ents[n] < e0]
        if mean is not None:
            kept = [n for n in kept if abs(torch.nn.functional.cosine_similarity(mean, probs[n], dim=0)) < eps]
        values.append(sum(float(ents[n]) / math.exp(float(ents[n]) - e0) for n in kept) / len(kept) if kept else 0.0)
        if kept:
            batch_mean = probs[kept].mean(0)
            mean = batch_mean if mean is None else 0.9 * mean + 0.1 * batch_mean
    return values


def test_eta_filters_and_weights_as_the_paper():
    torch.manual_seed(0)
    # C = 4: E0 = 0.4 ln 4 ≈ 0.55, so confident rows pass and flat ones do not
    batches = [torch.randn(12, 4) * 4 for _ in range(3)] + [torch.zeros(5, 4)]
    method = Eta()
    got = [float(method.loss(b, torch.zeros(len(b), 2))) for b in batches]
    expected = eata_reference(batches)
    assert expected[0] > 0 and expected[-1] == 0.0  # something kept at first, nothing from flat predictions
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert bool(method.leave_out)  # the last batch kept nothing: no step


def test_eta_with_a_loose_redundancy_filter_keeps_every_reliable_sample():
    logits = torch.tensor([[6.0, 0, 0, 0], [0, 6.0, 0, 0], [0, 0, 0.1, 0]])
    method = Eta()
    method.selection.redundancy = 2.0  # |cos| < 2 always
    for _ in range(2):
        _, weights, kept = method.selection.select(logits)
        assert int(kept) == 2 and float(weights[2]) == 0.0


def test_a_batch_with_no_sample_kept_leaves_the_weights_and_optimiser_as_they_were(trained):
    model, _, x, _ = trained
    method = Eta()
    method.selection.margin = 0.0  # E0 = 0: no sample is reliable
    adapter = Adapter(copy.deepcopy(model), method, lr=1e-2)
    before = [p.detach().clone() for p in adapter.params]
    adapter.step(x[:50])
    assert all(torch.equal(a, b) for a, b in zip(before, adapter.params))
    assert all(float(s["step"]) == 0 for s in adapter.optimizer.state.values())
    assert adapter.skipped_steps == 0  # left out by the method, not skipped for a non-finite loss


def test_eata_fisher_is_the_mean_squared_gradient_at_the_source_weights():
    torch.manual_seed(1)
    batches = [torch.randn(8, 3), torch.randn(6, 3)]
    net = tiny_net()
    source = copy.deepcopy(net).double()
    method = Eata(fisher_batches=batches)
    adapter = Adapter(net, method)
    bn = source.model[1]
    expected = [torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    for images in batches:  # BN on the batch's statistics; cross-entropy against its own predictions
        h = source.model[0](images.double())
        h = nn.functional.batch_norm(h, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
        logits = source.model[3](h.relu())
        loss = nn.functional.cross_entropy(logits, logits.argmax(1))
        for total, g in zip(expected, torch.autograd.grad(loss, [bn.weight, bn.bias])):
            total += g.square() / len(batches)
    for got, want in zip(method.fisher, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-9)
    # the penalty is 0 at the source weights, and β Σ F (θ − θ0)² after a move
    logits = torch.randn(5, 3) * 5
    plain = Eta().loss(logits, torch.zeros(5, 4))
    assert float(method.loss(logits, torch.zeros(5, 4)).detach()) == pytest.approx(float(plain), rel=1e-6)
    with torch.no_grad():
        adapter.params[0].add_(0.5)
    method.reset()
    moved = float(method.loss(logits, torch.zeros(5, 4)).detach()) - float(plain)
    assert moved == pytest.approx(2000 * 0.25 * float(expected[0].sum()), rel=1e-4)


def test_eata_without_source_images_is_eta(trained):
    model, _, x, _ = trained
    runs = []
    for name in ("eata", "eta"):
        adapter = Adapter(copy.deepcopy(model), create(name), lr=1e-2)
        runs.append(torch.cat([adapter.step(x[i : i + 50]) for i in range(0, 200, 50)]))
    assert torch.equal(*runs)


@pytest.mark.parametrize("method", ["eta", "eata"])
def test_a_reset_keeps_the_redundancy_mean_only_as_the_authors_recipe_asks(trained, method):
    """Issue 40 §7: the authors' reset() puts back weights and optimiser and keeps m; the
    benchmark collection clears it. The ImageNet recipe (the authors') keeps it."""
    model, gaussians, xt, _ = trained
    for keep in (False, True):
        adapter = Adapter(copy.deepcopy(model), create(method, None, keep_mean_on_reset=keep))
        adapter.step(xt[:50])
        mean = adapter.method.selection.mean_probs.clone()
        adapter.reset()
        kept = adapter.method.selection.mean_probs
        assert (kept is not None and torch.equal(kept, mean)) if keep else kept is None
    assert shipped(method, "imagenet-c").options["keep_mean_on_reset"] is True
    assert "keep_mean_on_reset" not in shipped(method, "cifar10-c").options  # the collection's: cleared


def test_cafa_eata_is_cafa_on_the_kept_samples_weighted_as_eata(trained):
    model, gaussians, x, _ = trained
    method = create("cafa-eata", gaussians)
    with torch.no_grad():
        logits, z = copy.deepcopy(model)(x[:60])
    logits = logits * 0.7  # softer, so that some pass E0 = 0.4 ln 3 and some do not
    loss = float(method.loss(logits, z))
    e0 = 0.4 * math.log(3)
    ents = entropy64(logits)
    kept = [n for n in range(len(logits)) if ents[n] < e0]
    assert 0 < len(kept) < len(logits)
    assert gaussians.covariance == "full"
    distances = reference.mahalanobis_from_factors(z, gaussians.means, gaussians.factors)
    terms = (distances.gather(1, logits.argmax(1, keepdim=True)).squeeze(1) / distances.sum(1)).log()
    expected = sum(float(terms[n]) / math.exp(float(ents[n]) - e0) for n in kept) / len(kept)
    assert loss == pytest.approx(expected, rel=1e-4)


def test_sar_takes_one_sharpness_aware_step_from_the_source_weights():
    torch.manual_seed(2)
    x = torch.randn(16, 3) * 2
    net = tiny_net(3)
    with torch.no_grad():
        net.classifier.weight.mul_(6)  # confident enough that some samples pass E0 = 0.4 ln 3
    source = copy.deepcopy(net).double()
    lr, rho = 0.1, 0.05
    method = Sar(rho=rho, reset_below=0.0)  # no recovery here (the entropy is never below 0)
    adapter = Adapter(net, method, optimizer="sgd", momentum=0.0, lr=lr)
    reported = adapter.step(x)

    bn = source.model[1]
    params = [bn.weight, bn.bias]

    def forward(w, b):
        h = nn.functional.batch_norm(source.model[0](x.double()), None, None, w, b, training=True, eps=bn.eps)
        return source.model[3](h.relu())

    e0 = 0.4 * math.log(3)
    logits = forward(*params)
    ents = entropy64(logits)
    kept = [n for n in range(16) if ents[n] < e0]
    assert 0 < len(kept) < 16
    grads = torch.autograd.grad(ents[kept].mean(), params)
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
    perturbed = [p + rho * g / (norm + 1e-12) for p, g in zip(params, grads)]
    ents2 = entropy64(forward(*perturbed))
    kept2 = [n for n in kept if ents2[n] < e0]
    grads2 = torch.autograd.grad(ents2[kept2].mean(), params)
    for got, p, g in zip(adapter.params, params, grads2):
        torch.testing.assert_close(got.detach().double(), (p - lr * g).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reported.double(), logits.detach(), rtol=1e-5, atol=1e-5)  # before the update
    assert float(method.ema) == pytest.approx(float(ents2[kept2].mean()), rel=1e-5)


def test_sar_scales_its_first_pass_as_fp16_does_without_changing_the_step(trained):
    """Under fp16 the Adapter scales losses (GradScaler); SAR's first backward pass, for ε,
    is scaled too, so that small gradients do not flush to zero. A power-of-two scale is
    exact in float32, and ε = ρ·g/‖g‖ ignores it: the weights after each step are those of
    the unscaled run, bit for bit. (fp16 itself runs on CUDA only; this checks the scaling
    on the CPU, through a CPU GradScaler with a huge scale.)"""
    model, _, x, _ = trained
    plain = Adapter(copy.deepcopy(model), create("sar", reset_below=0.0), lr=1e-2)
    scaled = Adapter(copy.deepcopy(model), create("sar", reset_below=0.0), lr=1e-2)
    scaled.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    seen = []
    original = scaled.scaler.scale
    scaled.scaler.scale = lambda loss: seen.append(float(loss)) or original(loss)
    for batch in x[:90].split(30):
        torch.testing.assert_close(scaled.step(batch), plain.step(batch), rtol=0, atol=0)
    assert len(seen) == 6  # both losses of each of the 3 batches went through the scaler
    for a, b in zip(scaled.params, plain.params):
        assert torch.equal(a, b)


def test_sar_recovers_the_source_model_and_a_fresh_optimiser_when_the_loss_average_is_low(trained):
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("sar", reset_below=100.0), lr=1e-2)  # every EMA is below 100
    source = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    adapter.step(x[:50])
    assert all(torch.equal(v, source[k]) for k, v in adapter.model.state_dict().items())
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in adapter.optimizer.state.values())
    adapter = Adapter(copy.deepcopy(model), create("sar"), lr=1e-2)
    adapter.step(x[:50])
    assert any(not torch.equal(v, source[k]) for k, v in adapter.model.state_dict().items())


def test_sar_recovery_puts_back_the_running_statistics_too(trained):
    """Recovery restores what a step can change, trained parameters and buffers (here the
    running statistics of `norm` ema), and leaves every entry as the source's."""
    model, _, x, _ = trained
    adapter = Adapter(
        copy.deepcopy(model), create("sar", reset_below=100.0), norm="ema:0.5", optimizer="sgd", momentum=0.9, lr=1e-2
    )
    source = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    assert any("running_mean" in k for k in source)
    for i in range(2):
        adapter.step(x[50 * i : 50 * i + 50])
        assert all(torch.equal(v, source[k]) for k, v in adapter.model.state_dict().items())
        buffers = [s["momentum_buffer"] for s in adapter.optimizer.state.values()]
        assert buffers and all(not b.any() and b.signbit().all() for b in buffers)  # -0.0, as a fresh buffer


def t3a_reference(weight, bias, batches, k):
    """The support set as lists, sorted per class by entropy and cut to k, as T3A states it."""
    weight, bias = weight.double(), bias.double()
    supports = [(w, int((weight @ w + bias).argmax()), float(entropy64((weight @ w + bias)[None])[0])) for w in weight]
    outputs = []
    for z in batches:
        z = z.double()
        logits = z @ weight.T + bias
        supports += [(z[n], int(logits[n].argmax()), float(entropy64(logits[n : n + 1])[0])) for n in range(len(z))]
        kept = []
        for c in range(len(weight)):
            mine = sorted((s for s in supports if s[1] == c), key=lambda s: s[2])[:k]
            kept += mine
        supports = kept
        prototypes = torch.zeros_like(weight)
        for vector, c, _ in supports:
            prototypes[c] += vector / vector.norm()
        norms = prototypes.norm(dim=1, keepdim=True)
        prototypes = torch.where(norms > 0, prototypes / norms.clamp_min(1e-300), 0.0)
        outputs.append(z @ prototypes.T)
    return outputs


def test_t3a_classifies_with_the_entropy_filtered_support_prototypes():
    torch.manual_seed(4)
    net = FeatureClassifier(nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)))
    adapter = Adapter(net, T3A(filter_k=3))
    xs = [torch.randn(7, 5) for _ in range(3)]
    got = [adapter.step(x) for x in xs]
    with torch.no_grad():
        zs = [net.model[1](net.model[0](x)) for x in xs]
    expected = t3a_reference(net.classifier.weight.detach(), net.classifier.bias.detach(), zs, 3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-6)
    assert adapter.method.entropies.isfinite().sum() <= 4 * 3


def lame_reference(probs: torch.Tensor, z: torch.Tensor, knn: int = 5) -> torch.Tensor:
    """LAME's bound optimisation in float64 with the official stopping rule, entry by entry."""
    probs, z = probs.double(), torch.nn.functional.normalize(z.double(), dim=1)
    n = len(z)
    W = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        others = sorted((float((z[i] - z[j]).norm()), j) for j in range(n) if j != i)
        for _, j in others[:knn]:
            W[i, j] = 1.0
    W = (W + W.T) / 2
    unary = -(probs + 1e-10).log()
    Y, old = (-unary).softmax(1), math.inf
    for i in range(100):
        pairwise = W @ Y
        Y = (pairwise - unary).softmax(1)
        E = float((unary * Y - pairwise * Y + Y * Y.clamp_min(1e-20).log()).sum())
        if i > 1 and abs(E - old) <= 1e-8 * abs(old):
            break
        old = E
    return Y


def test_lame_reports_the_laplacian_regularised_assignment():
    torch.manual_seed(5)
    # two clusters of features; the logits disagree with the cluster for a few samples
    z = torch.cat([torch.randn(10, 4) * 0.3 + 2, torch.randn(10, 4) * 0.3 - 2])
    logits = torch.cat([torch.tensor([[1.0, 0.0]]).repeat(10, 1), torch.tensor([[0.0, 1.0]]).repeat(10, 1)])
    logits[:3] = torch.tensor([0.0, 0.6])
    got = Lame(affinity="knn", symmetric=True).output(logits, z).softmax(1)
    expected = lame_reference(logits.softmax(1), z)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)
    assert (got[:3].argmax(1) == 0).all()  # the neighbours pulled the outliers to their cluster


def test_output_only_methods_leave_the_model_unchanged(trained):
    model, _, x, _ = trained
    for name in ("t3a", "lame"):
        adapter = Adapter(copy.deepcopy(model), create(name))
        before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
        adapter.step(x[:50])
        assert adapter.optimizer is None and adapter.batch_norms == 0
        assert all(torch.equal(v, before[k]) for k, v in adapter.model.state_dict().items())


def test_a_method_option_it_does_not_take_is_named():
    from cafa_cli.core.errors import UsageError

    with pytest.raises(
        UsageError,
        match=r"sar has no option fisher_batches \(its options: entropy_margin, rho, "
        r"reset_below, frozen, entropy\)",
    ):
        create("sar", fisher_batches=[])
    with pytest.raises(UsageError, match=r"the method pl has no option epsilon \(it takes none\)"):
        create("pl", epsilon=0.4)
