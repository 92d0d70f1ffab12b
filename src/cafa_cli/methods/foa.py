"""FOA: forward-only adaptation (Niu et al., "Test-Time Model Adaptation with Only Forward
Passes", ICML 2024; the authors' mr-eggplant/FOA tta_library/foa.py and models/vpt.py).

No gradient and no change to the weights. A timm ViT gets P prompt tokens after its class
token (model/prompts.py), and for each batch CMA-ES (the `cma` package) proposes K candidate
prompts; each, and the best prompts of the batch before, runs one forward pass and is scored

    fitness = Σ_n H(softmax(f(x_n))) + λ · (N/64) · Σ_l (‖σ_l − σ_l^S‖² + ‖μ_l − μ_l^S‖²)   (Eqn. 5)

μ_l, σ_l the mean and standard deviation (unbiased) over the batch of the class token's
features at layer l (block l's output through block l+1's norm1, the last block's through
the final norm: the features entering the classifier), μ^S, σ^S the same over clean
source images, N the batch size (the authors' discrepancy is scaled to their batch of 64).
CMA-ES is told the K + 1 fitnesses; the batch is predicted by the fittest candidate (the
first of the lowest fitness), its last-layer features shifted toward the source's mean
(Eqns. 7-9, activation shifting):

    logits = W(z + γ·(μ_L^S − m)) + b,   m ← (1 − α)·m + α·mean_k μ_L(candidate k)

m the moving mean of the test features (over every candidate's batch mean), taken after
the batch is predicted, so the first batch after a reset is not shifted.

Source statistics: `statistics_batches`, normalised clean source images (`cafa adapt
--source-data`, `fisher_samples` of them at random, as EATA's Fisher images), run through
the ViT without prompts before the first batch, as the authors' obtain_origin_stat; FOA is
refused without them. Defaults, the authors' (main.py, tta_library/foa.py): P = 3 prompts,
K = 27 (= 4 + 3·ln(3·768) for ViT-B/16), λ = 0.4 (0.2 on ImageNet-R), CMA-ES from mean 0
with step size σ = 1 and seed 2020, γ = 1, α = 0.1.

CMA-ES draws from its own NumPy RandomState seeded with `seed` (the authors' seed their
global one: the same draws, without touching NumPy's global state), and the first prompts
(VPT's Xavier-uniform draw) from a torch generator of the same seed, so a domain's
predictions depend on no other domain's draws; both start again at each reset.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.losses import entropies
from cafa_cli.model.prompts import PromptTokens, token_vit

PROMPTS = 3  # main.py --num_prompts
POPULATION = 27  # tta_library/foa.py _init_cma: "equal to 4 + 3 * np.log(dim) when #prompts=3"
FITNESS_LAMBDA = 0.4  # main.py --fitness_lambda (ImageNet-R: 0.2)
SEED = 2020  # _init_cma's CMA-ES seed, main.py's --seed
REFERENCE_BATCH = 64  # forward_and_get_loss scales the discrepancy by N/64, their batch size
MOMENTUM = 0.1  # _update_hist: 0.9·m + 0.1·mean


class Foa(Method):
    name = "foa"
    trains = False
    owns_update = True  # K + 1 forward passes a batch, no optimiser step (base.py)
    adapts_normalisation = False
    needs_tokens = True
    inputs = ("statistics_batches",)  # normalised clean source images, an iterable of batches
    without_source_images = "is refused: its fitness compares the class-token features with the source's"
    not_served = "the prompt tokens CMA-ES found and the activation shift, outside the network's weights"
    undefined_when = "a batch of one image: its features' standard deviation over the batch is undefined"
    options = (
        Option("prompts", PROMPTS, "P, the prompt tokens inserted after the class token", "count", most=256),
        Option("population", POPULATION, "K, the candidates CMA-ES proposes a batch", "count", most=1024),
        Option("fitness_lambda", FITNESS_LAMBDA, "λ, the weight of the source-statistics discrepancy", "weight"),
        Option("sigma", 1.0, "CMA-ES's initial step size", "positive"),
        Option("shift", 1.0, "γ, the activation shift's step toward the source mean (0: none)", "weight"),
        Option("momentum", MOMENTUM, "α, the weight of each batch in the test features' moving mean", "fraction"),
        Option("seed", SEED, "CMA-ES's seed and the first prompts'", "count0"),
    )
    # made once from its inputs, or from the model (tokens: hooks on it), never changed by a step
    unsaved = (*Method.unsaved, "tokens", "source_std", "source_mean")

    def setup(self) -> None:
        if self.population < 2:
            raise UsageError("foa's option population must be 2 or more: CMA-ES recombines the best half")
        self.tokens: PromptTokens | None = None
        self.source_std = self.source_mean = None
        self.reset()

    def check(self, model, device: torch.device) -> None:
        super().check(model, device)
        token_vit(model, self.name)
        cma()
        if self.statistics_batches is None:
            raise UsageError(
                "foa compares the class-token features of each candidate with the source's, made from clean source "
                "images; give `source_data` (e.g. the training images; in Python, statistics_batches)"
            )

    def reset(self) -> None:
        options = {"seed": math.nan, "randn": np.random.RandomState(self.seed).randn}
        options.update(popsize=self.population, maxiter=-1, verbose=-9)
        dim = 0 if self.tokens is None else self.tokens.prompts.numel()
        self.es = cma().CMAEvolutionStrategy(dim * [0], self.sigma, inopts=options) if dim else None
        self.moving_mean: torch.Tensor | None = None  # m, Eqn. (9)
        if self.tokens is not None:
            self.tokens.initialise(torch.Generator().manual_seed(self.seed))
        self.best = None if self.tokens is None else self.tokens.prompts.detach().clone()

    def state_dict(self) -> dict:
        raise UsageError(
            "foa's CMA-ES search cannot be saved (the cma package keeps it in objects of its own); run without `state`"
        )

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if self.tokens is None:  # the model is on its device now
            vit = token_vit(adapter.model, self.name)
            self.tokens = PromptTokens(vit, self.prompts, torch.Generator().manual_seed(self.seed))
            self.source_std, self.source_mean = self.source_statistics(adapter)
            self.reset()
        width = adapter.model.feature_dim
        shift = None if self.moving_mean is None else self.shift * (self.source_mean[-width:] - self.moving_mean)
        one_image = len(images) < 2
        if one_image:
            self.count_undefined(torch.ones((), dtype=torch.bool, device=images.device))
        candidates = ([] if one_image else self.es.ask()) + [self.best.flatten().double().cpu().numpy()]
        fitnesses, means, best = [], [], None
        with torch.no_grad():
            for candidate in candidates:
                self.tokens.prompts.copy_(torch.as_tensor(candidate).view_as(self.tokens.prompts))
                fitness, logits, features, mean = self.fitness(adapter, images, shift)
                fitnesses.append(fitness)
                means.append(mean[-width:])
                if best is None:
                    best = (fitness, logits, features)
                else:  # the first of the lowest, kept on the device (a NaN fitness is never lower)
                    lower = fitness < best[0]
                    best = tuple(torch.where(lower, new, old) for new, old in zip((fitness, logits, features), best))
        scores = torch.stack(fitnesses).double().cpu().tolist()  # one read a batch: CMA-ES runs on the host
        lowest = min((i for i in range(len(scores)) if not math.isnan(scores[i])), key=scores.__getitem__, default=None)
        if not one_image:
            self.es.tell(candidates, scores)
        if lowest is not None:
            self.best = torch.as_tensor(candidates[lowest]).to(self.best).view_as(self.best)
        batch_mean = torch.stack(means).mean(0)
        m = self.moving_mean
        self.moving_mean = batch_mean if m is None else (1 - self.momentum) * m + self.momentum * batch_mean
        with torch.no_grad():
            self.tokens.prompts.copy_(self.best)  # between batches the network runs with the best prompts
        return best[1], best[2], skipped

    def fitness(self, adapter: AdapterSurface, images: torch.Tensor, shift: torch.Tensor | None):
        """Eqn. (5) of the prompts in place, and the logits and features predicted with them (shifted)."""
        with adapter.autocast:
            logits, features = adapter.forward(images)
            layers = self.tokens.layer_features(features)
        wide = torch.promote_types(features.dtype, torch.float32)  # a float64 model's stay float64
        logits, features, layers = logits.to(wide), features.to(wide), layers.to(wide)
        std, mean = torch.std_mean(layers, dim=0, correction=1 if len(layers) > 1 else 0)  # one image: undefined
        gap = (std - self.source_std).square().sum() + (mean - self.source_mean).square().sum()
        discrepancy = self.fitness_lambda * gap * len(images) / REFERENCE_BATCH
        fitness = entropies(logits).sum() + discrepancy
        if shift is not None:
            features = features + shift
            logits = adapter.model.head(features)
        return fitness, logits, features, mean

    def source_statistics(self, adapter: AdapterSurface) -> tuple[torch.Tensor, torch.Tensor]:
        """σ^S and μ^S [depth·width] of the source images' class-token features, without prompts
        (the authors' obtain_origin_stat; streamed: Chan's merge of each batch's, in float64)."""
        count, mean, scatter = 0, None, None
        self.tokens.enabled = False
        try:
            with torch.no_grad():
                for batch in self.statistics_batches:
                    with adapter.autocast:
                        _, features = adapter.forward(batch.to(self.tokens.prompts.device))
                        layers = self.tokens.layer_features(features)
                    layers = layers.double()
                    n, batch_mean = len(layers), layers.mean(0)
                    batch_scatter = (layers - batch_mean).square().sum(0)
                    if mean is None:
                        count, mean, scatter = n, batch_mean, batch_scatter
                        continue
                    delta, total = batch_mean - mean, count + n
                    mean = mean + delta * (n / total)
                    scatter = scatter + batch_scatter + delta.square() * (count * n / total)
                    count = total
        finally:
            self.tokens.enabled = True
        if count < 2:
            raise UsageError(
                f"foa's source statistics need 2 source images or more, and `source_data` gave {count}; give more"
            )
        dtype = self.tokens.prompts.dtype if self.tokens.prompts.dtype == torch.float64 else torch.float32
        return (scatter / (count - 1)).sqrt().to(dtype), mean.to(dtype)


def cma():
    """The cma package (CMA-ES), or a one-line error naming the extra that installs it."""
    try:
        import cma
    except ImportError:
        raise UsageError("foa needs cma (its CMA-ES), which is not installed: pip install 'cafa-cli[timm]'") from None
    return cma
