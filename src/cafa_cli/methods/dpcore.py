"""DPCore: dynamic prompt coreset (Zhang et al., "DPCore: Dynamic Prompt Coreset for Continual
Test-Time Adaptation", ICML 2025; the authors' zybeich/DPCore imagenet/dpcore.py, vpt.py,
conf.py and cfgs/dpcore.yaml).

A timm ViT gets P prompt tokens after its class token (model/prompts.py), trained by
gradient to align the batch statistics of the class token's last-layer features z (those
entering the classifier) with the source's:

    L(p) = ‖σ(p) − σ^S‖ + ‖μ(p) − μ^S‖        (their λ = 1 on the first term; L2 norms, not squared)

μ, σ the mean and the (unbiased) standard deviation of z over the batch. A coreset keeps
one entry per domain found: the statistics (μ_k, σ_k) of its first batch without prompts
and the prompts p_k learnt on it. For each batch, under no gradient:

1. μ, σ without prompts, and their discrepancy L₀ to the source's;
2. with a coreset, the weights w = softmax(−(‖μ − μ_k‖ + ‖σ − σ_k‖) / τ) over its K
   entries, the weighted prompts p_w = Σ_k w_k p_k, and their discrepancy L_w;
3. L_w < ρ·L₀ (the batch is of a known domain): one AdamW step on L from p_w, the batch
   predicted with p_w (before the step), and every entry moved toward the batch by α·w_k:
   μ_k += α w_k (μ' − μ_k), σ_k += α w_k max(σ' − σ_k, 0), p_k += α w_k (p' − p_k), with
   μ', σ' the statistics with p_w (the step's forward pass: the authors' variables are
   overwritten by it) and p' the prompts after the step;
4. otherwise (no coreset, or a new domain): the prompts start again from their first
   draw, `steps` AdamW steps on L from a fresh optimiser state (the Adapter's: the
   recipe's adamw, lr 0.1, weight decay 0.01, the authors' hard-coded AdamW), the batch
   predicted by the last step's forward pass (before that step), and (μ, σ, the prompts
   after the last step) appended to the coreset.

Between batches the network runs with the prompts of the last step. A reset empties the
coreset and puts the first prompts back (the authors reset once, before the first
corruption: `--reset never` is their protocol).

Source statistics: `statistics_batches`, normalised clean source images (`cafa adapt
--source-data`, `fisher_samples` of them at random), as the authors' obtain_src_stat: the
class token's last-layer features without prompts, of the first `source_samples` images
(300) whose prediction with the first prompts has an entropy below `source_margin`·ln C
(theirs ln(1000)/2 − 1 at C = 1000), computed before the first batch. Defaults, the
authors' (conf.py, cfgs/dpcore.yaml): P = 8, τ = 3, ρ = 0.8, α = 0.999.

The first prompts (VPT's uniform draw) come from a torch generator of `seed`, so a
domain's predictions depend on no other domain's draws.
"""

from __future__ import annotations

import math

import torch

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.optimiser import restart_state
from cafa_cli.engine.options import MOST_COUNT, Option
from cafa_cli.methods.shared.losses import entropies
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.prompts import PromptTokens, token_vit

PROMPTS = 8  # conf.py / cfgs/dpcore.yaml OPTIM.PROMPT_NUM
TEMPERATURE = 3.0  # OPTIM.TEMP_TAU
THRESHOLD = 0.8  # OPTIM.THR_RHO
UPDATE_RATE = 0.999  # OPTIM.EMA_ALPHA
SOURCE_SAMPLES = 300  # conf.py SRC_NUM_SAMPLES
# obtain_src_stat keeps the source images of entropy below ln(1000)/2 − 1: this share of ln C at C = 1000
SOURCE_MARGIN = 0.5 - 1 / math.log(1000)
SEED = 1  # conf.py RNG_SEED


class DPCore(Method):
    name = "dpcore"
    owns_update = True  # a coreset test, then one step or `steps` from the first prompts (module docstring)
    adapts_normalisation = False
    needs_tokens = True
    inputs = ("statistics_batches",)  # normalised clean source images, an iterable of batches
    without_source_images = "is refused: it aligns the class token's statistics with the source's"
    not_served = "the prompt tokens it learnt, outside the network's weights"
    undefined_when = "a batch of one image: its features' standard deviation over the batch is undefined"
    options = (
        Option("prompts", PROMPTS, "P, the prompt tokens inserted after the class token", "count", most=256),
        Option("temperature", TEMPERATURE, "τ, the softmax temperature of the coreset's weights", "positive"),
        Option(
            "threshold",
            THRESHOLD,
            "ρ, a batch is of a known domain when the coreset's prompts leave less than ρ times its discrepancy",
            "fraction",
        ),
        Option(
            "update_rate",
            UPDATE_RATE,
            "α, how far a known domain's batch moves each entry (times its weight)",
            "fraction",
        ),
        Option(
            "source_samples",
            SOURCE_SAMPLES,
            "the confident source images the source statistics take",
            "count",
            most=MOST_COUNT,
        ),
        Option(
            "source_margin",
            SOURCE_MARGIN,
            "a source image is confident when its entropy is below this share of ln C (1: every image)",
            "fraction",
        ),
        Option("seed", SEED, "the first prompts' seed", "count0", most=MOST_COUNT),
    )
    # made once from the seed, the inputs and the model, never changed by a step
    unsaved = (*Method.unsaved, "first_prompts", "source_std", "source_mean")
    per_batch = (*Method.per_batch, "adapted")

    def setup(self) -> None:
        self.tokens: PromptTokens | None = None
        self.first_prompts = self.source_std = self.source_mean = None
        self.adapted: tuple | None = None
        self.reset()

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        super().check(model, device)
        token_vit(model, self.name)
        if self.statistics_batches is None:
            raise UsageError(
                "dpcore aligns the class token's statistics with the source's, made from clean source images; give "
                "`source_data` (e.g. the training images; in Python, statistics_batches)"
            )

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[torch.nn.Parameter]:
        """The prompts alone (`params` changes nothing): the ViT is frozen."""
        vit = token_vit(model, self.name)
        model.requires_grad_(False)
        if self.tokens is None:
            self.tokens = PromptTokens(vit, self.prompts, torch.Generator().manual_seed(self.seed))
            self.first_prompts = self.tokens.prompts.detach().clone()
        return [self.tokens.prompts]

    def reset(self) -> None:
        self.coreset_means = self.coreset_stds = self.coreset_prompts = None  # [K, d], [K, d], [K, P, D]
        if self.tokens is not None:
            with torch.no_grad():
                self.tokens.prompts.copy_(self.first_prompts)

    def before_step(self, images: torch.Tensor) -> None:
        self.adapted = None

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if self.adapted is None:  # the batch's later calls: its steps have run
            self.adapted = self.adapt(adapter, images, skipped)
        return self.adapted

    def adapt(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if self.source_mean is None:  # the model is on its device and adapter.autocast is known
            self.source_std, self.source_mean = self.source_statistics(adapter)
        prompts = self.tokens.prompts
        if len(images) < 2:
            self.count_undefined(torch.ones((), dtype=torch.bool, device=images.device))
            with torch.no_grad(), adapter.autocast:
                logits, features = adapter.forward(images)
            return logits.detach(), features.detach(), skipped
        with torch.no_grad():
            self.tokens.enabled = False
            try:
                *_, plain_gap, std, mean = self.forward_loss(adapter, images)
            finally:
                self.tokens.enabled = True
            weights = None
            if self.coreset_means is not None:
                distance = (mean - self.coreset_means).norm(dim=1) + (std - self.coreset_stds).norm(dim=1)
                weights = torch.softmax(-distance / self.temperature, dim=0)
                weighted = torch.einsum("k,kpd->pd", weights.to(prompts.dtype), self.coreset_prompts)
                prompts.copy_(weighted.view_as(prompts))
                *_, weighted_gap, _, _ = self.forward_loss(adapter, images)
                if not bool(weighted_gap < self.threshold * plain_gap):  # one read a batch: the branch
                    weights = None
        restart_state(adapter.optimizer)  # the authors' new AdamW for each branch
        if weights is not None:  # a known domain: one step from the weighted prompts
            logits, features, loss, known_std, known_mean = self.forward_loss(adapter, images)
            flag = adapter.apply(loss, skipped)
            self.move_coreset(weights, known_std.detach(), known_mean.detach(), prompts.detach())
            return logits.detach(), features.detach(), flag
        with torch.no_grad():
            prompts.copy_(self.first_prompts)
        flag = skipped
        for _ in range(adapter.steps):
            logits, features, loss, _, _ = self.forward_loss(adapter, images)
            flag = adapter.apply(loss, flag)
        self.add_to_coreset(std, mean, prompts.detach())
        return logits.detach(), features.detach(), flag

    def forward_loss(self, adapter: AdapterSurface, images: torch.Tensor):
        """The logits and features of a forward pass (with the prompts as they are, or without
        them), the discrepancy L of the features' statistics to the source's, and σ, μ."""
        with adapter.autocast:
            logits, features = adapter.forward(images)
        wide = features.to(torch.promote_types(features.dtype, torch.float32))  # a float64 model's stay float64
        std, mean = torch.std_mean(wide, dim=0)
        loss = (std - self.source_std).norm() + (mean - self.source_mean).norm()
        return logits, features, loss, std, mean

    def move_coreset(self, weights, std: torch.Tensor, mean: torch.Tensor, prompts: torch.Tensor) -> None:
        """Each entry toward a known domain's batch by α·w_k (σ_k only upward, as the authors')."""
        rate = (self.update_rate * weights)[:, None]
        self.coreset_means += rate * (mean - self.coreset_means)
        self.coreset_stds += rate * (std - self.coreset_stds).clamp(min=0.0)
        self.coreset_prompts += rate[:, :, None].to(prompts.dtype) * (prompts[0] - self.coreset_prompts)

    def add_to_coreset(self, std: torch.Tensor, mean: torch.Tensor, prompts: torch.Tensor) -> None:
        entry = (mean[None], std[None], prompts.clone())  # prompts [1, P, D]: one entry
        if self.coreset_means is None:
            self.coreset_means, self.coreset_stds, self.coreset_prompts = entry
            return
        self.coreset_means, self.coreset_stds, self.coreset_prompts = (
            torch.cat((kept, new))
            for kept, new in zip((self.coreset_means, self.coreset_stds, self.coreset_prompts), entry)
        )

    def source_statistics(self, adapter: AdapterSurface) -> tuple[torch.Tensor, torch.Tensor]:
        """σ^S and μ^S [d] of the class token's last-layer features without prompts, over the first
        `source_samples` source images predicted confidently with the first prompts (obtain_src_stat)."""
        prompts = self.tokens.prompts
        held, kept, count, seen = prompts.detach().clone(), [], 0, 0
        with torch.no_grad():
            prompts.copy_(self.first_prompts)  # after a loaded state too: the authors' prompts at this point
            try:
                for batch in self.statistics_batches:
                    batch = batch.to(prompts.device)
                    with adapter.autocast:
                        logits, _ = adapter.forward(batch)
                        self.tokens.enabled = False
                        try:
                            _, features = adapter.forward(batch)
                        finally:
                            self.tokens.enabled = True
                    wide = torch.promote_types(features.dtype, torch.float32)
                    logits = logits.to(wide)
                    confident = entropies(logits) < self.source_margin * math.log(logits.shape[1])
                    kept.append(features.to(wide)[confident])
                    count, seen = count + len(kept[-1]), seen + len(batch)
                    if count >= self.source_samples:
                        break
            finally:
                prompts.copy_(held)
        if count < 2:
            raise UsageError(
                f"dpcore's source statistics need 2 confident source images or more, and {count} of the {seen} "
                f"`source_data` gave had an entropy below {self.source_margin:g}·ln C; give more source images, or "
                f"a larger method option source_margin (1: every image)"
            )
        return torch.std_mean(torch.cat(kept)[: self.source_samples], dim=0)
