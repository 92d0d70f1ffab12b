"""Prompt tokens for a timm vision transformer: learnable tokens inserted into its token
sequence right after the class token, as FOA's PromptViT (mr-eggplant/FOA models/vpt.py,
after VPT-Shallow) does, and the class token's features at the end of each block.

The ViT is not wrapped but hooked, so the FeatureClassifier around it, its state_dict
and the Adapter's view of it stay as they are:

- a pre-hook on `norm_pre` (what timm runs right after the position embeddings and the
  patch dropout, an Identity in most ViTs) inserts the tokens at position 1, so the blocks
  see [class, prompts, (registers), patches], the authors' order; while they are inserted
  the ViT's `num_prefix_tokens` counts them, so that average pooling leaves them out as it
  leaves out the class token (a class-token ViT reads token 0 and is unchanged); but not
  from `patch_embed` to the insertion (a pre-hook there), where a ViT of dynamic image size
  resamples its position embeddings, which hold none of the prompts;
- a hook on each block keeps its output's class token, from which `layer_features()`
  gives the authors' per-layer CLS features: block i's through block i+1's `norm1`, the
  last block's as the classifier takes it (the FeatureClassifier's features: the final
  norm's class token for a class-token ViT).

Any patch size, depth and width; any number of tokens, 0 included (the ViT unchanged).
A model without tokens (a CNN) is declined in one line that says why.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cafa_cli.core.errors import UsageError
from cafa_cli.model.features import FeatureClassifier

NEEDED = ("patch_embed", "blocks", "norm_pre", "cls_token", "num_prefix_tokens", "embed_dim")


def token_vit(model: FeatureClassifier, method: str) -> nn.Module:
    """The timm VisionTransformer inside `model`; a UsageError naming why where there is none."""
    net = getattr(model, "model", model)
    missing = [name for name in NEEDED if getattr(net, name, None) is None]
    blocks = getattr(net, "blocks", None)
    if not missing and not all(isinstance(getattr(b, "norm1", None), nn.Module) for b in blocks):
        missing = ["a norm1 in each block"]
    if missing:
        raise UsageError(
            f"{method} inserts prompt tokens after a vision transformer's class token, and this "
            f"{type(net).__name__} has no tokens (no {', '.join(missing)}); give a timm ViT with a class token "
            f"(--model timm:vit_base_patch16_224, or a factory returning timm's VisionTransformer)"
        )
    return net


class PromptTokens(nn.Module):
    """`count` learnable tokens [1, count, embed_dim] inserted into a timm ViT's token
    sequence after its class token (module docstring). `prompts` is the parameter a method
    trains (by gradient) or sets (a search); `enabled` False runs the ViT as it is."""

    def __init__(self, vit: nn.Module, count: int, generator: torch.Generator | None = None):
        super().__init__()
        self.count = count
        self._enabled = False
        weight = next(vit.parameters())
        self.prompts = nn.Parameter(torch.zeros(1, count, vit.embed_dim, dtype=weight.dtype, device=weight.device))
        self.patch_area = math.prod(vit.patch_embed.patch_size)
        self.initialise(generator)
        self._vit = [vit]  # a list: the ViT is not a submodule of its prompts
        self._own_prefix = vit.num_prefix_tokens  # the class token and registers, which the positions count
        self._classes: list[torch.Tensor | None] = [None] * len(vit.blocks)
        self._hooks = [vit.patch_embed.register_forward_pre_hook(self._before_positions)]
        self._hooks += [vit.norm_pre.register_forward_pre_hook(self._insert)]
        self._hooks += [block.register_forward_hook(self._keeper(i)) for i, block in enumerate(vit.blocks)]
        self.enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Inserted or not; while inserted, the ViT's prefix tokens count them (module docstring)."""
        self._enabled = on
        self.vit.num_prefix_tokens = self._own_prefix + (self.count if on else 0)

    def initialise(self, generator: torch.Generator | None = None) -> None:
        """VPT's Xavier-uniform draw, U(−v, v) with v = √(6 / (3·patch area + width)), as the
        authors' PromptViT (nn.init.uniform_ in the prompts' dtype, on the CPU); from `generator`
        where given."""
        bound = math.sqrt(6.0 / float(3 * self.patch_area + self.prompts.shape[-1]))
        drawn = torch.empty(self.prompts.shape, dtype=self.prompts.dtype).uniform_(-bound, bound, generator=generator)
        with torch.no_grad():
            self.prompts.copy_(drawn)

    @property
    def vit(self) -> nn.Module:
        return self._vit[0]

    def _before_positions(self, module, inputs):
        self.vit.num_prefix_tokens = self._own_prefix

    def _insert(self, module, inputs):
        self.enabled = self._enabled  # the prompts counted again (_before_positions left them out)
        if not self._enabled or self.count == 0:
            return None
        x = inputs[0]
        prompts = self.prompts.to(x.dtype).expand(x.shape[0], -1, -1)
        return (torch.cat((x[:, :1], prompts, x[:, 1:]), dim=1), *inputs[1:])

    def _keeper(self, index: int):
        def keep(module, inputs, output):
            self._classes[index] = output[:, 0]

        return keep

    def layer_features(self, features: torch.Tensor) -> torch.Tensor:
        """The last forward pass's class-token features of every block, concatenated [N, depth·width]:
        block i's through block i+1's norm1, the last one's `features` (those entering the classifier)."""
        blocks = self.vit.blocks
        kept = [blocks[i + 1].norm1(self._classes[i]) for i in range(len(blocks) - 1)]
        self._classes = [None] * len(blocks)
        return torch.cat([*kept, features], dim=1)

    def remove(self) -> None:
        """Take the hooks off the ViT: it runs as it did before."""
        self.enabled = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
