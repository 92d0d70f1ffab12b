"""FOA against a float64 transcription of its authors' code, the prompt-token wrapper, and FOA
through `cafa adapt`.

The transcription follows mr-eggplant/FOA: models/vpt.py (PromptViT: the prompts after the
class token, the class token's features of every layer, block i's through block i+1's
norm1, the last through the final norm) and tta_library/foa.py (FOA.forward: CMA-ES's
candidates and the previous best each scored by entropy + λ·discrepancy·N/64, the first of
the lowest reported with its features shifted by the source mean minus the moving mean of
the test features, which moves 0.9/0.1 after the batch; obtain_origin_stat's torch.std_mean
over the source features without prompts; reset's new CMA-ES and new prompts). Both sides
run CMA-ES from the `cma` package with seed 2020 (theirs seeding NumPy's global generator as
their _init_cma does, ours its own RandomState) and start from the same prompts (VPT's
uniform draw from a torch generator of seed 2020), on a tiny random-weight timm ViT in float64.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import fails, rows

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create, method_class
from cafa_cli.methods.recipes import shipped
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.prompts import PromptTokens, token_vit

timm = pytest.importorskip("timm")
cma = pytest.importorskip("cma")

PROMPTS, SEED, LAMBDA = 3, 2020, 0.4


def tiny_vit(**changes) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, num_classes=10)
    return timm.create_model("vit_tiny_patch16_224", **{**shape, **changes}).eval()


def first_prompts(vit, count: int = PROMPTS) -> torch.Tensor:
    """PromptViT's initialisation (VPT's Xavier uniform), drawn from a generator of seed 2020."""
    val = math.sqrt(6.0 / float(3 * math.prod(vit.patch_embed.patch_size) + vit.embed_dim))
    prompts = torch.zeros(1, count, vit.embed_dim, dtype=torch.float64)
    return torch.nn.init.uniform_(prompts, -val, val, generator=torch.Generator().manual_seed(SEED))


def layers_cls_features(vit, x: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
    """PromptViT.layers_cls_features(_with_prompts)."""
    x = vit._pos_embed(vit.patch_embed(x))
    if prompts is not None:
        x = torch.cat((x[:, :1], prompts.expand(x.shape[0], -1, -1), x[:, 1:]), dim=1)
    x = vit.norm_pre(x)
    features = []
    for i in range(len(vit.blocks)):
        x = vit.blocks[i](x)
        features.append(vit.blocks[i + 1].norm1(x[:, 0]) if i < len(vit.blocks) - 1 else vit.norm(x[:, 0]))
    return torch.cat(features, dim=1)


class AuthorsFoa:
    """tta_library/foa.py's FOA, with its forward_and_get_loss, in float64."""

    def __init__(self, vit, source: torch.Tensor, population: int):
        self.vit, self.population = vit, population
        with torch.no_grad():
            self.train_info = torch.std_mean(layers_cls_features(vit, source, None), dim=0)
        self.reset()

    def reset(self):
        options = {"seed": SEED, "popsize": self.population, "maxiter": -1, "verbose": -9}
        self.es = cma.CMAEvolutionStrategy(PROMPTS * self.vit.embed_dim * [0], 1, inopts=options)
        self.hist_stat = None
        self.best_prompts = first_prompts(self.vit)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = self.vit.embed_dim
        shift_vector = None if self.hist_stat is None else self.train_info[1][-D:] - self.hist_stat
        best_loss, best_outputs, batch_means, losses = np.inf, None, [], []
        prompts = self.es.ask() + [self.best_prompts.flatten().numpy()]
        for prompt in prompts:
            candidate = torch.tensor(prompt, dtype=torch.float64).reshape(1, PROMPTS, D)
            features = layers_cls_features(self.vit, x, candidate)
            batch_std, batch_mean = torch.std_mean(features, dim=0)
            std_mse = (batch_std - self.train_info[0]) ** 2
            mean_mse = (batch_mean - self.train_info[1]) ** 2
            discrepancy = LAMBDA * (std_mse.sum() + mean_mse.sum()) * x.shape[0] / 64
            cls_features = features[:, -D:]
            output = self.vit.head(cls_features)
            loss = discrepancy + (-(output.softmax(1) * output.log_softmax(1)).sum(1)).sum()
            if shift_vector is not None:
                output = self.vit.head(cls_features + 1.0 * shift_vector)
            batch_means.append(batch_mean[-D:].unsqueeze(0))
            if best_loss > loss.item():
                self.best_prompts, best_loss, best_outputs = candidate, loss.item(), output
            losses.append(loss.item())
        self.es.tell(prompts, losses)
        batch_means = torch.cat(batch_means, dim=0).mean(0)
        self.hist_stat = batch_means if self.hist_stat is None else 0.9 * self.hist_stat + 0.1 * batch_means
        return best_outputs


def test_foa_follows_the_authors_step_batch_after_batch_and_after_a_reset():
    """Four batches of 12 (a reset before the last), K = 27 candidates and the previous best:
    each batch's reported logits, the CMA-ES mean and the moving mean as the authors'."""
    vit = tiny_vit().double()
    torch.manual_seed(1)
    source = torch.randn(20, 3, 32, 32, dtype=torch.float64)
    stream = [torch.randn(12, 3, 32, 32, dtype=torch.float64) * 1.5 + 0.3 for _ in range(4)]
    theirs = AuthorsFoa(copy.deepcopy(vit), source, population=27)
    method = create("foa", statistics_batches=list(source.split(8)))  # the statistics streamed in 3 batches
    ours = Adapter(FeatureClassifier(copy.deepcopy(vit)), method, "cpu")
    for i, images in enumerate(stream):
        if i == 3:
            ours.reset()
            theirs.reset()
        mine = ours.step(images)
        torch.testing.assert_close(mine, theirs.forward(images).float(), rtol=0, atol=1e-6, msg=f"batch {i}")
        np.testing.assert_allclose(method.es.mean, theirs.es.mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(method.moving_mean, theirs.hist_stat, rtol=0, atol=1e-9)
    assert method.es.countiter == 1  # the reset started a new search


def test_its_cma_es_leaves_numpy_and_torch_global_generators_alone():
    vit = tiny_vit()
    method = create("foa", statistics_batches=[torch.randn(4, 3, 32, 32)], population=4)
    adapter = Adapter(FeatureClassifier(vit), method, "cpu")
    first, second = torch.randn(6, 3, 32, 32), torch.randn(6, 3, 32, 32)
    np.random.seed(5)
    numpy_before, torch_before = np.random.get_state()[1].copy(), torch.get_rng_state()
    adapter.step(first)
    adapter.reset()
    adapter.step(second)
    assert (np.random.get_state()[1] == numpy_before).all() and torch.equal(torch.get_rng_state(), torch_before)
    assert not method_class("foa").draws_random_numbers


@pytest.mark.parametrize("patch, depth", [(4, 1), (8, 3), (16, 2)])
def test_prompt_tokens_go_after_the_class_token_at_any_patch_size_and_depth(patch, depth):
    vit = tiny_vit(patch_size=patch, depth=depth).double()
    model = FeatureClassifier(vit)
    x = torch.randn(5, 3, 32, 32, dtype=torch.float64)
    plain, _ = model(x)
    tokens = PromptTokens(vit, 2)
    assert tokens.prompts.dtype == torch.float64 and vit.num_prefix_tokens == 3
    with torch.no_grad():
        logits, features = model(x)
        layers = tokens.layer_features(features)
        tokens.enabled = False  # the transcription inserts them itself
        expected = layers_cls_features(vit, x, tokens.prompts)
        tokens.enabled = True
    torch.testing.assert_close(layers, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits, vit.head(expected[:, -vit.embed_dim :]), rtol=0, atol=1e-12)
    assert not torch.allclose(logits, plain)
    tokens.enabled = False  # the ViT as it was
    torch.testing.assert_close(model(x)[0], plain, rtol=0, atol=0)
    tokens.enabled = True
    tokens.remove()
    assert vit.num_prefix_tokens == 1
    torch.testing.assert_close(model(x)[0], plain, rtol=0, atol=0)


def test_average_pooling_leaves_the_prompts_out_as_it_leaves_the_class_token():
    vit = tiny_vit(global_pool="avg").double()
    model = FeatureClassifier(vit)
    tokens = PromptTokens(vit, 3)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    seen = {}
    hook = vit.norm.register_forward_hook(lambda module, inputs, output: seen.update(tokens=output))
    with torch.no_grad():
        _, features = model(x)
    hook.remove()
    assert seen["tokens"].shape[1] == 1 + 3 + 16
    torch.testing.assert_close(features, vit.fc_norm(seen["tokens"][:, 4:].mean(1)), rtol=0, atol=1e-12)
    tokens.remove()


def test_a_model_without_tokens_is_declined_in_one_line_that_says_why():
    import tiny_net

    with pytest.raises(UsageError, match=r"foa inserts prompt tokens .* this TinyNet has no tokens \(no patch_embed"):
        token_vit(FeatureClassifier(tiny_net.build()), "foa")
    with pytest.raises(UsageError, match="give `source_data`"):
        Adapter(FeatureClassifier(tiny_vit()), create("foa"), "cpu")
    assert method_class("foa").needs_tokens and not method_class("foa").on_any_classifier()


def test_the_recipes_are_the_authors_values():
    recipe = shipped("foa", "imagenet-c")
    assert recipe.settings["batch_size"] == 64 and recipe.settings["fisher_samples"] == 50_000
    assert recipe.options == {"prompts": 3, "population": 27, "fitness_lambda": 0.4}
    assert "mr-eggplant/FOA" in recipe.source


# --- through the command line -------------------------------------------------------


@pytest.mark.parametrize("stream", [[], ["--order", "label-shift:1.0", "--reset", "never"]])
def test_foa_adapts_a_timm_vit_from_the_command_line(vit_run, stream):
    result = invoke(
        "adapt", *vit_run["model"], "--data", vit_run["data"], "--method", "foa", "--source-data", vit_run["source"],
        "--batch-size", "3", "--method-option", "population=4", *stream,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 9


def test_foa_refuses_the_bundled_cnn_and_a_vit_without_source_images(vit_run):
    garments = write_folder(vit_run["data"].parent / "garments", per_class=1, classes=("trouser", "bag"), size=28)
    refused = invoke("adapt", "--model", "fmnist-resnet", "--data", garments, "--method", "foa")
    fails(refused, 2, "foa inserts prompt tokens after a vision transformer's class token", "has no tokens")
    refused = invoke("adapt", "--model", TINY_NET, "--data", vit_run["data"], *PLAIN, "--method", "foa")
    fails(refused, 2, "TinyNet has no tokens")
    without = invoke("adapt", *vit_run["model"], "--data", vit_run["data"], "--method", "foa")
    fails(without, 2, "give --source-data")


def test_foa_with_a_state_file_refuses_before_the_first_prediction(vit_run, tmp_path):
    result = invoke(
        "adapt", *vit_run["model"], "--data", vit_run["data"], "--method", "foa", "--source-data", vit_run["source"],
        "--batch-size", "3", "--reset", "never", "--state", tmp_path / "state.safetensors",
    )  # fmt: skip
    fails(result, 2, "foa's CMA-ES search cannot be saved")
    assert result.stdout.count("\n") <= 1 and not (tmp_path / "state.safetensors").exists()
