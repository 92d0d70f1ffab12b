"""TTAug: test-time augmentation, the baseline that adapts nothing (as the benchmark
collection runs it: mariodoebler/test-time-adaptation, classification/methods/ttaug.py).

Prediction: each image x is seen with B AugMix views a_1(x) … a_B(x) (methods/shared/augmix.py:
a random crop and flip, three chains of AugMix operations, mixed), and the prediction is
the mean over the B + 1 images (x itself included, as the collection's) of the logits,
`average` logits (the collection's):

    ŷ(x) = (1/(B+1)) [f(x) + Σ_b f(a_b(x))],

or of the probabilities, `average` probabilities (returned as their logarithm, which
softmax and argmax read as logits):

    ŷ(x) = log (1/(B+1)) [softmax f(x) + Σ_b softmax f(a_b(x))].

Nothing is trained: the weights stay the source's. The images and their views go through
the network in one forward pass, so BatchNorms normalise (under the Adapter's `norm`)
with the statistics of every view of the batch together: at batch size 1, as the
collection runs it, those of the image and its own views. The features reported are the
images' own (x's, from that pass).

Options and their defaults, the collection's: B = 32 (`copies`, its TEST.N_AUGMENTATIONS),
`average` logits, `crop` padded (its RandomCrop(32, padding=4) for 32-pixel images;
resized, its RandomResizedCrop, for ImageNet). The collection normalises with α-BN
(0.9 source, 0.1 test statistics): `--norm alpha:0.1`.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.augmix import CROPS, augmix

COPIES = 32
AVERAGES = ("logits", "probabilities")


class TTAug(Method):
    name = "ttaug"
    draws_random_numbers = True  # from torch's generator (base.py)
    trains = False
    owns_update = True  # its forward pass is of the images and their views (base.py: no apply)
    not_served = "the mean over each image's augmented views"
    generator: torch.Generator | None = None  # the views' random numbers; None: the device's default
    unsaved = (*Method.unsaved, "generator")
    options = (
        Option("copies", COPIES, "B, the augmented views of each image averaged with it", "count", most=1024),
        Option("average", "logits", "what is averaged: logits (the collection's) or probabilities", "choice", AVERAGES),
        Option("crop", "padded", "the views' crop: padded (CIFAR's) or resized (ImageNet's)", "choice", CROPS),
    )

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        n, b = len(images), self.copies
        views = augmix(images, b, self.generator, self.crop)
        with torch.no_grad(), adapter.autocast:
            logits, features = adapter.forward(torch.cat([images, views]))
        logits = logits.float()
        plain, augmented = logits[:n], logits[n:].view(n, b, -1)
        if self.average == "logits":
            prediction = (plain + augmented.sum(1)) / (b + 1)
        else:
            prediction = ((plain.softmax(1) + augmented.softmax(2).sum(1)) / (b + 1)).log()
        return prediction, features[:n].float(), skipped
