"""The least a TENT run can cost: PIL decode, normalise, forward, entropy, Adam, print — the
bundled fmnist-resnet over image folders, nothing checked, recorded or reported. The yardstick
of `cafa adapt --method tent` as a whole process (docs/performance/host.md):

    PYTHONPATH=src python benchmarks/bare_loop.py D1 D2 ... > bare.csv
    cafa adapt --model fmnist-resnet --method tent --data D1 --data D2 ... > cafa.csv

It runs what that command runs with its cifar10-c recipe (batch 200, Adam 1e-3 on the
BatchNorm affines, batch statistics, each domain from the source weights in the order
np.random.default_rng(0).permutation gives), so both print the same predictions: compare
the first two columns of their CSVs."""

import os
import sys

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

import cafa_cli.model.zoo.fmnist_resnet as architecture

MEAN, STD, BATCH = 0.2860, 0.3530, 200  # Fashion-MNIST's pixel mean and std; the recipe's batch
NAMES = "tshirt_top trouser pullover dress coat sandal shirt sneaker bag ankle_boot".split()  # the outputs' classes

source = load_file(os.path.join(os.path.dirname(architecture.__file__), "fmnist_resnet.safetensors"))
model = architecture.FmnistResNet().train().requires_grad_(False)  # TENT: every BatchNorm on the batch's statistics
norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
for m in norms:
    m.track_running_stats, m.running_mean, m.running_var = False, None, None
affines = [p for m in norms for p in (m.weight, m.bias)]
for p in affines:
    p.requires_grad_(True)

print("path,prediction")
for domain in sys.argv[1:]:
    classes = sorted(d for d in os.listdir(domain) if os.path.isdir(os.path.join(domain, d)))
    paths = [os.path.join(domain, c, f) for c in classes for f in sorted(os.listdir(os.path.join(domain, c)))]
    paths = [paths[i] for i in np.random.default_rng(0).permutation(len(paths))]
    model.load_state_dict(source, strict=False)  # each domain from the source weights (--reset domain)
    optimizer = torch.optim.Adam(affines, lr=1e-3)
    for start in range(0, len(paths), BATCH):
        batch = paths[start : start + BATCH]
        pixels = np.stack([np.asarray(Image.open(p).convert("L")) for p in batch])
        images = (torch.from_numpy(pixels).float().div_(255).sub_(MEAN).div_(STD)).unsqueeze(1)
        logits = model(images)
        log_p = logits.log_softmax(1)
        loss = -(log_p.exp() * log_p).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for path, k in zip(batch, logits.argmax(1).tolist()):
            print(f"{path},{NAMES[k]}")
