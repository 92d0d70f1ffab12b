"""A small timm VisionTransformer for 1x28x28 Fashion-MNIST images, the bundled model the
prompt-token methods (FOA, DPCore: model/prompts.py) run on; the CNN has no tokens to prompt.

    patch_embed  conv 7x7, stride 7, 1 -> 96       [4x4 = 16 patch tokens]
    tokens       class token + 16, learned positions
    blocks       4 pre-norm blocks: 3 heads of 32, MLP 96 -> 192 -> 96, LayerNorm
    norm, head   LayerNorm, then Linear 96 -> 10 on the class token

timm's own VisionTransformer (not a copy of it), so that what hooks a timm ViT (prompt tokens,
the class-token features, LayerNorm adaptation) sees the layout it expects. Its grey channel
is the one fmnist-resnet reads, with the same normalisation, so the demo's folders serve both.
Patches of 7x7, not 4x4: 17 tokens instead of 50 make a training step about three times
cheaper on the CPU, what let it train in about half an hour on the busy 2-core dev machine.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from cafa_cli.model.hub import import_timm

NAME = "fmnist-vit"
ARCHITECTURE = {
    "img_size": 28,
    "patch_size": 7,
    "in_chans": 1,
    "num_classes": 10,
    "embed_dim": 96,
    "depth": 4,
    "num_heads": 3,
    "mlp_ratio": 2.0,
    "class_token": True,
    "global_pool": "token",  # the class token is what the head reads, as FOA's ViT-B/16
}


def build_fmnist_vit() -> nn.Module:
    """The architecture with timm's initialisation (from torch's global generator)."""
    timm = import_timm(NAME)  # one line naming the extra where timm is missing
    return timm.models.VisionTransformer(**ARCHITECTURE)


def load_fmnist_vit(weights: Path) -> nn.Module:
    from safetensors.torch import load_file

    model = build_fmnist_vit()
    model.load_state_dict(load_file(str(weights)), strict=True)
    return model
