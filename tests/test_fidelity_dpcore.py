"""DPCore against a float64 transcription of its authors' update, and DPCore through `cafa adapt`.

The transcription follows zybeich/DPCore imagenet/dpcore.py and vpt.py: obtain_src_stat (the
class token's last-layer features without prompts, of the first source images whose entropy
with the first prompts is below the margin, truncated to the sample count; torch.std_mean),
_eval_coreset (the discrepancy ‖σ − σ^S‖ + ‖μ − μ^S‖ without prompts, the weights
softmax(−(‖μ − μ_k‖ + ‖σ − σ_k‖)/τ), the weighted prompts and the test against ρ times the
plain discrepancy), forward (a known domain: one step of a new AdamW(lr=0.1) from the
weighted prompts and _update_coreset with the step's statistics and the prompts after it, σ
only upward; a new domain: the first prompts back, `steps` steps of a new AdamW, the entry
appended), reset (an empty coreset, the first prompts). Both sides start from the same
prompts (VPT's uniform draw from a torch generator of the seed) on a tiny random-weight timm
ViT in float64.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import fails, rows

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create, method_class
from cafa_cli.methods.recipes import shipped
from cafa_cli.model.features import FeatureClassifier

timm = pytest.importorskip("timm")

PROMPTS, SEED, STEPS, TAU, RHO, ALPHA = 8, 1, 12, 3.0, 0.8, 0.999
MARGIN, SAMPLES = 0.998, 10  # about half the tiny ViT's source images pass; the first 10 of them are kept


def tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, num_classes=10)
    return timm.create_model("vit_tiny_patch16_224", **shape).eval().double()


def first_prompts(vit) -> torch.Tensor:
    """PromptViT's initialisation (VPT's Xavier uniform), drawn from a generator of the seed."""
    val = math.sqrt(6.0 / float(3 * math.prod(vit.patch_embed.patch_size) + vit.embed_dim))
    prompts = torch.zeros(1, PROMPTS, vit.embed_dim, dtype=torch.float64)
    return torch.nn.init.uniform_(prompts, -val, val, generator=torch.Generator().manual_seed(SEED))


def prompt_vit_tokens(vit, x: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
    """PromptViT.forward_features (prompts given) or forward_raw_features (None)."""
    x = vit._pos_embed(vit.patch_embed(x))
    if prompts is not None:
        x = torch.cat((x[:, :1], prompts.expand(x.shape[0], -1, -1), x[:, 1:]), dim=1)
    return vit.norm(vit.blocks(vit.norm_pre(x)))


class AuthorsDPCore:
    """imagenet/dpcore.py's DPCore with PromptViT's forward passes, in float64."""

    def __init__(self, vit, source_batches: list[torch.Tensor]):
        self.vit, self.first = vit, first_prompts(vit)
        self.train_info = self.source_statistics(source_batches)
        self.reset()

    def reset(self):
        self.prompts, self.coreset = self.first.clone(), []

    def tokens(self, x, prompts):
        return prompt_vit_tokens(self.vit, x, prompts)

    def source_statistics(self, batches):
        features, num = [], 0
        with torch.no_grad():
            for images in batches:
                feature = self.tokens(images, None)
                output = self.vit.forward_head(self.tokens(images, self.first))
                ent = -(output.softmax(1) * output.log_softmax(1)).sum(1)
                selected = torch.where(ent < MARGIN * math.log(output.shape[1]))[0]
                features.append(feature[selected][:, 0])
                num += len(selected)
                if num >= SAMPLES:
                    break
        return torch.std_mean(torch.cat(features)[:SAMPLES], dim=0)

    def discrepancy(self, cls_features):
        batch_std, batch_mean = torch.std_mean(cls_features, dim=0)
        loss = torch.norm(batch_std - self.train_info[0], p=2) + torch.norm(batch_mean - self.train_info[1], p=2)
        return loss, batch_mean, batch_std

    def adapt_step(self, x, prompts, optimizer):
        features = self.tokens(x, prompts)
        loss, batch_mean, batch_std = self.discrepancy(features[:, 0])
        output = self.vit.forward_head(features)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return output.detach(), batch_mean.detach(), batch_std.detach()

    def forward(self, x):
        with torch.no_grad():
            loss, batch_mean, batch_std = self.discrepancy(self.tokens(x, None)[:, 0])
            is_id = False
            if self.coreset:
                means = torch.stack([entry[0] for entry in self.coreset])
                stds = torch.stack([entry[1] for entry in self.coreset])
                match = torch.norm(batch_mean - means, p=2, dim=1) + 1.0 * torch.norm(batch_std - stds, p=2, dim=1)
                weights = torch.softmax(-match / TAU, dim=0)
                weighted = torch.stack([w * entry[2] for w, entry in zip(weights, self.coreset)]).sum(0)
                loss_new, _, _ = self.discrepancy(self.tokens(x, weighted)[:, 0])
                is_id = bool(loss_new < loss * RHO)
        if is_id:
            self.prompts = weighted.clone().requires_grad_(True)
            optimizer = torch.optim.AdamW([self.prompts], lr=1e-1)
            outputs, step_mean, step_std = self.adapt_step(x, self.prompts, optimizer)
            updated = self.prompts.detach().clone()
            for w, entry in zip(weights, self.coreset):
                entry[0] += ALPHA * w * (step_mean - entry[0])
                entry[1] += ALPHA * w * torch.clamp(step_std - entry[1], min=0.0)
                entry[2] += ALPHA * w * (updated - entry[2])
        else:
            self.prompts = self.first.clone().requires_grad_(True)
            optimizer = torch.optim.AdamW([self.prompts], lr=1e-1)
            for _ in range(STEPS):
                outputs, _, _ = self.adapt_step(x, self.prompts, optimizer)
            self.coreset.append([batch_mean, batch_std, self.prompts.detach().clone()])
        return outputs


def ours(vit, source, **options):
    options = {"source_margin": MARGIN, "source_samples": SAMPLES, "seed": SEED, **options}
    method = create("dpcore", statistics_batches=source, **options)
    return method, Adapter(FeatureClassifier(vit), method, "cpu", optimizer="adamw", lr=0.1, steps=STEPS)


def domains(count: int) -> list[torch.Tensor]:
    """Batches of 12 from two domains: A A B B A B A (a reset before the last)."""
    torch.manual_seed(1)
    a = lambda: torch.randn(12, 3, 32, 32, dtype=torch.float64) * 1.5 + 0.3  # noqa: E731
    b = lambda: torch.randn(12, 3, 32, 32, dtype=torch.float64) * 0.5 - 0.8  # noqa: E731
    return [draw() for draw in (a, a, b, b, a, b, a)[:count]]


def source_images() -> list[torch.Tensor]:
    torch.manual_seed(2)
    return list(torch.randn(24, 3, 32, 32, dtype=torch.float64).split(8))


def test_dpcore_follows_the_authors_update_batch_after_batch_and_after_a_reset():
    """New domains make entries, known ones refine them all by their weights (two and three
    entries), and a reset empties the coreset: each batch's logits, the coreset and the prompts
    as the authors'."""
    vit, source = tiny_vit(), source_images()
    theirs = AuthorsDPCore(copy.deepcopy(vit), source)
    method, adapter = ours(copy.deepcopy(vit), source)
    sizes = []
    for i, images in enumerate(domains(7)):
        if i == 6:
            adapter.reset()
            theirs.reset()
        logits = adapter.step(images)
        torch.testing.assert_close(logits, theirs.forward(images).float(), rtol=0, atol=1e-6, msg=f"batch {i}")
        sizes.append(len(method.coreset_means))
        assert sizes[-1] == len(theirs.coreset)
        for k, (mean, std, prompts) in enumerate(theirs.coreset):
            torch.testing.assert_close(method.coreset_means[k], mean, rtol=0, atol=1e-9)
            torch.testing.assert_close(method.coreset_stds[k], std, rtol=0, atol=1e-9)
            torch.testing.assert_close(method.coreset_prompts[k], prompts[0], rtol=0, atol=1e-9)
        torch.testing.assert_close(method.tokens.prompts.detach(), theirs.prompts.detach(), rtol=0, atol=1e-9)
    torch.testing.assert_close(method.source_std, theirs.train_info[0], rtol=0, atol=1e-12)
    assert sizes == [1, 1, 2, 2, 3, 3, 1]  # new, known, new, known, new, known (of 3), new after the reset


def test_a_saved_state_goes_on_as_the_uninterrupted_stream():
    vit, source, stream = tiny_vit(), source_images(), domains(4)
    _, whole = ours(copy.deepcopy(vit), source)
    expected = [whole.step(images) for images in stream]
    _, first = ours(copy.deepcopy(vit), source)
    for images in stream[:3]:
        first.step(images)
    method, second = ours(copy.deepcopy(vit), source)
    second.load_state_dict(first.state_dict())
    assert len(method.coreset_means) == 2
    torch.testing.assert_close(second.step(stream[3]), expected[3], rtol=0, atol=0)


def test_a_batch_of_one_image_changes_nothing_and_is_counted_undefined():
    vit, source = tiny_vit(), source_images()
    method, adapter = ours(vit, source)
    adapter.step(domains(1)[0])
    prompts = method.tokens.prompts.detach().clone()
    adapter.step(domains(1)[0][:1])
    assert int(method.undefined) == 1 and len(method.coreset_means) == 1
    assert torch.equal(method.tokens.prompts, prompts)


def test_prompts_on_a_vit_of_dynamic_image_size_leave_its_position_embeddings_alone():
    """timm resamples such a ViT's position embeddings by its prefix-token count, which must not count
    the prompts then (model/prompts.py): the logits are PromptViT's."""
    from cafa_cli.model.prompts import PromptTokens

    torch.manual_seed(0)
    vit = timm.create_model("test_vit", img_size=32, num_classes=3).eval().double()
    assert vit.dynamic_img_size
    plain, x = copy.deepcopy(vit), torch.randn(3, 3, 32, 32, dtype=torch.float64)
    tokens = PromptTokens(vit, PROMPTS)
    with torch.no_grad():
        logits, _ = FeatureClassifier(vit)(x)
        theirs = prompt_vit_tokens(plain, x, tokens.prompts)
    torch.testing.assert_close(logits, plain.forward_head(theirs), rtol=0, atol=1e-12)
    assert vit.num_prefix_tokens == 1 + PROMPTS
    tokens.remove()
    assert vit.num_prefix_tokens == 1


def test_too_few_confident_source_images_is_one_line():
    from cafa_cli.core.errors import UsageError

    method, adapter = ours(tiny_vit(), source_images(), source_margin=0.5)
    with pytest.raises(UsageError, match=r"need 2 confident source images or more, and 0 of the 24 .* source_margin"):
        adapter.step(domains(1)[0])
    assert method_class("dpcore").needs_tokens and not method_class("dpcore").on_any_classifier()


def test_the_recipes_are_the_authors_values():
    recipe = shipped("dpcore", "imagenet-c")
    assert recipe.settings == {
        "optimizer": "adamw",
        "lr": 0.1,
        "steps": 50,
        "batch_size": 64,
        "fisher_samples": 50000,
        "params": "norm",
    }
    options = {"prompts": 8, "temperature": 3.0, "threshold": 0.8, "update_rate": 0.999, "source_samples": 300}
    assert recipe.options == options and "zybeich/DPCore" in recipe.source


# --- through the command line -------------------------------------------------------


@pytest.mark.parametrize("stream", [[], ["--order", "label-shift:1.0", "--reset", "never"]])
def test_dpcore_adapts_a_timm_vit_from_the_command_line(vit_run, stream):
    result = invoke(
        "adapt", *vit_run["model"], "--data", vit_run["data"], "--method", "dpcore", "--source-data", vit_run["source"],
        "--batch-size", "3", "--steps", "3", "--method-option", "source_margin=1", *stream,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 9


def test_dpcore_refuses_the_bundled_cnn_and_a_vit_without_source_images(vit_run):
    garments = write_folder(vit_run["data"].parent / "garments", per_class=1, classes=("trouser", "bag"), size=28)
    refused = invoke("adapt", "--model", "fmnist-resnet", "--data", garments, "--method", "dpcore")
    fails(refused, 2, "dpcore inserts prompt tokens after a vision transformer's class token", "has no tokens")
    refused = invoke("adapt", "--model", TINY_NET, "--data", vit_run["data"], *PLAIN, "--method", "dpcore")
    fails(refused, 2, "TinyNet has no tokens")
    without = invoke("adapt", *vit_run["model"], "--data", vit_run["data"], "--method", "dpcore")
    fails(without, 2, "give --source-data")
