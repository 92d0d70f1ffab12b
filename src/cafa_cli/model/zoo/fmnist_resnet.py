"""A small ResNet for 1x28x28 Fashion-MNIST images, sized to train on two CPU cores.

Layout (spatial size in brackets):
    stem    conv3x3 1->16 + BN + ReLU              [28x28]
    layer1  residual block 16->32, stride 2        [14x14]
    layer2  residual block 32->64, stride 2        [7x7]
    pool    global average pool -> 64 features
    fc      Linear 64 -> 10

The 64 pooled features are what CAFA aligns: a 64-dim space keeps the per-class
covariance estimates stable with a few thousand source images, and BatchNorm
everywhere leaves the normalisation statistics for test-time adaptation to update.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

STEM_WIDTH = 16
STAGE_WIDTHS = (32, 64)
NUM_CLASSES = 10
FEATURE_DIM = STAGE_WIDTHS[-1]


class ResidualBlock(nn.Module):
    """Two 3x3 conv+BN layers with a shortcut; a 1x1 conv+BN shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class FmnistResNet(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(1, STEM_WIDTH, 3, 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(STEM_WIDTH)
        self.layer1 = ResidualBlock(STEM_WIDTH, STAGE_WIDTHS[0], stride=2)
        self.layer2 = ResidualBlock(STAGE_WIDTHS[0], STAGE_WIDTHS[1], stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(FEATURE_DIM, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled [N, 64] vector that `fc` classifies."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer2(self.layer1(out))
        return torch.flatten(self.pool(out), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))
