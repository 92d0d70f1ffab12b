"""ROID under its recipes against a float64 transcription of the authors' update, written
here from mariodoebler/test-time-adaptation classification/methods/roid.py
(ROID.loss_calculation, forward_and_adapt, configure_model, collect_params),
classification/utils/losses.py (SoftLikelihoodRatio, SymmetricCrossEntropy, Entropy) and
classification/utils/misc.py (ema_update_model); the options from conf.py's ROID section.
The augmented views are the one random part: both sides draw them with augment() (noise off,
reflection padding, as ROID's get_tta_transforms(cotta_augs=False)) from the same seed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_fidelity import C, authors_model, batches, bn_affines, entropy, tiny

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.shared.augment import augment
from cafa_cli.model.features import FeatureClassifier


def slr(logits, clip=0.99, eps=1e-5):  # SoftLikelihoodRatio
    probs = torch.clamp(logits.softmax(1), min=0.0, max=clip)
    return -(probs * torch.log((probs / (torch.ones_like(probs) - probs)) + eps)).sum(1)


def sce(x, x_ema, alpha=0.5):  # SymmetricCrossEntropy, neither side detached
    return -(1 - alpha) * (x_ema.softmax(1) * x.log_softmax(1)).sum(1) - alpha * (
        x.softmax(1) * x_ema.log_softmax(1)
    ).sum(1)


def roid_reference(net, xs, seeds, optimizer, lr, options, steps=1, norms=None):
    """The authors' ROID, float64: per batch `steps` times forward_and_adapt; the reported
    outputs are the last one's, multiplied by the smoothed prior. `norms`: a float64 copy of
    the net with its BatchNorms replaced (devavratTomar/unmixtns runs ROID with UnMix-TNS
    layers), whose affines train; by default configure_model's BatchNorm2d on batch statistics."""
    o = options
    model = authors_model(net) if norms is None else norms
    if norms is None:
        params = bn_affines(model)
    else:  # collect_params: the normalisation layers' affines
        params = {
            f"{name}.{p_name}": p
            for name, m in model.named_modules()
            if hasattr(m, "eps")
            for p_name, p in m.named_parameters(recurse=False)
        }
    for p in params.values():
        p.requires_grad_(True)
    src_model = copy.deepcopy(model)
    for p in src_model.parameters():
        p.detach_()
    if optimizer == "adam":
        opt = torch.optim.Adam(params.values(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    else:  # the collection's SGD: momentum 0.9, dampening 0, Nesterov
        opt = torch.optim.SGD(params.values(), lr=lr, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)
    class_probs_ema = torch.ones(C, dtype=torch.float64) / C
    reported, history, kept = [], [], []
    for x, seed in zip(xs, seeds):
        batch_size = len(x)  # cfg.TEST.BATCH_SIZE: every batch here is full
        torch.manual_seed(seed)  # as ours is seeded before each batch: its steps draw their views in turn
        for _ in range(steps):
            outputs = model(x.double())
            mask = torch.zeros(len(x), dtype=torch.bool)
            if o["weighting"]:
                with torch.no_grad():
                    weights_div = 1 - F.cosine_similarity(class_probs_ema.unsqueeze(0), outputs.softmax(1), dim=1)
                    weights_div = (weights_div - weights_div.min()) / (weights_div.max() - weights_div.min())
                    mask = weights_div < weights_div.mean()
                    weights_cert = -entropy(outputs)
                    weights_cert = (weights_cert - weights_cert.min()) / (weights_cert.max() - weights_cert.min())
                    weights = torch.exp(weights_div * weights_cert / o["temperature"])
                    weights[mask] = 0.0
                    m = o["probs_momentum"]
                    class_probs_ema = m * class_probs_ema + (1 - m) * outputs.softmax(1).mean(0)
            loss_out = slr(outputs)
            if o["weighting"]:
                loss_out = (loss_out * weights)[~mask]
            loss = loss_out.sum() / batch_size
            if o["consistency"]:
                # the same draws as ours: the views of the kept images (float32, as given)
                views = augment(x[~mask], noise=False, padding="reflection").double()
                outputs_aug = model(views)
                loss = loss + (sce(outputs_aug, outputs[~mask]) * weights[~mask]).sum() / batch_size
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # ema_update_model toward the source, trained parameters only
                a = o["source_momentum"]
                for p, p_src in zip(model.parameters(), src_model.parameters()):
                    if p.requires_grad:
                        p.data = a * p.data + (1 - a) * p_src.data
            with torch.no_grad():
                if o["prior_correction"]:
                    prior = outputs.softmax(1).mean(0)
                    smooth = max(1 / outputs.shape[0], 1 / outputs.shape[1]) / torch.max(prior)
                    smoothed_prior = (prior + smooth) / (1 + smooth * outputs.shape[1])
                    outputs = outputs * smoothed_prior
            kept.append(int((~mask).sum()))
        reported.append(outputs.detach())
        history.append({k: p.detach().clone() for k, p in params.items()})
    return reported, history, kept


OFF = {"weighting": False, "consistency": False, "prior_correction": False}


@pytest.mark.parametrize(
    "recipe, size, steps, flags",
    [
        ("cifar10-c", 48, 1, {}),  # prior smoothing by 1/C
        ("imagenet-c", 8, 2, {}),  # by 1/N; two steps a batch
        ("cifar100-c", 48, 1, OFF),  # the three parts off: SLR and ensembling alone
    ],
)
def test_roid_under_its_recipe_matches_the_authors_update(recipe, size, steps, flags):
    net, xs = tiny(sharp=20.0), batches(3, size=size)
    r = shipped("roid", recipe)
    s, o = r.settings, {**r.options, **flags}
    assert r.options == {
        "weighting": True,
        "consistency": True,
        "prior_correction": True,
        "source_momentum": 0.99,
        "probs_momentum": 0.9,
        "temperature": 1 / 3,
    }
    assert s["optimizer"] == ("nesterov" if recipe == "imagenet-c" else "adam") and s["params"] == "norm"
    # the ImageNet rate 0.00025 moves this tiny net too little to compare (the rule is the same);
    # far above 0.002, SGD's steps on it grow until float32 and float64 keep different samples
    lr = 0.002 if s["optimizer"] == "nesterov" else s["lr"]
    adapter = Adapter(
        FeatureClassifier(copy.deepcopy(net)),
        create("roid", None, "cpu", **o),
        optimizer=s["optimizer"],
        lr=lr,
        momentum=s.get("momentum", 0.9),
        steps=steps,
    )
    seeds = [21, 22, 23]
    expected, history, kept = roid_reference(net, xs, seeds, s["optimizer"], lr, o, steps)
    source = {k: v.detach().clone() for k, v in net.named_parameters()}
    for x, seed, want, params in zip(xs, seeds, expected, history):
        torch.manual_seed(seed)  # the views are a step's only random draw
        got = adapter.step(x)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        mine = dict(adapter.model.model.named_parameters())
        for name, p in params.items():
            torch.testing.assert_close(mine[name].detach().double(), p, rtol=1e-4, atol=1e-6, msg=name)
    assert adapter.kept_samples == sum(kept)
    if o["weighting"]:
        assert 0 < sum(kept) < len(kept) * size  # the diversity filter drops some, keeps some
    mine = dict(adapter.model.model.named_parameters())
    assert not torch.equal(mine["layer3.1.weight"], source["layer3.1.weight"])  # it adapted


@pytest.mark.parametrize("norm", ["unmix:4", "ema:0.05"])
def test_roid_under_a_running_norm_moves_it_on_both_passes_as_the_authors(norm):
    """devavratTomar/unmixtns runs ROID with UnMix-TNS (tta_experiments/methods/roid.py), whose
    UnMixTNS2d.forward moves the components on every pass: the batch's, then the views of
    the kept samples'; RoTTA's robust BN in train mode does the same with its statistics
    (`ema`, transcribed in test_norms_alpha_unmix). Until issue 60 each pass moved them from
    where they were before the batch, so the views' pass alone counted: the components were
    0.28 apart after 3 batches."""
    from test_norms_alpha_unmix import reference_net, source_net

    net, xs, seeds = source_net(sharp=20.0), batches(3, size=48), [21, 22, 23]
    r = shipped("roid", "cifar10-c")
    s, o = r.settings, r.options
    adapter = Adapter(
        FeatureClassifier(copy.deepcopy(net)), create("roid", None, "cpu", **o), optimizer="adam", lr=s["lr"], norm=norm
    )
    reference = reference_net(net, norm)
    for p in reference.parameters():
        p.requires_grad_(False)
    expected, history, kept = roid_reference(net, xs, seeds, "adam", s["lr"], o, norms=reference)
    ours = adapter.norms
    theirs = [m for m in reference.modules() if hasattr(m, "eps") and not isinstance(m, torch.nn.BatchNorm2d)]
    assert len(ours) == len(theirs) == 3
    for x, seed, want in zip(xs, seeds, expected):
        torch.manual_seed(seed)
        torch.testing.assert_close(adapter.step(x).double(), want, rtol=1e-4, atol=1e-5)
    for i, (layer, ref) in enumerate(zip(ours, theirs)):  # where the three batches left them
        mine = layer.component_means if norm.startswith("unmix") else layer.running_mean
        torch.testing.assert_close(mine.double(), ref.means, rtol=1e-4, atol=1e-5, msg=f"layer {i}")
    assert 0 < sum(kept) < 3 * 48  # the views are of some samples, not all
