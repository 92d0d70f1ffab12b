"""BN: test-time normalisation (Schneider et al., NeurIPS 2020; Nado et al., 2020).

Update rule: none by gradient. Every BatchNorm normalises with the statistics of the
current test batch instead of the training set's running statistics (the Adapter's
`norm`, default batch; prior:N mixes them with the source's as N samples,
μ = (N·μ_s + n·μ_t)/(N + n), likewise the variance; norms.py has the others). No
parameter is trained.
CIFAR10-C severity 5, ResNet-50: 15.59% error in the CAFA paper (Source: 29.14%).
"""

from __future__ import annotations

from cafa_cli.engine.method import Method


class BatchNormOnly(Method):
    name = "bn"
    capturable = True  # a CUDA graph may replay its step (base.py)
    trains = False
