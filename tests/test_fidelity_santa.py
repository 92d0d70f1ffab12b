"""SANTA under its recipes against a float64 transcription of the authors' update, written here
from mariodoebler/test-time-adaptation classification/methods/santa.py (SANTA.__init__'s
anchor model, prototypes, projector and optimiser group, contrastive_loss,
loss_calculation, forward_and_adapt, configure_model), utils/losses.py (AugCrossEntropy)
and engine/method.py (collect_params, setup_optimizer): the tiny net of test_fidelity.py,
the same batches, the same prototypes, projector initialisation and augmented views on
both sides (ours drawn by methods/shared/augment.py and recorded, then given to the reference)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_fidelity import C, authors_model, batches, bn_affines, tiny

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods import santa as santa_module
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.shared.augment import augment
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments


def source_statistics(net):
    """Class Gaussians of the source net's features on labelled images near the test batches'
    prototypes (batches()'s): their means are SANTA's source prototypes."""
    g = torch.Generator().manual_seed(1)  # batches()'s prototypes
    prototypes = torch.randn(C, 3, 6, 6, generator=g) * 2
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, C, (64,), generator=g)
    images = prototypes[labels] + 0.3 * torch.randn(64, 3, 6, 6, generator=g)
    model = FeatureClassifier(copy.deepcopy(net)).eval()
    moments = ClassMoments(C, 8)
    with torch.no_grad():
        moments.update(model(images)[1], labels)
    return estimate(moments, "diag", 0.1)


def features_of(model, x):  # split_up_model: everything before the classifier
    return model.layer4(model.layer3(F.relu(model.bn(model.conv(x))))).mean((2, 3))


def aug_cross_entropy(x, x_aug, x_ema, alpha=0.5):  # utils/losses.py AugCrossEntropy
    return -(1 - alpha) * (x.softmax(1) * x_ema.log_softmax(1)).sum(1) - alpha * (
        x_aug.softmax(1) * x_ema.log_softmax(1)
    ).sum(1)


def santa_reference(net, xs, views, prototypes, projector_state, optimizer, lr, o):
    """The authors' SANTA in float64: configure_model (BatchNorm affines train, on batch
    statistics), the anchor a detached copy, the projector's group at the same rate, one
    step a batch; the logits reported are the adapted model's before its step."""
    model = authors_model(net)
    params = list(bn_affines(model).values())
    for p in params:
        p.requires_grad_(True)
    anchor = copy.deepcopy(model)
    for p in anchor.parameters():
        p.detach_()
    if optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)
    d, p_dim = prototypes.shape[1], o["projection_dim"]
    projector = torch.nn.Sequential(torch.nn.Linear(d, p_dim), torch.nn.ReLU(), torch.nn.Linear(p_dim, p_dim))
    projector.load_state_dict(projector_state)
    projector = projector.double()
    opt.add_param_group({"params": projector.parameters(), "lr": opt.param_groups[0]["lr"]})
    protos = prototypes.double().unsqueeze(1)  # [C, 1, d]
    T = o["temperature"]

    def contrastive(features):  # contrast_mode 'all', SupCon with labels=None: the views of a sample are positives
        b, count = features.shape[0], features.shape[1]
        mask = torch.eye(b, dtype=torch.float64)
        contrast = F.normalize(projector(torch.cat(torch.unbind(features, 1), 0)), p=2, dim=1)
        logits = contrast @ contrast.T / T
        logits = logits - logits.max(1, keepdim=True)[0].detach()
        mask = mask.repeat(count, count)
        logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(b * count).view(-1, 1), 0)
        mask = mask * logits_mask
        log_prob = logits - torch.log((torch.exp(logits) * logits_mask).sum(1, keepdim=True))
        return (-(T / T) * (mask * log_prob).sum(1) / mask.sum(1)).view(count, b).mean()

    outs = []
    for x, x_aug in zip(xs, views):
        x = x.double()
        f = features_of(model, x)
        out = model.fc(f)
        f_aug = features_of(model, x_aug.double())
        out_aug = model.fc(f_aug)
        out_anchor = anchor(x)
        with torch.no_grad():
            dist = F.cosine_similarity(
                protos.repeat(1, len(f), 1), f.view(1, len(f), -1).repeat(len(protos), 1, 1), dim=-1
            )
            indices = dist.topk(1, largest=True, dim=0)[1].squeeze(0)
        feats = torch.cat([protos[indices], f.unsqueeze(1), f_aug.unsqueeze(1)], 1)
        loss = o["lambda_ce_trg"] * aug_cross_entropy(out, out_aug, out_anchor).mean(0)
        loss = loss + o["lambda_cont"] * contrastive(feats)
        outs.append(out.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return outs, dict(model.named_parameters()), projector


def ours(recipe, monkeypatch, **extra):
    """Our Adapter under the shipped recipe, its views drawn by augment() and recorded."""
    views, calls = [], []

    def recording(images, *args, **kwargs):
        calls.append((args, kwargs))
        out = augment(images, *args, **kwargs)
        views.append(out.detach().clone())
        return out

    monkeypatch.setattr(santa_module, "augment", recording)
    net = tiny(sharp=20.0)
    gaussians = source_statistics(net)
    r = shipped("santa", recipe)
    s = r.settings
    torch.manual_seed(3)  # the projector's initialisation, then the views
    method = create("santa", gaussians, "cpu", **{**r.options, **extra})
    adapter = Adapter(
        FeatureClassifier(copy.deepcopy(net)), method, optimizer=s["optimizer"], lr=s["lr"], params=s["params"]
    )
    return net, gaussians, r, adapter, views, calls


@pytest.mark.parametrize("recipe", ["cifar10-c", "imagenet-c"])
def test_santa_under_its_recipe_steps_as_the_authors(recipe, monkeypatch):
    net, gaussians, r, adapter, views, calls = ours(recipe, monkeypatch)
    s, o = r.settings, r.options
    assert s["params"] == "norm" and s["optimizer"] == ("nesterov" if recipe == "imagenet-c" else "adam")
    assert o == {"temperature": 0.1, "projection_dim": 128, "lambda_ce_trg": 1.0, "lambda_cont": 1.0}
    start = {k: v.clone() for k, v in adapter.method.projector_start.items()}
    xs = batches(3)
    got = [adapter.step(x).double() for x in xs]
    # one view a batch, of the CoTTA pipeline (get_tta_transforms' defaults: noise, edge padding)
    assert len(views) == len(xs) and all(c == ((), {}) for c in calls)
    expected, params, projector = santa_reference(net, xs, views, gaussians.means, start, s["optimizer"], s["lr"], o)
    for mine, want in zip(got, expected):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-5)
    trained = dict(adapter.model.model.named_parameters())
    for name, p in params.items():
        torch.testing.assert_close(trained[name].detach().double(), p.detach(), rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(trained["bn.weight"], net.bn.weight)  # it moved
    torch.testing.assert_close(trained["fc.weight"], net.fc.weight, rtol=0, atol=0)  # the classifier stays
    for (name, p), q in zip(adapter.method.projector.named_parameters(), projector.parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach(), rtol=1e-4, atol=1e-6, msg=f"projector {name}")


def test_the_anchor_stays_at_the_source_and_a_reset_restores_the_projector(monkeypatch):
    net, _, _, adapter, _, _ = ours("cifar10-c", monkeypatch)
    xs = batches(2)
    for x in xs:
        adapter.step(x)
    anchor = dict(adapter.method.anchor.model.named_parameters())
    for name, p in net.named_parameters():
        torch.testing.assert_close(anchor[name], p, rtol=0, atol=0, msg=name)
    assert not all(
        torch.equal(v, adapter.method.projector_start[k]) for k, v in adapter.method.projector.state_dict().items()
    )
    adapter.reset()
    for k, v in adapter.method.projector.state_dict().items():
        torch.testing.assert_close(v, adapter.method.projector_start[k], rtol=0, atol=0, msg=k)
