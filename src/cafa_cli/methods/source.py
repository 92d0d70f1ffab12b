"""Source: no adaptation — the model as trained, the baseline every table starts from.

Update rule: none. Its BatchNorms keep the running statistics of the training set and no
parameter changes, so the predictions are those of the source model (CIFAR10-C severity 5,
ResNet-50: 29.14% error in the CAFA paper).
"""

from __future__ import annotations

from cafa_cli.engine.method import Method


class Source(Method):
    name = "source"
    capturable = True  # a CUDA graph may replay its step (base.py)
    adapts_normalisation = False
    trains = False
