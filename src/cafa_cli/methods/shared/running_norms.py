"""The BatchNorms in train mode for a forward pass, as the authors' `model.train()` of SoTTA's
steps on its memory and OWTTT's alignment pass: they normalise with the batch and move their
running statistics, which the model otherwise predicts with."""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


@contextmanager
def training_norms(model: nn.Module, momentum: float | None = None, on: bool = True):
    """The model's BatchNorms in train mode with `momentum` (None: each keeps its own), nothing
    else: dropout stays off."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)] if on else []
    before = [(m.training, m.momentum) for m in layers]
    for m in layers:
        m.train()
        if momentum is not None:
            m.momentum = momentum
    try:
        yield
    finally:
        for m, (training, old) in zip(layers, before):
            m.train(training)
            m.momentum = old
