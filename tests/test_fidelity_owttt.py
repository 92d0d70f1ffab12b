"""OWTTT, the last of issue 63's outlier-aware methods, against a float64 transcription of its
authors' update on the tiny net of test_fidelity.py, and through `cafa adapt`.

Transcribed from Yushu-Li/OWTTT cifar/OURS.py (the test-time training loop, Prototype_Pool,
append_prototypes, compute_os_variance) and cifar/utils/offline.py (offline: the class means
and the global mean and biased covariance of the source features, `covariance`). The update
draws no random numbers; the reference takes its source statistics from the source features
themselves, ours from the class Gaussians estimated from the same features and labels (what
`cafa stats` stores), so the path through the artifact is checked too.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import write_folder
from helpers import adapt, invoke, rows
from test_fidelity import C, tiny

from cafa_cli.data.fashion_mnist import DEFAULT_ROOT
from cafa_cli.data.fmnist_c import build_corrupted, build_training_subset
from cafa_cli.engine.adapter import Adapter
from cafa_cli.jobs.shared.results import auroc
from cafa_cli.methods import create
from cafa_cli.methods.recipes import shipped
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments


def data(seed: int = 3, n_batches: int = 6, size: int = 16, outliers: int = 5, scale: float = 1.0):
    """Source images near ten prototypes (8 a class), and test batches of shifted ones with
    `outliers` noise images each, which the tiny net places far from every class."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(C, 3, 6, 6, generator=g) * 2
    labels = torch.arange(C).repeat(8)
    source = prototypes[labels] + 0.3 * torch.randn(len(labels), 3, 6, 6, generator=g)
    xs = []
    for _ in range(n_batches):
        inliers = prototypes[torch.randint(0, C, (size - outliers,), generator=g)] * scale + 0.1
        inliers = inliers + 0.3 * torch.randn(inliers.shape, generator=g)
        noise = 3 * torch.randn(outliers, 3, 6, 6, generator=g)
        xs.append(torch.cat([inliers, noise])[torch.randperm(size, generator=g)])
    return source, labels, xs


def extractor(model):
    """The authors' `ext`: the network up to its classifier (TinyResNet's pooled layer4)."""
    return lambda x: model.layer4(model.layer3(F.relu(model.bn(model.conv(x))))).mean((2, 3))


def compute_os_variance(os, th):
    """Within-group variance of the scores split at th; inf when a side is empty."""
    above = os >= th
    w1 = np.count_nonzero(above) / os.size
    w0 = 1 - w1
    if w1 == 0 or w0 == 0:
        return np.inf
    return w0 * np.var(os[~above]) + w1 * np.var(os[above])


def best_threshold(os):
    threshold_range = np.arange(0, 1, 0.01)
    return threshold_range[np.argmin([compute_os_variance(os, th) for th in threshold_range])]


def owttt_reference(net, source, labels, xs, lr, delta, ce_scale, da_scale, queue_length, max_prototypes):
    model = copy.deepcopy(net).double()
    ext = extractor(model)
    ext_params = [p for name, p in model.named_parameters() if not name.startswith("fc.")]
    model.eval()
    with torch.no_grad():  # offline()
        feats = ext(source.double())
    ext_src_mu = torch.stack([feats[labels == c].mean(0) for c in range(C)])
    n = len(feats)
    ones = torch.ones(1, n, dtype=torch.float64) @ feats
    cov_src = (feats.T @ feats - ones.T @ ones / n) / n
    mu_src = feats.mean(0)
    weak_prototype = F.normalize(ext_src_mu)
    d = feats.shape[1]
    template = torch.eye(d, dtype=torch.float64) * (cov_src.max().item() / 30.0)
    optimizer = torch.optim.SGD(ext_params, lr=lr, momentum=0.9)
    memory = None  # Prototype_Pool.memory
    queue, ema_n = [], 0.0
    ema_mu, ema_cov = torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)

    def pool(x, all_=False):
        if memory is None:
            return None
        out = x @ memory.T
        return out if all_ else (out / delta).max(1)[0][:, None]

    history, paths = [], []
    for x in xs:
        x = x.double()
        model.eval()
        optimizer.zero_grad()
        loss = torch.tensor(0.0, dtype=torch.float64)
        feat_ext = ext(x)
        logit = F.normalize(feat_ext) @ weak_prototype.T / delta
        strong = pool(F.normalize(feat_ext))
        new_logit = logit if strong is None else torch.cat([logit, strong], 1)
        pro, _ = new_logit[:, :C].max(-1)
        ood_score = 1 - pro * delta
        queue = (queue + ood_score.detach().tolist())[-queue_length:]
        ts = best_threshold(np.array(queue))
        seen_mask, unseen_mask = ood_score < ts, ood_score >= ts
        r_i, pseudo_labels = new_logit.max(-1)
        if unseen_mask.sum().item() != 0:
            in_score = 1 - r_i * delta
            ts_pro = best_threshold(in_score[unseen_mask].detach().numpy())
            source_cos = logit.detach() * delta  # append_prototypes
            added = []
            while True:
                feat_mat = pool(F.normalize(feat_ext), all_=True)
                with_pool = source_cos if feat_mat is None else torch.cat([source_cos, feat_mat], 1)
                r_i_pro = with_pool.max(-1)[0]
                r = source_cos.max(-1)[0]
                for a in added:
                    r[a] = 1
                min_logit, min_index = r.min(0)
                if not (1 - min_logit) > ts:
                    break
                added.append(min_index)
                if (1 - r_i_pro[min_index]) > ts_pro:
                    new = F.normalize(feat_ext[min_index][None].detach())
                    if memory is None:
                        memory = new
                    elif memory.shape[0] < max_prototypes:
                        memory = torch.cat([memory, new])
                    else:
                        memory = torch.cat([memory[1:], new])
                    memory = F.normalize(memory)
        len_memory = new_logit.shape[1]
        if len_memory != C:
            if seen_mask.sum().item() != 0:
                pseudo_labels[seen_mask] = new_logit[seen_mask, :C].softmax(-1).max(-1)[1]
            if unseen_mask.sum().item() != 0:
                pseudo_labels[unseen_mask] = C
        if seen_mask.sum().item() != 0:
            model.train()
            feat_global = ext(x[seen_mask])
            b = feat_global.shape[0]
            ema_n += b
            alpha = 1.0 / 1280 if ema_n > 1280 else 1.0 / ema_n
            delta_pre = feat_global - ema_mu
            shift = alpha * delta_pre.sum(0)
            tmp_mu = ema_mu + shift
            tmp_cov = ema_cov + alpha * (delta_pre.T @ delta_pre - b * ema_cov) - shift[:, None] @ shift[None, :]
            ema_mu, ema_cov = tmp_mu.detach(), tmp_cov.detach()
            source_domain = torch.distributions.MultivariateNormal(mu_src, cov_src + template)
            target_domain = torch.distributions.MultivariateNormal(tmp_mu, tmp_cov + template)
            kl = torch.distributions.kl_divergence
            loss = loss + da_scale * (kl(source_domain, target_domain) + kl(target_domain, source_domain)) * 0.05
        filtered = len_memory != C and seen_mask.sum().item() != 0 and unseen_mask.sum().item() != 0
        seen_before = int(seen_mask.sum())
        if filtered:
            a, _ = torch.sort(ood_score[seen_mask], descending=True)
            filter_down = a[-int(seen_mask.sum().item() * (1 / 2))]
            a, _ = torch.sort(ood_score[unseen_mask], descending=True)
            filter_up = a[int(unseen_mask.sum().item() * (1 / 2))]
            for j in range(len(pseudo_labels)):
                if ood_score[j] >= filter_down and seen_mask[j]:
                    seen_mask[j] = False
                if ood_score[j] <= filter_up and unseen_mask[j]:
                    unseen_mask[j] = False
        if len_memory != C:
            entropy_seen = torch.nn.CrossEntropyLoss()(new_logit[seen_mask, :C], pseudo_labels[seen_mask])
            entropy_unseen = torch.nn.CrossEntropyLoss()(new_logit[unseen_mask], pseudo_labels[unseen_mask])
            loss = loss + ce_scale * (entropy_seen + entropy_unseen) / 2  # NaN for an empty side, no NaN gradient
        if loss.requires_grad:  # their try: loss.backward() ... except: 'can not backward'
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.eval()
            cosines = F.normalize(ext(x)) @ weak_prototype.T
        paths.append((seen_before, int(seen_mask.sum()), len_memory != C, filtered))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        history.append(((cosines / delta).softmax(-1), cosines.max(-1)[0], state, memory))
    return history, paths


def gaussians_of(net, source, labels):
    model = FeatureClassifier(copy.deepcopy(net)).eval()
    with torch.no_grad():
        features = model(source)[1]
    moments = ClassMoments(C, model.feature_dim)
    moments.update(features, labels)
    return estimate(moments, "full", "auto")


def test_owttt_under_its_cifar10_recipe_matches_the_authors_update():
    net = tiny(seed=1, sharp=1.0)
    source, labels, xs = data()
    r = shipped("owttt", "cifar10-c")
    s, o = r.settings, r.options
    assert (s["optimizer"], s["momentum"], s["params"]) == ("sgd", 0.9, "all")
    o = {**o, "queue_length": 40, "max_prototypes": 3}  # the queue and the pool fill within the six batches
    lr = 0.003  # the alignment's gradients on the tiny net are large: the recipe's 0.01 amplifies float32's rounding
    adapter = Adapter(
        FeatureClassifier(copy.deepcopy(net)),
        create("owttt", gaussians_of(net, source, labels), **o),
        optimizer="sgd",
        lr=lr,
        momentum=0.9,
        params="all",
    )
    expected, paths = owttt_reference(
        net, source, labels, xs, lr, o["delta"], o["ce_scale"], o["da_scale"], 40, o["max_prototypes"]
    )
    for x, (probabilities, nearest, state, memory) in zip(xs, expected):
        logits = adapter.step(x)
        torch.testing.assert_close(logits.softmax(1).double(), probabilities, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(adapter.method.id_score(logits).double(), nearest, rtol=1e-4, atol=1e-5)
        mine = adapter.model.model.state_dict()
        for name, value in state.items():  # every weight but fc's, and the running statistics
            if value.is_floating_point():
                torch.testing.assert_close(mine[name].double(), value, rtol=2e-4, atol=2e-5, msg=name)
        torch.testing.assert_close(adapter.method.outliers.double(), memory, rtol=1e-4, atol=1e-5)
    # every path of the update was taken: the alignment, the cross-entropy, the filter keeping some seen
    # images, a batch with none seen, a full pool
    assert paths == [(0, 0, False, False), (13, 5, True, True), (0, 0, True, False)] + [
        (0, 0, True, False),
        (6, 2, True, True),
        (0, 0, True, False),
    ], paths
    assert len(adapter.method.outliers) == 3 and len(adapter.method.queue) == 40
    assert not torch.equal(adapter.model.model.bn.running_mean, net.bn.running_mean)  # moved by the alignment pass
    assert torch.equal(adapter.model.model.fc.weight, net.fc.weight)  # the classifier is not trained


def test_owttts_recipes_hold_the_authors_scripts():
    got = {
        recipe: (r.settings["lr"], r.settings["batch_size"], r.options["ce_scale"], r.options["da_scale"])
        for recipe in ("imagenet-c", "cifar10-c", "cifar100-c")
        for r in [shipped("owttt", recipe)]
    }
    assert got == {
        "imagenet-c": (0.001, 128, 0.05, 0.1),
        "cifar10-c": (0.01, 256, 0.2, 1.0),
        "cifar100-c": (0.001, 256, 0.2, 1.0),
    }


def test_the_symmetric_kl_is_torchs():
    from cafa_cli.methods.owttt import symmetric_kl

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g, dtype=torch.float64)
    cov_s, cov_t = a.T @ a / 7 + 0.1 * torch.eye(5), b.T @ b / 9 + 0.1 * torch.eye(5)
    mu_s, mu_t = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    s, t = torch.distributions.MultivariateNormal(mu_s, cov_s), torch.distributions.MultivariateNormal(mu_t, cov_t)
    expected = torch.distributions.kl_divergence(s, t) + torch.distributions.kl_divergence(t, s)
    chol = torch.linalg.cholesky(cov_s)
    torch.testing.assert_close(symmetric_kl(mu_s, chol, torch.cholesky_inverse(chol), mu_t, cov_t), expected)
    assert symmetric_kl(mu_s, chol, torch.cholesky_inverse(chol), mu_t, -cov_t).isnan()  # not positive definite


# --- through the command line -------------------------------------------------------------


def outlier_scores(records: list[dict]) -> tuple[list[float], list[float]]:
    inside = [float(r["id_score"]) for r in records if r["outlier"] == "0"]
    return inside, [float(r["id_score"]) for r in records if r["outlier"] == "1"]


@pytest.mark.parametrize(
    "stream",
    [("--outliers", "noise:gaussian:0.2"), ("--order", "label-shift:1.0"), ("--reset", "never")],
    ids=lambda s: s[1],
)
def test_owttt_runs_through_cafa_adapt(setup, tmp_path, stream):
    """Two domains of 18 images, batches of 6 (with outliers: 4 more a domain, scored by its id_score,
    which the AUROC takes, not the softmax's maximum)."""
    shifted = write_folder(tmp_path / "shifted", per_class=6, seed=1, shift=0.3)
    out = tmp_path / "m.json"
    result = adapt(
        setup, setup["train"], "--data", shifted, "--method", "owttt", "--batch-size", "6", "--quiet", *stream,
        "--metrics-json", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    predictions = rows(result)
    outliers = stream[0] == "--outliers"
    assert len(predictions) == (36 + 2 * 4 if outliers else 36)
    assert {row["prediction"] for row in predictions} <= {"a", "b", "c"}
    if outliers:
        assert sum(row["outlier"] == "1" for row in predictions) == 8
        inside, outside = outlier_scores(predictions)
        assert all(-1 <= score <= 1 for score in inside + outside)  # the largest cosine to a class mean
        assert any(float(r["id_score"]) != float(r["confidence"]) for r in predictions)
        assert json.loads(out.read_text())["auroc"] == pytest.approx(auroc(inside, outside), abs=1e-6)


@pytest.mark.skipif(not DEFAULT_ROOT.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_owttt_on_the_bundled_model_with_an_artifact_of_its_own(tmp_path):
    """fmnist-resnet, an artifact of 10 training images a class (as the demo's, smaller), and
    Fashion-MNIST-C gaussian_noise with Gaussian-noise outliers."""
    train = build_training_subset(tmp_path, 10)
    (domain,) = build_corrupted(tmp_path, ["gaussian_noise"], 3, 3)
    artifact = tmp_path / "fmnist.safetensors"
    made = invoke(
        "stats", "--model", "fmnist-resnet", "--data", train, "--per-class", "10", "--out", artifact, "--quiet"
    )
    assert made.exit_code == 0, made.stderr
    out = tmp_path / "m.json"
    result = invoke(
        "adapt", "--stats", artifact, "--model", "fmnist-resnet", "--data", domain, "--method", "owttt",
        "--outliers", "noise:gaussian:0.2", "--batch-size", "16", "--metrics-json", out, "--quiet",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    records = rows(result)
    inside, outside = outlier_scores(records)
    assert len(inside) == 30 and len(outside) > 0
    assert json.loads(out.read_text())["auroc"] == pytest.approx(auroc(inside, outside), abs=1e-6)
