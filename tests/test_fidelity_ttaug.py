"""Test-time augmentation (ttaug) under its recipes against a float64 transcription of the
benchmark collection's prediction (mariodoebler/test-time-adaptation classification/
methods/ttaug.py: forward, the image and its views concatenated, the model's logits
averaged; datasets/data_loading.py: AugMixAugmenter, the image first, then its views),
with a fixed draw of the views on both sides (methods/shared/augmix.py, generators seeded alike)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_fidelity import TinyResNet, authors_model, batches, tiny

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods.recipes import shipped
from cafa_cli.methods.shared.augmix import augmix
from cafa_cli.model.features import FeatureClassifier


class RectifiedTop(TinyResNet):
    """A ReLU after the top BatchNorm: without it a batch of one image pools to the top BatchNorm's
    β whatever the image, and so do the mean logits of any batch (logits linear in the pooled features)."""

    def forward(self, x):
        x = F.relu(self.layer4(self.layer3(F.relu(self.bn(self.conv(x))))))
        return self.fc(x.mean((2, 3)))


def rectified(sharp: float = 20.0) -> RectifiedTop:
    net = RectifiedTop()
    net.load_state_dict(tiny(sharp=sharp).state_dict())
    return net


def ttaug_reference(net, images, copies: int, crop: str, generator, average: str) -> torch.Tensor:
    """One batch: its images, then each image's views (its own together), through one forward
    pass (BatchNorms on the statistics of all of them), averaged per image over itself and its views."""
    model = authors_model(net)
    views = augmix(images, copies, generator, crop).double()
    with torch.no_grad():
        logits = model(torch.cat([images.double(), views]))
    n = len(images)
    out = []
    for i in range(n):
        rows = [logits[i]] + [logits[n + i * copies + b] for b in range(copies)]
        if average == "logits":
            out.append(sum(rows) / len(rows))
        else:
            out.append((sum(row.softmax(0) for row in rows) / len(rows)).log())
    return torch.stack(out)


@pytest.mark.parametrize("recipe", ["cifar10-c", "imagenet-c"])
@pytest.mark.parametrize("average", ["logits", "probabilities"])
def test_ttaug_averages_over_each_image_and_its_views_as_the_collection(recipe, average):
    r = shipped("ttaug", recipe)
    assert r.settings == {"batch_size": 1, "norm": "alpha:0.1"}  # one image a batch: α-BN, not its own statistics
    assert r.options == {"copies": 32, "average": "logits", "crop": "resized" if recipe == "imagenet-c" else "padded"}
    o = {**r.options, "average": average, "copies": 5}  # fewer views: the same rule
    net = rectified()
    for images in (batches(1, size=1, seed=2)[0], batches(1, size=3, seed=3)[0]):  # the recipe's batch of 1, and 3
        method = create("ttaug", **o)
        method.generator = torch.Generator().manual_seed(11)
        adapter = Adapter(FeatureClassifier(copy.deepcopy(net)), method)
        before = copy.deepcopy(adapter.model.state_dict())
        got = adapter.step(images)
        want = ttaug_reference(net, images, 5, o["crop"], torch.Generator().manual_seed(11), average)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        # not the plain prediction, and nothing trained: the same weights after the step
        plain = authors_model(net)(images.double()).detach()
        assert not torch.allclose(got.double(), plain, atol=1e-3)
        assert all(torch.equal(v, adapter.model.state_dict()[k]) for k, v in before.items() if "served" not in k)
        assert adapter.params == [] and adapter.optimizer is None


def test_no_exported_network_predicts_as_ttaug():
    from cafa_cli.core.errors import UsageError

    with pytest.raises(UsageError, match="ttaug predicts with more than its network"):
        Adapter(FeatureClassifier(rectified()), create("ttaug", copies=2)).export()
