"""AdaContrast: contrastive test-time adaptation (Chen, Wang, Darrell and Ebrahimi,
"Contrastive Test-Time Adaptation", CVPR 2022; the authors' code DianCh/AdaContrast, run
online on the test stream as the benchmark collection mariodoebler/test-time-adaptation,
classification/methods/adacontrast.py, does).

Update rule: a student θ (trained; under the recipes every parameter a module holds as
`weight` or `bias`, the classifier's too, as the collection's collect_params) and a
momentum key encoder θ' (a copy of the model, no gradient), both normalising with the
statistics of the batch they see. The memory holds a queue of K keys k̂_j (unit
vectors, drawn at random to start: ε_j/‖ε_j‖, ε_j ~ N(0, I)) with pseudo-labels ŷ_j (drawn
uniformly to start), and a bank of up to about K pairs (feature, probabilities) of the
key encoder on the weak views. For each batch x of N images, with a weak view x_w (a
random horizontal flip) and two strong views x_q, x_k (colour jitter, greyscale, blur,
flip: `strong_view`):

1. pseudo-labels (no gradient): z_w, f_w = f_θ(x_w); while fewer than R images
   (`refine_after`) have been seen, y_n = argmax z_w,n; after that, soft voting among the
   kn = `num_neighbors` nearest bank features by cosine distance 1 − cos(f_w,n, f_b):
       p̄_n = (1/kn) Σ_{b ∈ NN(n)} p_b,   y_n = argmax_c p̄_nc;
2. the key encoder follows the student (before the step): θ' ← m θ' + (1 − m) θ; then
   z_q, f_q = f_θ(x_q), q_n = f_q,n/‖f_q,n‖ and k_n = f_θ'(x_k)_n/‖·‖ (features);
3. instance logits against the queue as it was: l_n = [q_n·k_n, q_n·k̂_1, ..., q_n·k̂_K]/τ;
   then the queue takes (k_n, y_n) at its pointer (first in, first out), and the entries
   whose (new) label equals y_n are left out of sample n's negatives (class-aware):
       L_ins = (1/N) Σ_n −log softmax(l_n)_0   over the kept entries;
4. L_cls = (1/N) Σ_n −log softmax(z_q,n)_{y_n};   L_div = Σ_c p̂_c log(p̂_c + 1e-8),
   p̂ = (1/N) Σ_n softmax(z_q,n) (the negative entropy of the mean prediction);
5. one optimiser step on L = α L_cls + β L_ins + η L_div, with weight decay λ (its term
   λθ added to the gradient, as torch's SGD does: the Adapter's optimiser has none);
6. the bank takes the key encoder's features and probabilities on x_w (no gradient):
   appended while it holds fewer than K, then overwritten first in, first out.

The prediction reported is the model's on the test images after the step, as the
collection's forward() returns it: in eval mode (`prediction` running), its BatchNorms
normalising with running statistics, from the source's, that the student's two training
passes of each batch (x_w, x_q) moved toward their batch statistics as a torch BatchNorm in
train mode does (momentum the layer's own, 0.1; unbiased variance); the authors' code
(DianCh/AdaContrast target.py, eval_and_label_dataset) predicts in eval mode too.
`prediction` batch normalises it with the test batch's own statistics (or the Adapter's
`norm`) instead, as cafa did until issue 60.

Options and their defaults, the collection's conf.py (ADACONTRAST, M_TEACHER), with τ
= 0.07 from its adacontrast.yaml files: K = 16,384 (`queue_size`), m = 0.999
(`teacher_momentum`), τ (`temperature`), α = β = η = 1 (`alpha`, `beta`, `eta`), kn = 10,
R = 1,024 (hard-coded there), cosine distance, class-aware contrast, supervision of the
strong view by the weak view's label (CE_SUP_TYPE weak_strong), λ = 1e-4 (OPTIM.WD). The
recipes hold the optimiser (SGD, Nesterov momentum 0.9, lr 2e-4) and batch size.

Deviations from the collection's code:
- no projection head, as neither the authors' AdaMoCo nor the collection has one: the
  contrast and the bank use the features entering the classifier (the authors' DomainNet
  source models end in a trained 256-d bottleneck, which is their feature; cafa's source
  models have no such layer, and no projector trained on the source exists to load);
- the views are drawn per image on normalised values (module functions `weak_view` and
  `strong_view`, from `generator`): colour jitter (p 0.8: brightness as a shift of
  ±0.4 of each channel's spread, contrast 0.6–1.4 about each channel's mean, saturation
  0.6–1.4 about the mean over channels; in that order, theirs random; hue left out: it
  needs pixel values), greyscale (p 0.2, the mean over channels), Gaussian blur (p 0.5,
  σ 0.1–2 pixels, replicate padding) and a horizontal flip (p 0.5); their weak view's
  resize and crop are to the image's own size, so it is the flip alone;
- queue and bank in float32 (theirs float16 under mixed precision).

Cost: the student forward and backward on x_w and x_q, the key encoder forward on x_k and
x_w, and one forward pass for the reported prediction (`prediction` running: and the
statistics of every BatchNorm's input computed once more in the two training passes). Not replayable as a CUDA graph: it
draws random numbers and its bank grows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cafa_cli.engine.method import AdapterSurface, Method, with_classifier
from cafa_cli.engine.norms import (
    BatchStatisticsNorm,
    moving_eval_statistics,
    norm_layers,
    predicting_in_eval_mode,
)
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.teacher_student import follow, frozen_copy, named, names_of
from cafa_cli.model.features import FeatureClassifier

QUEUE_SIZE = 16_384  # K
TEACHER_MOMENTUM = 0.999  # m
TEMPERATURE = 0.07  # τ, the adacontrast.yaml files' CONTRAST.TEMPERATURE (conf.py: 0.1)
NUM_NEIGHBORS = 10
REFINE_AFTER = 1024  # images seen before the pseudo-labels are refined (hard-coded by the collection)
WEIGHT_DECAY = 1e-4
DISTANCES = ("cosine", "euclidean")
CONTRASTS = ("class_aware", "all")
PREDICTIONS = ("running", "batch")

JITTER = 0.8  # p of the colour jitter, then its ranges (ColorJitter(0.4, 0.4, 0.4, 0.1), hue left out)
BRIGHTNESS = (-0.4, 0.4)  # a shift, in units of each channel's spread
CONTRAST = (0.6, 1.4)
SATURATION = (0.6, 1.4)
GREY = 0.2
BLUR, BLUR_SIGMA = 0.5, (0.1, 2.0)
FLIP = 0.5


def _rand(n: int, images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """n uniform numbers on the images' device, from `generator` where set (on its device)."""
    if generator is None:
        return torch.rand(n, device=images.device)
    return torch.rand(n, generator=generator, device=generator.device).to(images.device)


def _uniform(n, bounds, images, generator) -> torch.Tensor:
    low, high = bounds
    return _rand(n, images, generator) * (high - low) + low


def _per_image(values: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    return values.view(-1, *(1,) * (images.dim() - 1))


def _flip(images: torch.Tensor, generator) -> torch.Tensor:
    if images.dim() != 4:
        return images
    flip = _per_image(_rand(len(images), images, generator) < FLIP, images)
    return torch.where(flip, images.flip(-1), images)


def weak_view(images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The weak view of each image ([N, C, H, W], normalised): a horizontal flip, p 0.5."""
    return _flip(images.float(), generator).to(images.dtype)


def strong_view(images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A strong view of each image (the collection's moco-v2-light on normalised values;
    module docstring): jitter, greyscale, blur, flip, each drawn per image."""
    x, n = images.float(), len(images)
    image, colour = x.dim() == 4, x.dim() == 4 and x.shape[1] == 3
    dims = tuple(range(2, x.dim())) or (1,)
    jitter = _per_image(_rand(n, x, generator) < JITTER, x)
    brightness = _per_image(_uniform(n, BRIGHTNESS, x, generator), x)
    contrast = _per_image(_uniform(n, CONTRAST, x, generator), x)
    saturation = _per_image(_uniform(n, SATURATION, x, generator), x)
    spread, mean = torch.std_mean(x, dim=dims, correction=0, keepdim=True)
    # brightness shifts the image and its mean alike; contrast then scales about that mean
    y = mean + brightness * spread + contrast * (x - mean)
    if colour:
        grey = y.mean(1, keepdim=True)
        y = grey + saturation * (y - grey)
    x = torch.where(jitter, y, x)
    grey = _per_image(_rand(n, x, generator) < GREY, x)
    if colour:
        x = torch.where(grey, x.mean(1, keepdim=True).expand_as(x), x)
    blur = _per_image(_rand(n, x, generator) < BLUR, x)
    sigma = _uniform(n, BLUR_SIGMA, x, generator)
    if image:
        x = torch.where(blur, _blur(x, sigma), x)
    return _flip(x, generator).to(images.dtype)


def _blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Each image blurred by a Gaussian of its own σ (pixels), separably, edges replicated."""
    n, c, h, w = x.shape
    radius = math.ceil(3 * BLUR_SIGMA[1])
    offsets = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma.unsqueeze(1)) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # [N·C, 2r + 1]
    flat = x.reshape(1, n * c, h, w)
    flat = F.conv2d(F.pad(flat, (radius, radius, 0, 0), mode="replicate"), kernel[:, None, None, :], groups=n * c)
    flat = F.conv2d(F.pad(flat, (0, 0, radius, radius), mode="replicate"), kernel[:, None, :, None], groups=n * c)
    return flat.view(n, c, h, w)


class AdaContrast(Method):
    name = "adacontrast"
    draws_random_numbers = True  # from torch's generator (base.py)
    running_norms = "its key encoder is a copy of the model, BatchNorms included"
    owns_update = True
    options = (
        Option(
            "queue_size",
            QUEUE_SIZE,
            "K, the keys in the contrastive queue and the features in the bank",
            "count",
            most=262_144,
        ),
        Option(
            "teacher_momentum", TEACHER_MOMENTUM, "m: the key encoder's moving average θ' ← mθ' + (1 − m)θ", "fraction"
        ),
        Option("temperature", TEMPERATURE, "τ, the contrastive loss's temperature", "positive"),
        Option("alpha", 1.0, "α, the weight of the cross-entropy to the refined pseudo-labels", "weight"),
        Option("beta", 1.0, "β, the weight of the contrastive (InfoNCE) loss", "weight"),
        Option("eta", 1.0, "η, the weight of the diversity term", "weight"),
        Option(
            "num_neighbors", NUM_NEIGHBORS, "the bank's nearest features whose probabilities vote", "count", most=1024
        ),
        Option("refine_after", REFINE_AFTER, "images seen before the pseudo-labels are refined", "count0"),
        Option("distance", "cosine", "the bank's distance", "choice", DISTANCES),
        Option(
            "contrast", "class_aware", "class_aware leaves same-label keys out of the negatives", "choice", CONTRASTS
        ),
        Option("weight_decay", WEIGHT_DECAY, "λ, the L2 term λθ added to the gradient", "weight"),
        Option(
            "prediction",
            "running",
            "running: predict in eval mode, BatchNorms on the running statistics its training passes "
            "moved (the collection's and the authors'); batch: on the test batch's own",
            "choice",
            PREDICTIONS,
        ),
    )
    generator: torch.Generator | None = None  # the views' and the queue's draws; None: torch's own
    # the model the Adapter saves itself, what is made from it, and the views' random source
    unsaved = (*Method.unsaved, "student", "layers", "generator")

    def setup(self) -> None:
        self.names: list[str] = []  # the student's trained parameters, found by name in the key encoder
        self.student: FeatureClassifier | None = None
        self.layers: list[BatchStatisticsNorm] = []  # the student's BatchNorms, for `prediction` running
        self.teacher: FeatureClassifier | None = None  # the momentum key encoder
        self.keys: torch.Tensor | None = None  # the queue [K, d], unit rows
        self.key_labels: torch.Tensor | None = None  # [K]
        self.key_at = 0
        self.bank_features = torch.zeros(0)
        self.bank_probabilities = torch.zeros(0)
        self.bank_at = 0
        self.seen = 0  # images whose pseudo-labels were taken unrefined (counted up to refine_after)

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """`all`: every weight and bias, the classifier's too (the collection's configure_model
        and collect_params); `norm`: the normalisation affines."""
        return with_classifier(model, which)

    def attach(self, model: FeatureClassifier) -> None:
        """The key encoder, a copy of the model, and the memory."""
        self.names = names_of(model, self.params)
        if self.prediction == "running":  # before the Adapter records the source state, which resets them
            self.layers = norm_layers(model)
            for layer in self.layers:
                layer.keep_eval_statistics()
        self.student, self.teacher = model, frozen_copy(model)
        self.new_memory()

    def new_memory(self) -> None:
        """The queue drawn at random (as AdaMoCo's buffers), the bank empty, nothing seen."""
        d, c, k = self.student.feature_dim, self.student.num_classes, self.queue_size
        g, device = self.generator, self.params[0].device  # the model's: the Adapter's
        where = {"generator": g, "device": g.device} if g is not None else {"device": device}
        self.keys = F.normalize(torch.randn(k, d, **where).to(device), dim=1)
        self.key_labels = torch.randint(0, c, (k,), **where).to(device)
        self.key_at = 0
        self.bank_features = torch.zeros(0, d, device=device)
        self.bank_probabilities = torch.zeros(0, c, device=device)
        self.bank_at = 0
        self.seen = 0

    def reset(self) -> None:
        """The key encoder back to the model (at the source weights), a new queue, no bank."""
        if self.teacher is None:
            return
        self.teacher.load_state_dict(self.student.state_dict())
        self.new_memory()

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        weak, query, key = (
            weak_view(images, self.generator),
            strong_view(images, self.generator),
            strong_view(images, self.generator),
        )
        with moving_eval_statistics(self.layers), adapter.autocast:  # the collection's train-mode passes
            logits_w, features_w = adapter.forward(weak)
        labels = self.pseudo_labels(features_w.detach().float(), logits_w.detach().float())
        with moving_eval_statistics(self.layers), adapter.autocast:
            logits_q, features_q = adapter.forward(query)
        follow(named(self.teacher, self.names), self.params, self.teacher_momentum)  # before the step, as theirs
        with torch.no_grad(), adapter.autocast:
            keys = F.normalize(self.teacher(key)[1].float(), dim=1)
        logits_q, q = logits_q.float(), F.normalize(features_q.float(), dim=1)
        instance = torch.cat([(q * keys).sum(1, keepdim=True), q @ self.keys.clone().T], 1) / self.temperature
        self.enqueue(keys, labels)
        if self.contrast == "class_aware":  # the same-label entries of the queue as it is now: no negatives
            same = torch.cat(
                [torch.zeros_like(labels[:, None], dtype=torch.bool), labels[:, None] == self.key_labels], 1
            )
            instance = instance.masked_fill(same, -torch.inf)
        loss_ins = F.cross_entropy(instance, torch.zeros_like(labels))
        loss_cls = F.cross_entropy(logits_q, labels)
        mean = logits_q.softmax(1).mean(0)
        loss_div = (mean * torch.log(mean + 1e-8)).sum()
        loss = self.alpha * loss_cls + self.beta * loss_ins + self.eta * loss_div
        flag = adapter.apply(loss, skipped, after_backward=self.decay)
        with torch.no_grad(), adapter.autocast:
            logits_t, features_t = self.teacher(weak)
            self.remember(features_t.float(), logits_t.float().softmax(1))
        with torch.no_grad(), adapter.autocast:
            logits, features = self.reporting_network(adapter)(images)  # the prediction after the step
        return logits.float(), features.float(), flag

    def reporting_network(self, adapter: AdapterSurface) -> nn.Module:
        """The model, in eval mode under `prediction` running (the collection's forward())."""
        if self.prediction == "batch":
            return adapter.forward
        return EvalMode(adapter.forward, self.layers)

    def pseudo_labels(self, features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The weak view's predicted classes until `refine_after` images are seen; then the
        soft vote of their nearest bank entries."""
        if self.seen < self.refine_after:
            self.seen += len(features)
            return logits.argmax(1)
        if len(self.bank_features) == 0:  # refine_after 0: nothing to vote yet
            return logits.argmax(1)
        if self.distance == "cosine":
            distances = 1 - F.normalize(features, dim=1) @ F.normalize(self.bank_features, dim=1).T
        else:
            distances = torch.cdist(features, self.bank_features)
        nearest = distances.topk(min(self.num_neighbors, distances.shape[1]), dim=1, largest=False).indices
        return self.bank_probabilities[nearest].mean(1).argmax(1)

    def enqueue(self, keys: torch.Tensor, labels: torch.Tensor) -> None:
        """The batch's keys and pseudo-labels into the queue at its pointer, wrapping round."""
        end = self.key_at + len(keys)
        at = torch.arange(self.key_at, end, device=keys.device) % self.queue_size
        self.keys[at] = keys.detach()
        self.key_labels[at] = labels
        self.key_at = end % self.queue_size

    def remember(self, features: torch.Tensor, probabilities: torch.Tensor) -> None:
        """The bank's update as the collection's update_labels: appended while it holds fewer
        than K (so it may end a batch above K), then overwritten from the pointer on, modulo
        its length."""
        end = self.bank_at + len(features)
        if len(self.bank_features) < self.queue_size:
            self.bank_features = torch.cat([self.bank_features, features])
            self.bank_probabilities = torch.cat([self.bank_probabilities, probabilities])
        else:
            at = torch.arange(self.bank_at, end, device=features.device) % len(self.bank_features)
            self.bank_features[at] = features
            self.bank_probabilities[at] = probabilities
        self.bank_at = end % len(self.bank_features)

    def decay(self) -> None:
        """Weight decay λθ added to the gradients (torch's SGD weight_decay, which the
        Adapter's optimiser does not take)."""
        if self.weight_decay == 0:
            return
        with torch.no_grad():
            pairs = [(p.grad, p) for p in self.params if p.grad is not None]
            if pairs:
                grads, params = zip(*pairs)
                torch._foreach_add_(list(grads), list(params), alpha=self.weight_decay)


class EvalMode(nn.Module):
    """The model with the BatchNorms `layers` on their eval statistics (norms.predicting_in_eval_mode);
    its state is the model's (Adapter.features saves and restores it)."""

    def __init__(self, model: nn.Module, layers: list[BatchStatisticsNorm]):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with predicting_in_eval_mode(self.layers):
            return self.model(images)
