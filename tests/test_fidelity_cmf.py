"""CMF under its recipes against a float64 transcription of the benchmark collection's update
(mariodoebler/test-time-adaptation classification/methods/cmf.py: loss_calculation,
forward_and_adapt, bayesian_filtering; utils/misc.py ema_update_model; utils/losses.py
Entropy, SymmetricCrossEntropy, SoftLikelihoodRatio; conf.py's CMF and ROID defaults), on
the tiny net of test_fidelity.py, the augmentation a fixed view on both sides."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_fidelity import authors_model, batches, bn_affines, tiny

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import cmf as cmf_module
from cafa_cli.methods import create
from cafa_cli.methods.recipes import shipped
from cafa_cli.model.features import FeatureClassifier


def view(x: torch.Tensor) -> torch.Tensor:  # the fixed "augmentation" of both sides
    return x.flip(3) * 0.9 + 0.1


def ema(to_update, to_merge, momentum, update_all=False):  # ema_update_model
    if momentum < 1.0:
        for p, q in zip(to_update.parameters(), to_merge.parameters()):
            if p.requires_grad or update_all:
                p.data = momentum * p.data + (1 - momentum) * q.data
    return to_update


def cmf_reference(net, xs, settings, o):
    model = authors_model(net)
    params = list(bn_affines(model).values())
    for p in params:
        p.requires_grad_(True)
    if settings["optimizer"] == "adam":
        optimizer = torch.optim.Adam(params, lr=settings["lr"], betas=(0.9, 0.999), weight_decay=0.0)
    else:  # the collection's SGD: OPTIM.MOMENTUM 0.9, DAMPENING 0, NESTEROV True
        optimizer = torch.optim.SGD(params, lr=settings["lr"], momentum=0.9, dampening=0.0, nesterov=True)
    src_model, hidden_model = copy.deepcopy(model), copy.deepcopy(model)
    for m in (src_model, hidden_model):
        for p in m.parameters():
            p.detach_()
    q = o["q"] * sum(p.numel() for p in params) / 38400
    hidden_var, probs_ema, outs = 0.0, torch.full((10,), 0.1, dtype=torch.float64), []
    for x in xs:
        x = x.double()
        batch_size = len(x)
        outputs = model(x)
        with torch.no_grad():
            weights_div = 1 - F.cosine_similarity(probs_ema.unsqueeze(0), outputs.softmax(1), dim=1)
            weights_div = (weights_div - weights_div.min()) / (weights_div.max() - weights_div.min())
            mask = weights_div < weights_div.mean()
            weights_cert = (outputs.softmax(1) * outputs.log_softmax(1)).sum(1)  # −Entropy
            weights_cert = (weights_cert - weights_cert.min()) / (weights_cert.max() - weights_cert.min())
            weights = torch.exp(weights_div * weights_cert / o["temperature"])
            weights[mask] = 0.0
            m = o["probs_momentum"]
            probs_ema = m * probs_ema + (1 - m) * outputs.softmax(1).mean(0)
        probs = torch.clamp(outputs.softmax(1), min=0.0, max=0.99)
        loss_out = -(probs * torch.log(probs / (torch.ones_like(probs) - probs) + 1e-5)).sum(1)
        loss = (loss_out * weights)[~mask].sum() / batch_size
        aug, ref = model(view(x[~mask])), outputs[~mask]
        sce = -0.5 * (ref.softmax(1) * aug.log_softmax(1)).sum(1) - 0.5 * (aug.softmax(1) * ref.log_softmax(1)).sum(1)
        loss = loss + (sce * weights[~mask]).sum() / batch_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # bayesian_filtering
            recovered = ema(hidden_model, src_model, o["alpha"], update_all=True)
            hidden_var = o["alpha"] ** 2 * hidden_var + q
            r = 1 - q
            beta = r / (hidden_var + r)
            beta = beta if beta > 0.89 else 0.89
            beta = beta if beta < 0.9999 else 1.0
            hidden_var = beta * hidden_var
            hidden_model = ema(recovered, model, beta, update_all=True)
            ema(model, hidden_model, o["gamma"])
            prior = outputs.softmax(1).mean(0)
            smooth = max(1 / outputs.shape[0], 1 / outputs.shape[1]) / torch.max(prior)
            outs.append(outputs * ((prior + smooth) / (1 + smooth * outputs.shape[1])))
    return outs, bn_affines(model), bn_affines(hidden_model), hidden_var


# q 20: β below 0.9999 from the first step (the Kalman update acts), 200: β at its floor 0.89;
# at the recipes' Q the tiny net's 40 values keep β at 1 for the first ~20 steps
@pytest.mark.parametrize(
    "recipe, q", [("cifar10-c", None), ("imagenet-c", None), ("cifar10-c", 20.0), ("cifar100-c", 200.0)]
)
def test_cmf_under_its_recipe_matches_the_collections_update(recipe, q, monkeypatch):
    def views(x, *, noise, padding):  # the collection's lighter pipeline: no noise, reflection
        assert (noise, padding) == (False, "reflection")
        return view(x)

    monkeypatch.setattr(cmf_module, "augment", views)
    r = shipped("cmf", recipe)
    s, o = r.settings, {**r.options, **({} if q is None else {"q": q})}
    assert s["params"] == "norm" and all(o[k] for k in ("weighting", "consistency", "prior_correction"))
    net, xs = tiny(sharp=20.0), batches(4)
    kwargs = {k: s[k] for k in ("optimizer", "lr", "momentum", "params") if k in s}
    adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), create("cmf", **o), **kwargs)
    outs, final, hidden, variance = cmf_reference(net, xs, s, o)
    for x, want in zip(xs, outs):
        torch.testing.assert_close(adapter.step(x).double(), want, rtol=1e-4, atol=1e-5)
    mine = dict(adapter.model.model.named_parameters())
    for name, p in final.items():
        torch.testing.assert_close(mine[name].detach().double(), p.detach(), rtol=1e-4, atol=1e-6, msg=name)
    for (name, p), h in zip(final.items(), adapter.method.hidden):
        torch.testing.assert_close(h.double(), hidden[name].detach(), rtol=1e-4, atol=1e-6, msg=name)
    assert adapter.method.variance == pytest.approx(variance, rel=1e-12)


def test_reset_puts_the_hidden_model_back_and_keeps_the_filters_variance(monkeypatch):
    monkeypatch.setattr(cmf_module, "augment", lambda x, **_: view(x))
    adapter = Adapter(FeatureClassifier(tiny(sharp=20.0)), create("cmf", q=20.0), lr=1e-2)
    for x in batches(2):
        adapter.step(x)
    method = adapter.method
    variance = method.variance
    assert variance > 0 and any(not torch.equal(h, s) for h, s in zip(method.hidden, method.source))
    adapter.reset()
    assert all(torch.equal(h, s) for h, s in zip(method.hidden, method.source))
    assert torch.equal(method.class_probs, torch.full((10,), 0.1))
    assert method.variance == variance  # as the collection's reset, which leaves hidden_var


def test_running_statistics_are_refused_while_the_augmented_pass_is_on():
    with pytest.raises(UsageError, match="ema:0.1"):
        Adapter(FeatureClassifier(tiny()), create("cmf"), norm="ema:0.1")
    Adapter(FeatureClassifier(tiny()), create("cmf", consistency=False), norm="ema:0.1")
