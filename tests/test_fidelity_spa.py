"""SPA against a float64 transcription of its authors' update, and SPA through `cafa adapt`.

The transcription follows mr-eggplant/SPA: tta_library/spa.py (SPA.forward_and_adapt_eata: the
image's logits, the frequency-masked view and the noisy view each through the predictor, the
KL consistency on the samples more confident on the image, get_auxiliary_loss's 0.1·tent or
0.1·(ETA + Fisher) of get_eta_loss, the negated gradient of the noise strengths, both
optimisers' steps and fix_patch_alpha; Prompt.masking with its fftshift over every axis and
__convert_symmertry_mask; reset; configure_model and collect_params), models/maskers.py
(LearnablePatchErasing), models/byol_wrapper.py (BYOLWrapper, both branches) and main.py
(the optimiser's two groups, get_fisher). The random parts have one draw on both sides: ours
come from spa.keep_draws and spa.noise_draws, recorded here and handed to the reference in
place of its `bernoulli_` and its per-patch `normal_`. Their fftshift with no `dim` rolls
the batch and channel axes too, so their image n reads the draw at (n + N/2) mod N: the
reference gets our draws rolled so (torch.fft.fftshift over those two axes).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import invoke, write_folder
from helpers import rows
from torch import nn

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create, spa
from cafa_cli.methods.recipes import shipped
from cafa_cli.model.features import FeatureClassifier

timm = pytest.importorskip("timm")

C = 10


# --- the authors' code, in float64 ----------------------------------------------------------


class BYOLWrapper(nn.Module):  # models/byol_wrapper.py
    def __init__(self, model, projector_dim):
        super().__init__()
        self.model = model
        self.predictor = nn.Linear(projector_dim, projector_dim, bias=False).double()
        nn.init.eye_(self.predictor.weight)

    def forward(self, x, use_predictor=False):
        if not use_predictor:
            return self.model(x)
        features = self.model.forward_features(x)
        try:  # for resnet50-gn
            features = self.model.global_pool(features)
            x = self.predictor(features)
            x = self.model.fc(x)
        except TypeError:  # for vitbase-ln (timm's global_pool is a string there)
            features = features[:, 0]
            x = self.model.fc_norm(features)
            x = self.predictor(x)
            x = self.model.head(x)
        return x


class Prompt:  # tta_library/spa.py, the frequency masking, its draw given
    def __init__(self, size: int, prompt_alpha=0.2):
        imageH = imageW = size
        promptH = int(imageH * prompt_alpha) if int(imageH * prompt_alpha) > 1 else 1
        promptW = int(imageW * prompt_alpha) if int(imageW * prompt_alpha) > 1 else 1
        paddingH = (imageH - promptH) // 2
        paddingW = (imageW - promptW) // 2
        init_para = torch.ones((1, 3, promptH, promptW))
        self.low_mask = F.pad(
            init_para,
            [imageH - paddingH - promptH, paddingH, imageW - paddingW - promptW, paddingW],
            mode="constant",
            value=0.0,
        ).contiguous()
        self.high_mask = 1 - self.low_mask

    def iFFT(self, amp_src_, pha_src, imgH, imgW):
        real = torch.cos(pha_src) * amp_src_
        imag = torch.sin(pha_src) * amp_src_
        fft_src_ = torch.complex(real=real, imag=imag)
        return torch.fft.ifft2(fft_src_, dim=(-2, -1), s=[imgH, imgW]).real

    def masking(self, x, draw):
        _, _, imgH, imgW = x.size()
        fft = torch.fft.fft2(x.clone(), dim=(-2, -1))
        amp_src, pha_src = torch.abs(fft), torch.angle(fft)
        amp_src = torch.fft.fftshift(amp_src)
        mask = self.low_mask * draw  # torch.empty_like(amp_src).bernoulli_(keep_prob)
        mask = mask + self.high_mask
        mask = self.convert_symmetry_mask(mask)
        amp_src = torch.fft.ifftshift(amp_src * mask)
        return self.iFFT(amp_src, pha_src, imgH, imgW)

    def convert_symmetry_mask(self, mask):
        startH = 1 - (mask.shape[-2] % 2)
        startW = 1 - (mask.shape[-1] % 2)
        sub_mask = mask[:, :, startH:, startW:]
        maskH, maskW = sub_mask.shape[-2] // 2, sub_mask.shape[-1] // 2
        sub_mask[:, :, -maskH:, :] = 1
        sub_mask[:, :, maskH, :maskW] = 1
        sub_mask = sub_mask * torch.flip(sub_mask, dims=[-1, -2])
        mask[:, :, startH:, startW:] = sub_mask
        return mask


class LearnablePatchErasing(nn.Module):  # models/maskers.py, its noise given
    def __init__(self, patch_size, img_size, noise_ratio=0.4):
        super().__init__()
        h = w = img_size // patch_size
        self.patch_size = patch_size
        self.alpha = nn.Parameter(torch.ones(h * w, dtype=torch.float64) * math.sqrt(noise_ratio))

    def forward(self, img, noise):
        h = w = img.shape[-1] // self.patch_size
        p = self.patch_size
        patches = [(i * p, j * p) for i in range(h) for j in range(w)]
        new_img = torch.empty_like(img)
        for k, (r, c) in enumerate(patches):
            v = noise[:, r : r + p, c : c + p]  # torch.empty([img_c, p, p]).normal_()
            new_img[..., r : r + p, c : c + p] = (1 - self.alpha[k] ** 2) * img[..., r : r + p, c : c + p] + self.alpha[
                k
            ] ** 2 * v
        new_img.clip_(-1, 1)
        return new_img


def softmax_entropy(x):
    return -(x.softmax(1) * x.log_softmax(1)).sum(1)


def update_model_probs(current_model_probs, new_probs):
    if current_model_probs is None:
        if new_probs.size(0) == 0:
            return None
        with torch.no_grad():
            return new_probs.mean(0)
    if new_probs.size(0) == 0:
        with torch.no_grad():
            return current_model_probs
    with torch.no_grad():
        return 0.9 * current_model_probs + (1 - 0.9) * new_probs.mean(0)


class AuthorsSPA:
    """tta_library/spa.py's SPA on main.py's BYOLWrapper, configure_model and two-group SGD."""

    def __init__(self, net, size, patch, lr, rate, noise, mask, base="none", fishers=None, margins=(0.4, 0.05)):
        dim = net.head.in_features if hasattr(net, "head") and isinstance(net.head, nn.Linear) else net.fc.in_features
        self.model = BYOLWrapper(net, dim)
        self.model.train()
        self.model.requires_grad_(False)
        self.model.predictor.requires_grad_(True)
        for m in self.model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.requires_grad_(True)
                m.track_running_stats = False
                m.running_mean = None
                m.running_var = None
            if isinstance(m, (nn.GroupNorm, nn.LayerNorm)):
                m.requires_grad_(True)
        params = [
            p
            for m in self.model.modules()
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm))
            for n, p in m.named_parameters()
            if n in ("weight", "bias")
        ]
        self.optimizer = torch.optim.SGD(
            [
                {"params": params, "lr": lr, "momentum": 0.9},
                {"params": self.model.predictor.parameters(), "lr": lr * rate, "momentum": 0.9},
            ]
        )
        self.model_state = copy.deepcopy(self.model.state_dict())
        self.optimizer_state = copy.deepcopy(self.optimizer.state_dict())
        self.prompts = Prompt(size)
        self.learnable_patch_erasing = LearnablePatchErasing(patch, size)
        self.noise_ratio = noise
        self.patch_optimizer = torch.optim.SGD([self.learnable_patch_erasing.alpha], 1, momentum=0.9)
        self.keep_prob = 1 - mask
        self.use_tent, self.use_eata = base == "tent", base in ("eta", "eata")
        self.fishers, self.fisher_alpha = fishers, 2000.0
        self.current_model_probs = None
        self.e_margin, self.d_margin = margins[0] * math.log(C), margins[1]

    def forward(self, x, draw, noise):
        outputs = self.model(x)
        loss = 0
        noise_x = self.prompts.masking(x, draw)
        loss += self.get_low_consist_loss(noise_x, outputs)
        noise_x = self.learnable_patch_erasing(x, noise)
        loss += self.get_low_consist_loss(noise_x, outputs)
        loss += self.get_auxiliary_loss(outputs)
        loss.backward()
        self.learnable_patch_erasing.alpha.grad = -self.learnable_patch_erasing.alpha.grad
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.patch_optimizer.step()
        self.patch_optimizer.zero_grad()
        self.fix_patch_alpha()
        return outputs.detach()

    def get_auxiliary_loss(self, outputs):
        loss = 0
        if self.use_tent:
            loss += 0.1 * softmax_entropy(outputs).mean()
        elif self.use_eata:
            loss += 0.1 * self.get_eta_loss(outputs)
        return loss

    def get_eta_loss(self, outputs):
        entropys = softmax_entropy(outputs)
        filter_ids_1 = torch.where(entropys < self.e_margin)
        ids1 = filter_ids_1
        ids2 = torch.where(ids1[0] > -0.1)
        entropys = entropys[filter_ids_1]
        if self.current_model_probs is not None:
            cosine_similarities = F.cosine_similarity(
                self.current_model_probs.unsqueeze(dim=0), outputs[filter_ids_1].softmax(1), dim=1
            )
            filter_ids_2 = torch.where(torch.abs(cosine_similarities) < self.d_margin)
            entropys = entropys[filter_ids_2]
            ids2 = filter_ids_2
            updated_probs = update_model_probs(self.current_model_probs, outputs[filter_ids_1][filter_ids_2].softmax(1))
        else:
            updated_probs = update_model_probs(self.current_model_probs, outputs[filter_ids_1].softmax(1))
        self.current_model_probs = updated_probs
        coeff = 1 / (torch.exp(entropys.clone().detach() - self.e_margin))
        entropys = entropys.mul(coeff)
        loss = 0
        if ids2[0].shape[0] > 0:
            loss += entropys.mean(0)
        if self.fishers is not None:
            ewc_loss = 0
            for name, param in self.model.named_parameters():
                if name in self.fishers:
                    ewc_loss += self.fisher_alpha * (self.fishers[name][0] * (param - self.fishers[name][1]) ** 2).sum()
            loss += ewc_loss
        return loss

    def get_low_consist_loss(self, x, outputs):
        low_outputs = self.model(x, use_predictor=True)
        conf, labels = outputs.softmax(dim=-1).max(dim=-1)
        low_conf, low_labels = low_outputs.softmax(dim=-1).max(dim=-1)
        conf_ids = torch.where(conf > low_conf)
        kl = nn.KLDivLoss(reduction="batchmean")
        return kl(low_outputs[conf_ids].log_softmax(dim=-1), outputs[conf_ids].softmax(dim=-1).clone().detach()).mean()

    @torch.no_grad()
    def fix_patch_alpha(self):
        current_mean = (self.learnable_patch_erasing.alpha**2).mean()
        div = current_mean / self.noise_ratio
        self.learnable_patch_erasing.alpha /= torch.sqrt(div)
        torch.clip_(self.learnable_patch_erasing.alpha, -1, 1)

    def reset(self):
        self.model.load_state_dict(self.model_state, strict=True)
        self.optimizer.load_state_dict(self.optimizer_state)
        self.current_model_probs = None
        alpha = self.learnable_patch_erasing.alpha
        alpha.data = torch.ones_like(alpha) * math.sqrt(self.noise_ratio)
        self.patch_optimizer = torch.optim.SGD([alpha], 1, momentum=0.9)


def authors_fisher(wrapper: BYOLWrapper, batches) -> dict:
    """main.py's get_fisher on eata.configure_model's copy: the squared gradients of the
    cross-entropy against the model's own predictions, averaged over the batches."""
    net = copy.deepcopy(wrapper)
    net.train()
    net.requires_grad_(False)
    for m in net.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)):
            m.requires_grad_(True)
    fishers = {}
    for iter_, images in enumerate(batches, start=1):
        outputs = net(images)
        _, targets = outputs.max(1)
        F.cross_entropy(outputs, targets).backward()
        for name, param in net.named_parameters():
            if param.grad is not None:
                fisher = param.grad.data.clone() ** 2 + (fishers[name][0] if iter_ > 1 else 0)
                if iter_ == len(batches):
                    fisher = fisher / iter_
                fishers[name] = [fisher, param.data.clone()]
                param.grad = None
    return fishers


# --- the two sides on the same batches and draws ---------------------------------------------


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    shape = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, num_classes=C)
    return timm.create_model("vit_tiny_patch16_224", **shape).eval().double()


class TinyResNet(nn.Module):
    """A CNN with a BatchNorm and a GroupNorm, and the attributes the authors' BYOLWrapper reads
    of a timm ResNet (forward_features, global_pool, fc)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.gn = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.GroupNorm(2, 8)
        self.global_pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, C)

    def forward_features(self, x):
        return self.gn(self.conv2(self.bn1(self.conv1(x)).relu())).relu()

    def forward(self, x):
        return self.fc(self.global_pool(self.forward_features(x)))


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    net = TinyResNet().double()
    with torch.no_grad():  # confident enough that ETA's entropy filter keeps some samples
        net.fc.weight.mul_(30)
    return net


def batches(count: int) -> list[torch.Tensor]:
    """Images of C colours with noise, around [−1, 1] (the authors' ViT range) and some beyond it,
    so that the noisy view's clip bites: the tiny nets' predictions differ from image to image."""
    g = torch.Generator().manual_seed(1)
    colours = torch.randn(C, 3, 1, 1, generator=g, dtype=torch.float64) * 0.7
    made = []
    for _ in range(count):
        noise = torch.randn(12, 3, 32, 32, generator=g, dtype=torch.float64)
        made.append((colours[torch.randint(0, C, (12,), generator=g)] + 0.3 * noise).clamp(-1.3, 1.3))
    return made


def recorded(monkeypatch) -> tuple[list, list]:
    """Our draws, kept in order as spa.py takes them."""
    masks, noises = [], []

    def keep(shape, probability, like):
        masks.append(spa_keep(shape, probability, like))
        return masks[-1]

    def noise(shape, like):
        noises.append(spa_noise(shape, like))
        return noises[-1]

    monkeypatch.setattr(spa, "keep_draws", keep)
    monkeypatch.setattr(spa, "noise_draws", noise)
    return masks, noises


spa_keep, spa_noise = spa.keep_draws, spa.noise_draws


def their_draw(square: torch.Tensor, size: int) -> torch.Tensor:
    """Our draw of the low square, as the full mask draw the authors' masking reads (ones
    elsewhere, where their low mask is 0), rolled over the batch and channel axes."""
    rows = max(int(size * spa.LOW_FREQUENCIES), 1)
    top = size - (size - rows) // 2 - rows
    full = torch.ones(*square.shape[:2], size, size, dtype=square.dtype)
    full[..., top : top + rows, top : top + rows] = square
    return torch.fft.fftshift(full, dim=(0, 1))


def compare(net, monkeypatch, *, base="none", noise=0.4, mask=0.2, patch=8, fisher_batches=None, margins=(0.4, 0.05)):
    """Both sides batch after batch, a reset after the fourth: logits, noise strengths, predictor
    and normalisation affines after every step."""
    lr, rate = 0.01, 5.0
    fishers = None
    if base == "eata":
        fishers = authors_fisher(BYOLWrapper(copy.deepcopy(net), 8), fisher_batches)
    theirs = AuthorsSPA(copy.deepcopy(net), 32, patch, lr, rate, noise, mask, base, fishers, margins)
    if noise != 0.4:  # their masker starts at √0.4 whatever the ratio, until the first reset (recipe's deviations)
        theirs.reset()
    options = dict(base=base, noise=noise, frequency_mask=mask, patch_size=patch, predictor_rate=rate)
    options.update(entropy_margin=margins[0], redundancy_margin=margins[1])
    method = create("spa", fisher_batches=fisher_batches, **options)
    adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), method, "cpu", optimizer="sgd", lr=lr, momentum=0.9)
    masks, noises = recorded(monkeypatch)
    kept = []
    for i, images in enumerate(batches(6)):
        if i == 4:
            adapter.reset()
            theirs.reset()
        logits = adapter.step(images)
        expected = theirs.forward(images, their_draw(masks[-1], 32), noises[-1])
        torch.testing.assert_close(logits, expected.float(), rtol=0, atol=1e-6, msg=f"batch {i}")
        alpha = theirs.learnable_patch_erasing.alpha.detach()
        torch.testing.assert_close(method.strengths, alpha, rtol=0, atol=1e-9, msg=f"batch {i}")
        torch.testing.assert_close(method.predictor.weight, theirs.model.predictor.weight, rtol=0, atol=1e-9)
        ours_norms = dict(adapter.model.model.named_parameters())
        for name, p in theirs.model.model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(ours_norms[name], p, rtol=0, atol=1e-9, msg=f"{name}, batch {i}")
        kept.append(None if theirs.current_model_probs is None else theirs.current_model_probs.clone())
    assert adapter.skipped_steps == 0
    return method, theirs, kept


def test_spa_follows_the_authors_update_on_a_tiny_vit(monkeypatch):
    """SPA alone on the authors' main model kind, a timm ViT (their BYOLWrapper's ViT branch):
    the noise strengths move, and a reset puts them and the predictor back."""
    method, theirs, _ = compare(tiny_vit(), monkeypatch)
    assert not torch.equal(method.strengths, torch.full_like(method.strengths, math.sqrt(0.4)))
    assert not torch.equal(method.predictor.weight, torch.eye(32, dtype=torch.float64))


@pytest.mark.parametrize("base", ["tent", "eta", "eata"])
def test_spa_beside_each_base_follows_the_authors_on_a_cnn(monkeypatch, base):
    """spa+tent, spa+eta, spa+eata on a CNN with a BatchNorm and a GroupNorm (their ResNet-50-GN
    branch), their ResNet setting's noise 0.1 and mask 0.1; ETA's filters keep some samples and
    leave out others, and its moving mean is cleared at the reset as theirs."""
    g = torch.Generator().manual_seed(5)
    source = [torch.randn(8, 3, 32, 32, generator=g, dtype=torch.float64) * 0.5 for _ in range(2)]
    margins = (0.4, 0.8)  # kept 10, 4, 3, 8 of 12 before the reset, by entropy and redundancy
    _, theirs, means = compare(
        tiny_cnn(), monkeypatch, base=base, noise=0.1, mask=0.1, fisher_batches=source, margins=margins
    )
    if base != "tent":
        assert means[3] is not None and means[4] is not None
        assert theirs.fishers is None or len(theirs.fishers) == 4  # bn1's and gn's weight and bias


def test_the_frequency_mask_is_symmetric_so_the_view_is_real():
    """For even and odd sides: the mask equals its point reflection about the zero frequency,
    so the masked spectrum stays Hermitian (an even side's Nyquist row and column, which have no
    mirror, are kept, as the low square never reaches them)."""
    for size in (28, 32, 33):
        images = torch.randn(3, 2, size, size, dtype=torch.float64)
        start = 1 - size % 2
        drawn = torch.bernoulli(torch.full_like(images, 0.5))
        drawn[..., :start, :] = drawn[..., :, :start] = 1
        mask = spa.point_symmetric(drawn)
        inner = mask[..., start:, start:]
        assert torch.equal(inner, inner.flip(-2, -1))
        spectrum = torch.fft.fft2(images) * torch.fft.ifftshift(mask, dim=(-2, -1))
        assert torch.fft.ifft2(spectrum).imag.abs().max() < 1e-12


def test_the_noise_grid_covers_a_side_the_patch_does_not_divide():
    """28 pixels in patches of 16: a 2 × 2 grid, the last row and column of patches 12 pixels wide."""
    images = torch.zeros(2, 1, 28, 28)
    mixed = spa.noisy(images, torch.tensor([0.0, 0.0, 0.0, 1.0]), 16)
    assert torch.equal(mixed[..., :16, :], images[..., :16, :]) and torch.equal(mixed[..., :, :16], images[..., :, :16])
    corner = mixed[..., 16:, 16:]
    assert corner.shape[-2:] == (12, 12) and (corner != 0).all() and corner.abs().max() <= 1
    assert torch.equal(mixed[0], mixed[1])  # one noise image for the batch, as the authors'


def test_the_recipes_are_the_authors_values():
    vit, cnn = shipped("spa", "imagenet-c"), shipped("spa", "cifar10-c")
    assert vit.settings == {
        "optimizer": "sgd",
        "lr": 0.01,
        "momentum": 0.9,
        "batch_size": 64,
        "params": "norm",
        "fisher_samples": 2000,
    }
    assert (vit.options["noise"], vit.options["frequency_mask"], vit.options["predictor_rate"]) == (0.4, 0.2, 5.0)
    assert cnn.settings["lr"] == 0.0025
    assert (cnn.options["noise"], cnn.options["frequency_mask"], cnn.options["predictor_rate"]) == (0.1, 0.1, 10.0)
    assert shipped("spa", "cifar100-c").options == cnn.options and "mr-eggplant/SPA" in vit.source


# --- through the command line ---------------------------------------------------------------


@pytest.mark.parametrize(
    "stream",
    [
        [],
        ["--order", "label-shift:1.0", "--reset", "never"],
        ["--order", "dirichlet:0.1", "--reset", "episodic"],
        ["--reset", "every:2", "--method-option", "base=eta"],
    ],
)
def test_spa_adapts_the_bundled_cnn_from_the_command_line(tmp_path, stream):
    garments = write_folder(tmp_path / "garments", per_class=2, classes=("trouser", "bag", "coat"), size=28)
    result = invoke(
        "adapt", "--model", "fmnist-resnet", "--data", garments, "--method", "spa", "--batch-size", "3", *stream
    )
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 6
    assert "--source-data" not in result.stderr  # only base eata takes source images


def test_spa_eata_adapts_a_timm_vit_with_source_images_and_says_so_without(vit_run):
    model, data = vit_run["model"], vit_run["data"]
    common = ["adapt", *model, "--data", data, "--method", "spa", "--batch-size", "3", "--method-option", "base=eata"]
    result = invoke(*common, "--source-data", vit_run["source"], "--fisher-samples", "6")
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 9 and "--source-data" not in result.stderr
    without = invoke(*common)
    assert without.exit_code == 0 and "runs base eata as eta" in without.stderr
