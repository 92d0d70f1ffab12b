"""SoTTA and STAMP, the outlier-aware methods of issue 63, against float64 transcriptions of
their authors' updates on the tiny net of test_fidelity.py.

Transcribed from taeckyung/SoTTA learner/sotta.py (train_online, step), utils/memory.py (HUS),
utils/loss_functions.py (HLoss), utils/sam_optimizer.py and learner/dnn.py (SAM over Adam,
sam_collect_params with freeze_top); and from yuyongcan/STAMP src/methods/stamp.py (STAMP,
RBM, entropy), src/methods/setup.py (setup_stamp: SAM over plain SGD) and src/utils/utils.py
(softmax_entropy). The random parts are fixed on both sides: the memories' removals take the
same uniforms (shared/class_memory.removal_draws, patched), STAMP's views are a fixed sequence
of deterministic transformations.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import write_folder
from helpers import adapt, rows
from test_fidelity import C, authors_model, batches, entropy, tiny
from torch import nn

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods import stamp as stamp_module
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.shared import class_memory
from cafa_cli.model.features import FeatureClassifier

FROZEN_NAMES = ("layer4", "blocks.9", "blocks.10", "blocks.11")


def collect_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """sam_collect_params(freeze_top=True) / STAMP.collect_params, with their substring rules."""
    params = {}
    for nm, m in model.named_modules():
        if any(name in nm for name in FROZEN_NAMES) or "norm." in nm or nm in ["norm"]:
            continue
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)):
            for np_, p in m.named_parameters():
                if np_ in ["weight", "bias"]:
                    params[f"{nm}.{np_}"] = p
    for p in params.values():
        p.requires_grad_(True)
    return params


def sam_step(params: dict, base: torch.optim.Optimizer, loss_of, rho: float) -> None:
    """SAM's first_step (ε = ρ·g/(‖g‖ + 1e-12)), the second pass, second_step (back to θ, base step)."""
    base.zero_grad()
    loss_of().backward()
    norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params.values() if p.grad is not None]), p=2)
    olds = {}
    with torch.no_grad():
        for k, p in params.items():
            olds[k] = p.detach().clone()
            if p.grad is not None:
                p.add_(p.grad * (rho / (norm + 1e-12)))
    base.zero_grad()
    loss_of().backward()
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(olds[k])
    base.step()
    base.zero_grad()


def pick(u: float, n: int) -> int:  # random.randrange(n) / random.choice, from the shared uniform
    return min(int(u * n), n - 1)


def fixed_draws(monkeypatch, batches_: list[torch.Tensor], seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    draws = [torch.rand(len(x), 2, generator=g, dtype=torch.float64) for x in batches_]
    queue = iter(draws)
    monkeypatch.setattr(class_memory, "removal_draws", lambda n, device: next(queue))
    return draws


# --- SoTTA (taeckyung/SoTTA) -------------------------------------------------------------


def sotta_reference(net, xs, draws, lr, threshold, capacity, bn_momentum, rho):
    model = copy.deepcopy(net).double()
    model.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.track_running_stats, m.momentum = True, bn_momentum
    params = collect_params(model)
    base = torch.optim.Adam(params.values(), lr=lr, weight_decay=0)
    data = [[] for _ in range(C)]  # HUS: each class's samples, in arrival order

    def hloss():
        p = torch.softmax(model(torch.stack(feats)), dim=1)
        return (-p * torch.log(p + 1e-6)).mean()

    history = []
    for x, u in zip(xs, draws):
        x = x.double()
        model.eval()
        with torch.no_grad():
            logits = model(x)
        confidences, labels = logits.softmax(1).max(1)
        for i in range(len(x)):  # add_instance, remove_instance
            c = int(labels[i])
            if confidences[i] < threshold:
                continue
            if sum(len(d) for d in data) >= capacity:
                occupancy = [len(d) for d in data]
                largest = [k for k, o in enumerate(occupancy) if o == max(occupancy)]
                victim = c if c in largest else largest[pick(float(u[i, 0]), len(largest))]
                data[victim].pop(pick(float(u[i, 1]), len(data[victim])))
            data[c].append(x[i])
        feats = [f for d in data for f in d]
        if feats:
            model.train() if len(feats) > 1 else model.eval()
            sam_step(params, base, hloss, rho)
        history.append((logits, copy.deepcopy(model.state_dict())))
    return history


def test_sotta_under_its_cifar10_recipe_matches_the_authors_update(monkeypatch):
    net, xs = tiny(), batches(4, size=16)
    r = shipped("sotta", "cifar10-c")
    assert (r.settings["optimizer"], r.settings["lr"], r.settings["batch_size"]) == ("adam", 0.001, 64)
    o = {**r.options, "memory_size": 8, "update_every": 16, "threshold": 0.6}  # the batch's size, as 64 is the recipe's
    draws = fixed_draws(monkeypatch, xs)
    lr = 0.01  # the recipe's 1e-3 moves too little to compare; the update rule is the same
    adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), create("sotta", **o), optimizer="adam", lr=lr)
    expected = sotta_reference(net, xs, draws, lr, o["threshold"], 8, o["bn_momentum"], o["rho"])
    stored = []
    for x, (logits, state) in zip(xs, expected):
        torch.testing.assert_close(adapter.step(x).double(), logits, rtol=1e-4, atol=1e-5)
        mine = adapter.model.model.state_dict()
        for name, value in state.items():  # the affines and the running statistics its steps moved
            if value.is_floating_point():
                torch.testing.assert_close(mine[name].double(), value, rtol=1e-4, atol=1e-6, msg=name)
        stored.append(len(adapter.method.memory))
    assert stored[-1] == 8 and stored[0] < 8  # the memory filled, and later removed samples
    assert not torch.equal(adapter.model.model.bn.running_mean, net.bn.running_mean)
    assert torch.equal(adapter.model.model.layer4[1].weight, net.layer4[1].weight)  # frozen, as freeze_top


@pytest.mark.parametrize("recipe,threshold", [("imagenet-c", 0.33), ("cifar10-c", 0.99), ("cifar100-c", 0.66)])
def test_sottas_recipes_hold_the_authors_thresholds(recipe, threshold):
    o = shipped("sotta", recipe).options
    assert (o["threshold"], o["memory_size"], o["update_every"], o["bn_momentum"], o["rho"]) == (
        threshold,
        64,
        64,
        0.2,
        0.05,
    )


# --- STAMP (yuyongcan/STAMP) -------------------------------------------------------------


def view_sequence():
    """A fixed stand-in for the random views: the k-th call's view, the same on both sides."""
    calls = iter(range(10_000))

    def views(images, augmentation="cotta"):
        k = next(calls)
        return torch.roll(images, shifts=k % 3 + 1, dims=3) * (1.0 - 0.05 * (k % 4))

    return views


def stamp_reference(net, xs, draws, lr, alpha, n_aug, capacity, t_max, consistency, rho):
    model = authors_model(net)  # configure_model: train mode, batch statistics
    norm_model = copy.deepcopy(model).train()
    params = collect_params(model)
    base = torch.optim.SGD(params.values(), lr=lr)  # SAM(params, optim.SGD, lr=..., rho=0.05): no momentum
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(base, t_max)
    margin = alpha * math.log(C)
    data = [[] for _ in range(C)]  # RBM
    count_class = torch.zeros(C)
    total = 0
    views = view_sequence()

    def weighted_entropy():
        entropys = entropy(model(torch.stack(memory)))
        inv_entropy = 1 / torch.exp(entropys)
        coeff = inv_entropy / inv_entropy.sum() * capacity
        return entropys.mul(coeff).mean()

    history = []
    for x, u in zip(xs, draws):
        x = x.double()
        with torch.no_grad():
            output_origin = model(x)
            outputs = [output_origin.softmax(dim=1)] + [model(views(x)).softmax(dim=1) for _ in range(n_aug)]
            output = torch.stack(outputs, dim=0).mean(0)
            entropys = -torch.sum(output * torch.log(output + 1e-5), dim=1)
            keep = entropys < margin
            if consistency:
                keep &= output_origin.max(dim=1)[1] == norm_model(x).max(dim=1)[1]
        for i in torch.where(keep)[0].tolist():  # RBM.append
            if total < capacity:
                total += 1
            else:  # remove_item
                max_count = 0
                for k in range(C):
                    if len(data[k]) and count_class[k] > max_count:
                        max_count = count_class[k]
                max_classes = [k for k in range(C) if count_class[k] == max_count and len(data[k]) > 0]
                data[max_classes[pick(float(u[i, 0]), len(max_classes))]].pop(0)
            data[int(output_origin.argmax(1)[i])].append(x[i])
        if total:
            memory = []
            for k in range(C):  # get_data
                memory.extend(data[k])
                count_class[k] = 0.9 * count_class[k] + 0.1 * len(data[k])
            sam_step(params, base, weighted_entropy, rho)
            scheduler.step()
        history.append((output, -entropys, {k: p.detach().clone() for k, p in params.items()}))
    return history


@pytest.mark.parametrize("recipe", ["cifar10-c", "imagenet-c"])
def test_stamp_under_its_recipes_matches_the_authors_update(monkeypatch, recipe):
    net, xs = tiny(sharp=20.0), batches(5, size=16)
    r = shipped("stamp", recipe)
    s, o = r.settings, r.options
    assert (s["optimizer"], s["momentum"], s["batch_size"]) == ("sgd", 0.0, 64)
    assert o["consistency"] == (recipe != "imagenet-c") and o["augmentations"] == 15
    o = {**o, "augmentations": 3, "memory_size": 8, "cosine_steps": 2}  # small, and the cosine's whole period
    draws = fixed_draws(monkeypatch, xs)
    monkeypatch.setattr(stamp_module, "views", view_sequence())
    lr = 0.05
    adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), create("stamp", **o), optimizer="sgd", lr=lr, momentum=0.0)
    expected = stamp_reference(net, xs, draws, lr, o["alpha"], 3, 8, o["cosine_steps"], o["consistency"], o["rho"])
    for x, (output, score, params) in zip(xs, expected):
        logits = adapter.step(x)
        torch.testing.assert_close(logits.softmax(1).double(), output, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(adapter.method.id_score(logits).double(), score, rtol=1e-4, atol=1e-5)
        mine = dict(adapter.model.model.named_parameters())
        for name, p in params.items():
            torch.testing.assert_close(mine[name].detach().double(), p, rtol=1e-4, atol=1e-6, msg=name)
    assert len(adapter.method.memory) == 8  # it filled and removed
    assert adapter.optimizer.param_groups[0]["lr"] == lr  # the cosine's rate is the step's alone


def test_stamps_recipes_hold_the_authors_rates_and_schedules():
    got = {
        recipe: (r.settings["lr"], r.options["cosine_steps"], r.options["augmentation"], r.options["alpha"])
        for recipe in ("imagenet-c", "cifar10-c", "cifar100-c")
        for r in [shipped("stamp", recipe)]
    }
    assert got == {
        "imagenet-c": (0.001, 750, "crop", 0.5),
        "cifar10-c": (0.0001, 150, "cotta", 0.5),
        "cifar100-c": (0.01, 150, "crop", 0.5),
    }


# --- through the command line -------------------------------------------------------------


@pytest.mark.parametrize(
    "stream",
    [("--order", "label-shift:1.0"), ("--reset", "never"), ("--outliers", "noise:gaussian:0.2")],
    ids=lambda s: s[1],
)
@pytest.mark.parametrize("name", ["sotta", "stamp"])
def test_each_runs_through_cafa_adapt(setup, tmp_path, name, stream):
    """Two domains of 18 images, batches of 6 (with outliers: 4 more a domain, scored by its id_score)."""
    shifted = write_folder(tmp_path / "shifted", per_class=6, seed=1, shift=0.3)
    small = ["--method-option", "augmentations=2"] if name == "stamp" else ["--method-option", "threshold=0.5"]
    result = adapt(
        setup, setup["train"], "--data", shifted, "--method", name, "--batch-size", "6", "--quiet", *small, *stream
    )
    assert result.exit_code == 0, result.stderr
    predictions = rows(result)
    outliers = stream[0] == "--outliers"
    assert len(predictions) == (36 + 2 * 4 if outliers else 36)
    assert {row["prediction"] for row in predictions} <= {"a", "b", "c"}
    if outliers:
        assert sum(row["outlier"] == "1" for row in predictions) == 8
