"""SHOT-IM and SHOT under their recipes against a float64 transcription of the online update of
Alfarra et al. (MotasemAlfarra/Online_Test_Time_Adaptation tta_methods/shot_im.py: configure_model
with update_bn_only off, collect_params, prepare_shot_model_and_optimizer, forward_and_adapt;
tta_methods/shot.py: forward_and_adapt's centroid pseudo-labels; utils/argparse.py:
beta_clustering_loss). Our Adapter runs the tiny net of test_fidelity.py in float64 (the loss
itself in float32, as the Adapter computes every loss), the reference runs it in float64:
the same batches, three steps, the reported logits and the parameters compared after each."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import write_folder
from helpers import adapt, rows
from test_fidelity import C, batches, bn_affines, tiny
from torch import nn

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.shot import centroid_pseudo_labels, information_maximisation
from cafa_cli.model.features import FeatureClassifier

NAMES = ("shot-im", "shot")


def authors_model(net: nn.Module) -> nn.Module:
    """configure_model(update_bn_only=False), in float64: train mode (BatchNorms on the batch's
    statistics), every parameter but the Linear layers' requires a gradient."""
    model = copy.deepcopy(net).double().train()
    model.requires_grad_(True)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.requires_grad_(False)
    return model


def with_features(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """model(x, return_feature=True): the logits and the input of the fc layer."""
    seen = []
    hook = model.fc.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        return model(x), seen[0]
    finally:
        hook.remove()


def authors_pseudo_labels(outputs: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """SHOT.forward_and_adapt's clustering, as written there."""
    softmax_out = outputs.softmax(1)
    features = features / features.norm(dim=1, keepdim=True)
    K = outputs.shape[1]
    aff = softmax_out
    initial_centroids = torch.matmul(aff.t(), features)
    initial_centroids = initial_centroids / (1e-8 + aff.sum(0, keepdim=True).t())
    distances = torch.cdist(features, initial_centroids, p=2)
    pseudo_labels = distances.argmin(axis=1)
    for _ in range(1):
        aff = torch.eye(K, dtype=features.dtype)[pseudo_labels]
        initial_centroids = torch.matmul(aff.t(), features)
        initial_centroids = initial_centroids / (1e-8 + aff.sum(0, keepdim=True).t())
        distances = torch.cdist(features, initial_centroids, p=2)
        pseudo_labels = distances.argmin(axis=1)
    return pseudo_labels


def authors_loss(outputs: torch.Tensor, features: torch.Tensor, beta: float | None) -> torch.Tensor:
    """SHOTIM.forward_and_adapt's loss, and SHOT's with `beta` (None: SHOT-IM)."""
    softmax_out = outputs.softmax(1)
    msoftmax = softmax_out.mean(0)
    l_ent = -(softmax_out * torch.log(softmax_out + 1e-5)).sum(-1).mean(0)
    l_div = (msoftmax * torch.log(msoftmax + 1e-5)).sum(-1)
    loss = l_ent + l_div
    if beta is not None:
        loss += beta * F.cross_entropy(outputs, authors_pseudo_labels(outputs, features))
    return loss


def alfarra_reference(net, xs, beta: float | None):
    """Their online SHOT(-IM): SGD lr 0.01 momentum 0.9 on the BatchNorm2d affines (hard-coded
    in prepare_shot_model_and_optimizer), one step a batch, the logits of the pass before it."""
    model = authors_model(net)
    optimizer = torch.optim.SGD(bn_affines(model).values(), lr=0.01, momentum=0.9)
    outs, after, labels = [], [], []
    for x in xs:
        outputs, features = with_features(model, x.double())
        authors_loss(outputs, features, beta).backward()
        optimizer.step()
        optimizer.zero_grad()
        outs.append(outputs.detach())
        after.append({name: p.detach().clone() for name, p in bn_affines(model).items()})
        labels.append((outputs.detach().argmax(1), authors_pseudo_labels(outputs.detach(), features.detach())))
    return outs, after, labels


@pytest.mark.parametrize("recipe", ["imagenet-c", "cifar10-c", "cifar100-c"])
@pytest.mark.parametrize("name", NAMES)
def test_shot_under_its_recipe_matches_alfarra_et_als_online_update(name, recipe):
    r = shipped(name, recipe)
    s = r.settings
    assert (s["optimizer"], s["lr"], s["momentum"], s["batch_size"], s["params"]) == ("sgd", 0.01, 0.9, 64, "norm")
    assert r.options == ({} if name == "shot-im" else {"beta": 0.1})
    net, xs = tiny(sharp=20.0), batches(3, size=64)
    adapter = Adapter(
        FeatureClassifier(copy.deepcopy(net).double()),
        create(name, None, "cpu", **r.options),
        **{k: s[k] for k in ("optimizer", "lr", "momentum", "params")},
    )
    expected, params, labels = alfarra_reference(net, xs, r.options.get("beta"))
    for x, want, state in zip(xs, expected, params):
        got = adapter.step(x.double())  # float32, as every step reports
        torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=1e-7)  # float32's rounding of the same logits
        mine = dict(adapter.model.model.named_parameters())
        for key, p in state.items():
            torch.testing.assert_close(mine[key].detach(), p, rtol=1e-7, atol=1e-8, msg=key)
    # the steps moved the affines; SHOT's pseudo-labels are not the model's argmax, so its term is tested
    source = bn_affines(authors_model(net))
    assert all(not torch.equal(params[-1][key], source[key]) for key in source)
    assert all((argmax != pseudo).any() for argmax, pseudo in labels)


@pytest.mark.parametrize("beta", [None, 0.3])
def test_the_losses_and_their_gradients_are_the_authors_in_float64(beta):
    """Loss and gradient, float64 on both sides: equal to rounding."""
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(40, C, generator=g, dtype=torch.float64)).requires_grad_(True)
    features = torch.randn(40, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    method = create("shot-im" if beta is None else "shot", None, **({} if beta is None else {"beta": beta}))
    ours = method.loss(logits, features)
    theirs = authors_loss(logits, features, beta)
    ours_grad = torch.autograd.grad(ours, (logits,))[0]
    theirs_grad = torch.autograd.grad(theirs, (logits,))[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-12)
    if beta is not None:
        got = centroid_pseudo_labels(logits, features)
        assert torch.equal(got, authors_pseudo_labels(logits.detach(), features.detach()))
        assert (got != logits.argmax(1)).any()
        assert (ours - information_maximisation(logits)).item() > 0  # the pseudo-label term is in


def test_information_maximisation_rewards_confident_predictions_spread_over_the_classes():
    confident_diverse = 20 * torch.eye(C, dtype=torch.float64)  # one sample per class, each sure
    confident_collapsed = 20 * torch.eye(C, dtype=torch.float64)[[0] * C]  # all sure of class 0
    uncertain = torch.zeros(C, C, dtype=torch.float64)
    assert information_maximisation(confident_diverse) < information_maximisation(uncertain)
    assert information_maximisation(confident_diverse) < information_maximisation(confident_collapsed)
    torch.testing.assert_close(
        information_maximisation(confident_diverse), -torch.tensor(C).log().double(), atol=1e-3, rtol=0
    )


def test_an_all_zero_feature_vector_does_not_turn_every_pseudo_label_into_class_0():
    """The authors' division makes a zero feature NaN, and with it every centroid: every label 0.
    Ours keeps it zero (the deviation the recipe states), and the batch's labels stay defined."""
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(16, C, generator=g, dtype=torch.float64)
    features = torch.randn(16, 8, generator=g, dtype=torch.float64)
    features[3] = 0
    assert (authors_pseudo_labels(logits, features) == 0).all()
    labels = centroid_pseudo_labels(logits, features)
    assert len(labels.unique()) > 1
    assert torch.isfinite(create("shot", None).loss(logits, features))


@pytest.mark.parametrize(
    "stream", [("--order", "iid"), ("--order", "label-shift:1.0"), ("--reset", "never")], ids=lambda s: s[1]
)
@pytest.mark.parametrize("name", NAMES)
def test_each_runs_through_cafa_adapt(setup, tmp_path, name, stream):
    """Two domains (the tiny training set, and a noisier one) of 18 images, batches of 6."""
    shifted = write_folder(tmp_path / "shifted", per_class=6, seed=1, shift=0.3)
    result = adapt(setup, setup["train"], "--data", shifted, "--method", name, "--batch-size", "6", "--quiet", *stream)
    assert result.exit_code == 0, result.stderr
    predictions = rows(result)
    assert len(predictions) == 36 and {row["prediction"] for row in predictions} <= {"a", "b", "c"}
