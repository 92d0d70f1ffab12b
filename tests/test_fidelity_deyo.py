"""DeYO under its recipes against a float64 transcription of the authors' update, and its
patch shuffle on any input size and on a ViT.

Transcribed from Jhyun17/DeYO methods/deyo.py (forward_and_adapt_deyo, collect_params,
configure_model) and main.py (SGD, momentum 0.9, for ImageNet-C); the CIFAR recipes' Adam is
the benchmark collection's (mariodoebler/test-time-adaptation classification/methods/deyo.py
and engine/method.py setup_optimizer, cfgs/cifar10_c/deyo.yaml). The patch permutations are
drawn from one fixed generator on both sides, as the authors draw them: one uniform row per
image of the entropy-filtered set, argsorted.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torchvision
from test_fidelity import C, assert_params_match, authors_model, bn_affines, entropy, ours, tiny
from torch import nn

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods.deyo import occlude, shuffle_patches
from cafa_cli.methods.recipes import shipped
from cafa_cli.model.features import FeatureClassifier

SEED = 3  # the patch permutations' generator, on both sides


def images(n: int = 3, size: int = 48, side: int = 8, seed: int = 1) -> list[torch.Tensor]:
    """Batches of `side`-pixel images near ten prototypes (a multiple of the 4×4 grid, as the
    authors' 224- and 32-pixel images are: their resize is then the identity)."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(C, 3, side, side, generator=g) * 2
    return [
        prototypes[torch.randint(0, C, (size,), generator=g)] + 0.6 * torch.randn(size, 3, side, side, generator=g)
        for _ in range(n)
    ]


def deyo_reference(net, xs, recipe: str):
    """forward_and_adapt_deyo with aug_type patch, filter_ent, filter_plpd and both reweightings
    on, each batch in turn; returns the trained affines after each batch, and the counts kept
    by each filter and the least distance of an entropy or PLPD to its threshold."""
    r = shipped("deyo", recipe)
    o, s = r.options, r.settings
    deyo_margin, margin = o["entropy_margin"] * math.log(C), o["weight_margin"] * math.log(C)
    patch_len, threshold = o["patch_len"], o["plpd_threshold"]
    model = authors_model(net)
    params = bn_affines(model, skip=lambda name: "layer4" in name)  # collect_params skips layer4
    for p in params.values():
        p.requires_grad_(True)
    if s["optimizer"] == "sgd":  # main.py
        optimizer = torch.optim.SGD(params.values(), s["lr"], momentum=0.9)
    else:  # the collection's setup_optimizer: Adam, betas (OPTIM.BETA 0.9, 0.999), no weight decay
        optimizer = torch.optim.Adam(params.values(), lr=s["lr"], betas=(0.9, 0.999), weight_decay=0.0)
    g = torch.Generator().manual_seed(SEED)
    history, counts, closest = [], [], math.inf
    for x in xs:
        x = x.double()
        outputs = model(x)
        optimizer.zero_grad()
        entropys = entropy(outputs)
        closest = min(closest, float((entropys.detach() - deyo_margin).abs().min()))
        filter_ids_1 = torch.where(entropys < deyo_margin)
        entropys = entropys[filter_ids_1]
        backward, final_backward = len(entropys), 0
        if backward:
            x_prime = x[filter_ids_1].detach()
            side = (x.shape[-1] // patch_len) * patch_len
            x_prime = torchvision.transforms.Resize((side, side))(x_prime)
            # rearrange 'b c (ps1 h) (ps2 w) -> b (ps1 ps2) c h w', ps1 = ps2 = patch_len
            b, c, H, W = x_prime.shape
            h, w = H // patch_len, W // patch_len
            x_prime = x_prime.reshape(b, c, patch_len, h, patch_len, w).permute(0, 2, 4, 1, 3, 5)
            x_prime = x_prime.reshape(b, patch_len * patch_len, c, h, w)
            perm_idx = torch.argsort(torch.rand(x_prime.shape[0], x_prime.shape[1], generator=g), dim=-1)
            x_prime = x_prime[torch.arange(x_prime.shape[0]).unsqueeze(-1), perm_idx]
            # and back: 'b (ps1 ps2) c h w -> b c (ps1 h) (ps2 w)'
            x_prime = x_prime.reshape(b, patch_len, patch_len, c, h, w).permute(0, 3, 1, 4, 2, 5).reshape(b, c, H, W)
            x_prime = torchvision.transforms.Resize((x.shape[-1], x.shape[-1]))(x_prime)
            with torch.no_grad():
                outputs_prime = model(x_prime)
            prob_outputs = outputs[filter_ids_1].softmax(1)
            prob_outputs_prime = outputs_prime.softmax(1)
            cls1 = prob_outputs.argmax(dim=1)
            plpd = torch.gather(prob_outputs, 1, cls1.reshape(-1, 1)) - torch.gather(
                prob_outputs_prime, 1, cls1.reshape(-1, 1)
            )
            plpd = plpd.reshape(-1)
            closest = min(closest, float((plpd.detach() - threshold).abs().min()))
            filter_ids_2 = torch.where(plpd > threshold)
            entropys = entropys[filter_ids_2]
            final_backward = len(entropys)
            if final_backward:
                plpd = plpd[filter_ids_2]
                coeff = 1 / torch.exp(entropys.clone().detach() - margin) + 1 / torch.exp(-1.0 * plpd.clone().detach())
                loss = entropys.mul(coeff).mean(0)
                loss.backward()
                optimizer.step()
        optimizer.zero_grad()
        counts.append((len(x), backward, final_backward))
        history.append({k: p.detach().clone() for k, p in params.items()})
    return history, counts, closest


@pytest.mark.parametrize("recipe", ["cifar10-c", "imagenet-c"])
def test_deyo_under_its_recipe_matches_the_authors_update(recipe):
    net, xs = tiny(), images()
    history, counts, closest = deyo_reference(net, xs, recipe)
    # each filter drops some samples and keeps some in every batch, and no value sits so near its
    # threshold that float32 could decide otherwise than float64
    assert all(n > first > final > 0 for n, first, final in counts), counts
    assert closest > 1e-4
    adapter = ours(net, "deyo", recipe)
    adapter.method.generator = torch.Generator().manual_seed(SEED)
    source = {k: p.detach().clone() for k, p in adapter.model.model.named_parameters()}
    for x, expected in zip(xs, history):
        adapter.step(x)
        assert_params_match(adapter, expected)
    assert adapter.kept_samples == sum(final for _, _, final in counts)
    trained = dict(adapter.model.model.named_parameters())
    assert all(torch.equal(trained[k], source[k]) for k in source if k.startswith("layer4"))  # frozen, as theirs


def test_a_batch_whose_entropy_filter_keeps_nothing_takes_no_step():
    """Nothing confident enough: no second pass, no step, the optimiser's state as it was."""
    net = tiny(sharp=0.01)  # near-uniform predictions: every entropy is about ln C > 0.5·ln C
    adapter = ours(net, "deyo", "cifar10-c")
    before = {k: p.detach().clone() for k, p in adapter.model.model.named_parameters()}
    adapter.step(images(1)[0])
    assert adapter.kept_samples == 0 and adapter.skipped_steps == 0
    assert all(torch.equal(p, before[k]) for k, p in adapter.model.model.named_parameters())
    assert all(int(s["step"]) == 0 for s in adapter.optimizer.state.values() if "step" in s)


def test_the_patch_grid_fits_any_size_and_leaves_the_remainder_in_place():
    """7×10 pixels, a 3×3 grid: patches of 2×3 over the top-left 6×9; the last row and
    column stay. The identity order gives the image back; a reversed one moves whole patches."""
    x = torch.arange(2 * 7 * 10, dtype=torch.float32).reshape(1, 2, 7, 10)
    identity = torch.arange(9).unsqueeze(0)
    assert torch.equal(shuffle_patches(x, 3, identity), x)
    reversed_ = shuffle_patches(x, 3, identity.flip(1))
    assert torch.equal(reversed_[..., 6:, :], x[..., 6:, :]) and torch.equal(reversed_[..., :, 9:], x[..., :, 9:])
    assert torch.equal(reversed_[..., 0:2, 0:3], x[..., 4:6, 6:9])  # patch 0 is the former patch 8
    assert torch.equal(reversed_[..., 2:4, 3:6], x[..., 2:4, 3:6])  # the middle one stays
    # a grid finer than the image: one pixel a patch, as many as there are
    assert shuffle_patches(torch.ones(3, 1, 2, 2), 4, torch.arange(4).repeat(3, 1)).shape == (3, 1, 2, 2)


def test_the_pixel_and_occlusion_variants_run_and_a_window_off_the_image_is_refused():
    net = tiny()
    for options in (
        {"aug_type": "pixel"},
        {"aug_type": "occ", "occlusion_size": 4, "occlusion_row": 2, "occlusion_column": 2},
    ):
        adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), create("deyo", **options))
        adapter.step(images(1)[0])
        assert adapter.kept_samples > 0
    x = torch.randn(2, 3, 8, 8)
    window = occlude(x, 4, 2, 6)
    assert torch.allclose(window[:, :, 2:6, 6:], x.mean((2, 3), keepdim=True).expand(2, 3, 4, 2))
    assert torch.equal(window[:, :, :, :6], x[:, :, :, :6])
    with pytest.raises(UsageError, match="occlusion window"):
        occlude(x, 112, 56, 56)  # the authors' 224-pixel window on an 8-pixel image


def test_the_shuffled_pass_leaves_the_running_statistics_as_the_batch_left_them():
    """Under `norm` ema the running statistics are the first pass's, not the shuffled subset's."""
    net, x = tiny(), images(1)[0]
    deyo = Adapter(FeatureClassifier(copy.deepcopy(net)), create("deyo", plpd_threshold=0.0), norm="ema:0.1")
    bn = Adapter(FeatureClassifier(copy.deepcopy(net)), create("bn"), norm="ema:0.1")
    deyo.step(x)
    bn.step(x)
    assert deyo.kept_samples > 0
    for (name, mine), theirs in zip(deyo.model.named_buffers(), bn.model.buffers()):
        if "running" in name:
            torch.testing.assert_close(mine, theirs, msg=name)


def test_deyo_adapts_the_layer_norm_affines_of_a_vit():
    """A tiny timm ViT (no BatchNorm): every LayerNorm affine adapts but the final norm's (the
    authors' collect_params skips `norm`), and the patch shuffle cuts its 32-pixel images."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("test_vit", img_size=32, num_classes=3)
    with torch.no_grad():
        vit.head.weight.mul_(30)  # confident enough for the entropy filter
    before = {k: p.detach().clone() for k, p in vit.named_parameters()}
    adapter = Adapter(FeatureClassifier(vit), create("deyo", plpd_threshold=0.0), optimizer="sgd", lr=0.01)
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        adapter.step(x)
    assert adapter.kept_samples > 0
    norms = {name for name, m in vit.named_modules() if isinstance(m, nn.LayerNorm)}
    changed = {k for k, p in vit.named_parameters() if not torch.equal(p, before[k])}
    affines = {f"{name}.{kind}" for name in norms for kind in ("weight", "bias")}
    assert changed == affines - {"norm.weight", "norm.bias"}
    assert any(k.startswith("blocks.") for k in changed)


def test_under_class_balanced_norms_the_selection_passes_come_before_the_gradient_pass(trained):
    """Their passes share scratch statistics that the gradient pass's graph holds: the
    prediction and the running statistics are still bn's, and the steps run."""
    from test_norms import class_moments_of

    model, _, x, y = trained
    moments = class_moments_of(model, x, y)
    deyo = Adapter(
        copy.deepcopy(model), create("deyo", plpd_threshold=0.0), norm="class-balanced", class_moments=moments
    )
    bn = Adapter(copy.deepcopy(model), create("bn"), norm="class-balanced", class_moments=moments)
    torch.testing.assert_close(deyo.step(x[:50]), bn.step(x[:50]))
    for (name, mine), theirs in zip(deyo.model.named_buffers(), bn.model.buffers()):
        if "running" in name:
            torch.testing.assert_close(mine, theirs, msg=name)
    deyo.step(x[50:100])
    assert deyo.kept_samples > 0
