"""TPT: test-time prompt tuning (Shu et al., "Test-Time Prompt Tuning for Zero-Shot
Generalization in Vision-Language Models", NeurIPS 2022; azshue/TPT).

Update rule, for each test image x on its own (episodic): the image and B augmented views of
it (methods/shared/zero_shot.py), their unit-norm image embeddings f_b (the image encoder is
frozen, so they are computed once, without gradients), and the class embeddings t_c(v) of
CoOp's prompts [SOS] v_1 … v_M [CLASS]. (model/clip.PromptedTexts), whose M context token
embeddings v start, for each image, from those of "a photo of a". The logits are
s·f_bᵀt_c(v), s the model's temperature. The ρ·(B + 1) views of lowest entropy (`share`
ρ, chosen at the first step and kept) give the loss, the entropy of their mean prediction,

    L(v) = −Σ_c p̄_c log p̄_c,   p̄ = (1/|S|) Σ_{b∈S} softmax(s·f_bᵀ t(v)),

and `steps` optimiser steps (the Adapter's: AdamW, lr 5e-3, as the authors') on v alone,
from a fresh optimiser state. The prediction reported for x is s·f_xᵀ t(v), x's own
embedding against the tuned prompts' (tpt_classification.py: test_time_tuning, then
model(image)); the next image starts again from "a photo of a". So a batch of N images is N
episodes, one after the other.

The classifier's own head (a prompt ensemble, CuPL descriptions) is not used: TPT's prompts
are the one template. Nothing of the model changes (BatchNorms of a CLIP ResNet keep their
source statistics). Options and defaults, the authors' (scripts/test_tpt.sh, the parser's
defaults): B = 63 (`views`; batch size 64), ρ = 0.1 (`share`), `augment` crop (their
ImageNet sets; augmix on the fine-grained ones).
"""

from __future__ import annotations

import torch
from torch import nn

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.optimiser import restart_state
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.losses import marginal_entropy
from cafa_cli.methods.shared.zero_shot import AUGMENT, confident, widened, with_views, zero_shot_head
from cafa_cli.model.clip import PromptedTexts
from cafa_cli.model.features import FeatureClassifier

CONTEXT = "a photo of a"  # the authors' ctx_init (scripts/test_tpt.sh: a_photo_of_a)


class Tpt(Method):
    name = "tpt"
    needs_clip = True
    draws_random_numbers = True  # the views, from torch's generator
    owns_update = True  # an episode per image, each from the initial prompt
    adapts_normalisation = False
    running_norms = "it is episodic and adapts no normalisation layer"
    not_served = "each image is predicted after tuning prompts of its own"
    generator: torch.Generator | None = None  # the views' random numbers; None: the device's default
    unsaved = (*Method.unsaved, "generator", "prompts", "scale")
    per_batch = (*Method.per_batch, "adapted")
    options = (
        Option("views", 63, "B, the augmented views of each image besides itself", "count", most=1024),
        Option(
            "share",
            0.1,
            "ρ, the share of the views, lowest entropy first, whose mean prediction it sharpens",
            "fraction",
        ),
        AUGMENT,
    )

    def setup(self) -> None:
        self.adapted: tuple | None = None

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        zero_shot_head(model, self.name, text_tower=True)

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """The prompt's context embeddings alone (`params` changes nothing): the model is frozen."""
        classifier = zero_shot_head(model, self.name, text_tower=True)
        model.requires_grad_(False)
        self.prompts = PromptedTexts(classifier.text, CONTEXT).to(classifier.head.weight.device)
        self.scale = classifier.logit_scale
        return [self.prompts.ctx]

    def before_step(self, images: torch.Tensor) -> None:
        self.adapted = None

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if self.adapted is None:  # the batch's later steps: its episodes have run them
            self.adapted = self.episodes(adapter, images)
        return self.adapted

    def episodes(self, adapter: AdapterSurface, images: torch.Tensor):
        b = 1 + self.views
        with torch.no_grad(), adapter.autocast:
            _, features = adapter.forward(with_views(images, self.views, self.augment, self.generator))
        features = features.view(len(images), b, -1)
        logits, flags = [], []
        for image in features:
            self.prompts.reset()
            restart_state(adapter.optimizer)
            chosen, flag = None, None
            for _ in range(adapter.steps):
                with adapter.autocast:
                    out = self.scale * image @ self.prompts().to(image.dtype).T
                chosen = confident(widened(out.detach()), self.share) if chosen is None else chosen
                flag = adapter.apply(marginal_entropy(widened(out[chosen])), flag)
            with torch.no_grad(), adapter.autocast:
                logits.append(widened(self.scale * image[:1] @ self.prompts().to(image.dtype).T))
            flags.append(flag)
        return torch.cat(logits), widened(features[:, 0]), torch.stack(flags).amax(0)

    def reset(self) -> None:
        if hasattr(self, "prompts"):
            self.prompts.reset()
