"""A tiny CNN with BatchNorm (also inside a downsample branch) for the tests."""

from torch import nn


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=2, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return (self.bn(self.conv(x)) + self.downsample(x)).relu()


class TinyNet(nn.Module):
    def __init__(self, num_classes=3, channels=1, width=8, feature_dim=6):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.block = Block(width, 2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width, feature_dim), nn.ReLU(), nn.Linear(feature_dim, num_classes)
        )

    def forward(self, x):
        return self.head(self.pool(self.block(self.stem(x))))


def build(num_classes=3):
    return TinyNet(num_classes=num_classes)


def build_rgb(num_classes=3):
    return TinyNet(num_classes=num_classes, channels=3)


def not_a_module():
    return 42
