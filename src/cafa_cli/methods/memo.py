"""MEMO: test-time robustness via adaptation and augmentation (Zhang, Levine & Finn,
"MEMO: Test Time Robustness via Adaptation and Augmentation", NeurIPS 2022).

Update rule, for each test image x on its own (episodic): from the source weights θ0,
with a fresh optimiser state, `steps` optimiser steps (the Adapter's) on the entropy of
the marginal prediction over B AugMix views a_1(x) … a_B(x) (methods/shared/augmix.py), drawn
anew for each step as the authors' loop draws them:

    p̄_θ(x) = (1/B) Σ_b softmax f_θ(a_b(x)),     L_MEMO(θ) = −Σ_c p̄_c log p̄_c,

log p̄ computed in log space (logsumexp over the views of log softmax, − log B) and
clamped to float's lowest value, as the authors'. The prediction reported for x is the
adapted model's on x itself, made after its update, as in the authors' code
(zhangmarvin/memo, test_calls/test_adapt.py: adapt_single, then test_single); the next
image starts again from θ0. `params` all trains every parameter, the classifier too (the
authors' optimiser takes net.parameters()); norm only the normalisation affines.

It resets the model itself (owns_update): before each image, the trained parameters,
the buffers and the optimiser's state go back to the source's, so a batch of N images
is N episodes, one after the other (N·steps backward passes of B views, and N forward
passes of one image), and the Adapter's `reset` changes nothing. The model keeps the
last image's update until the next batch. A batch's first update() call runs them all:
with the Adapter's `steps` above 1 its later calls return the same prediction.

Normalisation: the authors' CIFAR-10 network (ResNet-26) has GroupNorms; their ImageNet
ResNet-50 normalises, in both passes, with Schneider et al.'s prior, the source
statistics weighted N/(N + 1), N = 16, against the batch's, the B views counting as one
sample. Here BatchNorms normalise with the Adapter's `norm`: under prior:N the B views
count as one sample (views_as_one_sample), so prior:16 is the authors' setting; the
benchmark collection (mariodoebler/test-time-adaptation, methods/memo.py) uses α-BN
(alpha:0.1). Under both the batch's statistics carry no gradient, as theirs (norms.py).

Options and their defaults, the authors' CIFAR-10 ones: B = 32 (`copies`; 64 on
ImageNet), `crop` padded (RandomCrop(32, padding=4); resized, RandomResizedCrop, on
ImageNet). recipes/memo.toml holds each family's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from cafa_cli.engine.method import AdapterSurface, Method, with_classifier
from cafa_cli.engine.norms import BatchStatisticsNorm
from cafa_cli.engine.optimiser import restart_state
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.augmix import CROPS, augmix
from cafa_cli.methods.shared.losses import marginal_entropy
from cafa_cli.model.features import FeatureClassifier

COPIES = 32


@contextmanager
def views_as_one_sample(model: nn.Module, copies: int):
    """Under `norm` prior:N, a batch of `copies` views of one image mixes with the source
    statistics as one sample would, N/(N + 1) against the views' (norms.py weighs a batch
    of n as n samples)."""
    layers = [m for m in model.modules() if isinstance(m, BatchStatisticsNorm) and m.kind == "prior"]
    priors = [layer.prior for layer in layers]
    for layer in layers:
        layer.prior = layer.prior * copies
    try:
        yield
    finally:
        for layer, prior in zip(layers, priors):
            layer.prior = prior


class Memo(Method):
    name = "memo"
    draws_random_numbers = True  # from torch's generator (base.py)
    owns_update = True  # an episode per image, each from the source weights
    running_norms = "it is episodic: no statistics pass from one image to the next"
    not_served = "each image is predicted after an update of its own, from the source weights"
    generator: torch.Generator | None = None  # the views' random numbers; None: the device's default
    unsaved = (*Method.unsaved, "generator")
    per_batch = (*Method.per_batch, "adapted")
    options = (
        Option(
            "copies", COPIES, "B, the augmented views of each image its marginal entropy averages", "count", most=1024
        ),
        Option("crop", "padded", "the views' crop: padded (CIFAR's) or resized (ImageNet's)", "choice", CROPS),
    )

    def setup(self) -> None:
        self.adapted: tuple | None = None  # this batch's (logits, features, flag), from its first update()

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """`norm`: the normalisation affines; `all`: every parameter, the classifier too (the authors')."""
        return with_classifier(model, which, every=True)

    def before_step(self, images: torch.Tensor) -> None:
        self.adapted = None

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if self.adapted is None:  # the batch's later steps: its episodes have run them
            self.adapted = self.episodes(adapter, images)
        return self.adapted

    def episodes(self, adapter: AdapterSurface, images: torch.Tensor):
        logits, features, flags = [], [], []
        for i in range(len(images)):
            image = images[i : i + 1]
            self.restore(adapter)
            flag = None
            for _ in range(adapter.steps):
                views = augmix(image, self.copies, self.generator, self.crop)
                with views_as_one_sample(adapter.model, self.copies), adapter.autocast:
                    out, _ = adapter.forward(views)
                flag = adapter.apply(marginal_entropy(out.float()), flag)
            with torch.no_grad(), adapter.autocast:
                out, feature = adapter.forward(image)
            logits.append(out.float())
            features.append(feature.float())
            flags.append(flag)
        return torch.cat(logits), torch.cat(features), torch.stack(flags).amax(0)

    def restore(self, adapter: AdapterSurface) -> None:
        """The trained parameters, the buffers and the optimiser's state back to the source's."""
        trained = {id(p) for p in self.params}
        state = adapter.model.state_dict(keep_vars=True)
        names = [k for k, t in state.items() if id(t) in trained or not isinstance(t, nn.Parameter)]
        with torch.no_grad():
            torch._foreach_copy_([state[k] for k in names], [adapter.source_state[k] for k in names])
        restart_state(adapter.optimizer)
